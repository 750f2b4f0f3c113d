"""The settings reference (docs/configuration.md), generated from the Settings object so it cannot drift.

    python -m service.ops.settings_reference [--check] [--output docs/configuration.md]

Writes the reference, or with --check exits 1 when the file differs from what the settings say now
(a test runs the same comparison).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

from service.ops.settings import ENV_PREFIX, Settings

REFERENCE_PATH = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
HEADER = """# Configuration reference

Generated from `service/ops/settings.py` by `python -m service.ops.settings_reference`; a test checks that
it matches. Every setting is a flag and an environment variable: a flag beats the environment,
which beats the default. Booleans take `--flag` / `--no-flag`, and `1/0`, `true/false`, `yes/no`,
`on/off` in the environment. Bounds are checked at start: a bad value stops the server with one
line naming it, exit status 2. Limits, their statuses and metrics are explained in
[operations](operations.md); the process model and `--frontends` in [architecture](architecture.md),
with what each setting's default is for ([Serving](architecture.md#serving)).

Other environment variables: the standard `OTEL_*` ones configure tracing ([tracing](tracing.md));
the clients and tools read `ENCODER_CLIENT_*` ([operations](operations.md#clients-over-tls-and-with-keys));
the image sets `ORT_DISABLE_TELEMETRY=1` ([operations](operations.md#deployment)).

| flag | environment | default | meaning |
| --- | --- | --- | --- |
"""


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def _default(item: dataclasses.Field) -> str:
    value = item.default
    if isinstance(value, bool):
        return "on" if value else "off"
    if value in ("", ()):
        return "(none)"
    return f"`{value}`"


def render() -> str:
    """The whole reference, one table row per setting, in the settings' own order."""
    rows = []
    for item in dataclasses.fields(Settings):
        flag = "--" + item.name.replace("_", "-")
        meaning = item.metadata["help"]
        choices = item.metadata.get("choices")
        if choices:
            meaning += f" (one of {', '.join(choices)})"
        rows.append(f"| `{flag}` | `{ENV_PREFIX}{item.name.upper()}` | {_cell(_default(item))} | {_cell(meaning)} |\n")
    return HEADER + "".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    """Write the reference, or check it (exit 1 when stale)."""
    parser = argparse.ArgumentParser(
        prog="python -m service.ops.settings_reference", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--output", type=Path, default=REFERENCE_PATH, help="where the reference lives")
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is not what the settings say")
    arguments = parser.parse_args(argv)
    text = render()
    if arguments.check:
        current = arguments.output.read_text() if arguments.output.exists() else ""
        if current != text:
            sys.stderr.write(f"{arguments.output} is stale: run python -m service.ops.settings_reference\n")
            return 1
        return 0
    arguments.output.parent.mkdir(parents=True, exist_ok=True)
    arguments.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
