"""The documentation: the settings reference matches the settings, and every link leads somewhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from service.ops import settings_reference
from service.ops.settings import Settings
from tests.deploy.test_monitoring import METRICS

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
# [text](target): inline links and images; code spans are removed first, so examples in them do not count.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"`[^`\n]*`")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = CODE_SPAN.sub(lambda found: found.group(0).strip("`"), heading).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a document's headings give (a repeated heading gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text())):
        base = anchor(heading)
        count = seen.get(base, 0)
        found.add(base if count == 0 else f"{base}-{count}")
        seen[base] = count + 1
    return found


def links(path: Path) -> list[str]:
    """The link targets of a document, outside code blocks and code spans."""
    text = CODE_SPAN.sub("", FENCE.sub("", path.read_text()))
    return LINK.findall(text)


def broken_links(path: Path) -> list[str]:
    """Relative links to files that do not exist, or to anchors the target does not have."""
    broken = []
    for target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not checked offline
            continue
        file_part, _, fragment = target.partition("#")
        destination = (path.parent / file_part).resolve() if file_part else path
        if not destination.exists():
            broken.append(f"{target}: no such file")
        elif fragment and destination.suffix == ".md" and fragment not in anchors(destination):
            broken.append(f"{target}: no heading for #{fragment}")
    return broken


def test_the_settings_reference_is_what_the_settings_say() -> None:
    assert settings_reference.main(["--check"]) == 0, "run: python -m service.ops.settings_reference"
    text = settings_reference.REFERENCE_PATH.read_text()
    for item in Settings.__dataclass_fields__.values():
        assert f"`--{item.name.replace('_', '-')}`" in text


def test_a_stale_reference_is_caught(tmp_path: Path) -> None:
    stale = tmp_path / "configuration.md"
    stale.write_text(settings_reference.render().replace("--grpc-port", "--grpc-prt"))
    assert settings_reference.main(["--check", "--output", str(stale)]) == 1
    assert settings_reference.main(["--output", str(stale)]) == 0
    assert settings_reference.main(["--check", "--output", str(stale)]) == 0


def documented_metrics(path: Path) -> set[str]:
    """Metric names in the first cell of a document's tables (`encoder_x_total{label}`, `a`, `b` ...)."""
    names = set()
    for line in path.read_text().splitlines():
        if line.startswith("| `encoder_"):
            first_cell = line.split("|")[1]
            names |= {
                re.sub(r"_(total|bucket|sum|count)$", "", name) for name in re.findall(r"`(encoder_\w+)", first_cell)
            }
    return names


def test_every_metric_the_server_declares_is_in_the_metrics_table() -> None:
    documented = documented_metrics(ROOT / "docs" / "operations.md")
    assert documented >= METRICS, f"not in docs/operations.md's metrics table: {sorted(METRICS - documented)}"


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_link_leads_somewhere(path: Path) -> None:
    assert broken_links(path) == []


def test_the_link_check_catches_a_missing_file_and_a_missing_heading(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other\n\n## Limits and security\n")
    page = tmp_path / "page.md"
    page.write_text(
        "See [other](other.md#limits-and-security), [gone](gone.md), [nowhere](other.md#no-such),"
        " [web](https://example.com/x), `[code](not-checked.md)` and [self](#page).\n\n# Page\n"
    )
    assert broken_links(page) == ["gone.md: no such file", "other.md#no-such: no heading for #no-such"]
