"""The ingestion's progress: a bar redrawn in place on a terminal, plain lines elsewhere, a summary at the end."""

from __future__ import annotations

import io

from client.progress import Progress


class Terminal(io.StringIO):
    """Text written to a terminal."""

    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_bar_redrawn_in_place_then_the_summary() -> None:
    screen = Terminal()
    progress = Progress(total=10, skipped=4, stream=screen, calls_retried=lambda: 2, interval_s=1e-9)
    progress.resent = 1
    progress.advance(3)
    progress.finish()
    bar, summary = screen.getvalue().split("\r\x1b[K")
    assert bar.startswith("\r[" + "#" * 21 + "." * 9 + "] 7/10 texts, ")
    assert "texts/s, ETA " in bar and bar.endswith(", 3 retries\x1b[K")
    assert summary.startswith("embedded 3 texts in ") and "(4 done by an earlier run), 3 retries; 7/10 rows" in summary


def test_a_log_gets_plain_lines_and_quiet_gets_nothing() -> None:
    log = io.StringIO()
    progress = Progress(total=10, skipped=0, stream=log, interval_s=1e-9)
    progress.advance(5)
    progress.advance(5, tokens=120)  # the server's count of the batch's tokens
    progress.finish()
    lines = log.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines[:2]] == ["5/10 texts", "10/10 texts"]
    assert "tokens/s" not in lines[0] and " tokens/s, ETA " in lines[1] and progress.tokens == 120
    assert lines[2].startswith("embedded 10 texts in ") and " tokens/s)" in lines[2] and "\r" not in log.getvalue()
    quiet = Progress(total=10, skipped=0, stream=None, interval_s=1e-9)
    quiet.advance(10)
    quiet.finish()  # nowhere to write: nothing fails
