"""Models served by their name (`--model [NAME=]SOURCE`): exported at start, in a subprocess, into the export cache.

The process that loads models (a lone server, or the engine process) runs `python -m export --source
SOURCE --export-cache DIR` for each one: the exporter and torch stay out of the server's processes.
The exporter resolves the source (huggingface_hub), serves a cache hit at once, or exports under the
entry's lock and renames the entry into place once the gate has passed (export.cache); its last line on
stdout is the model's folder. While it runs, each of its stages becomes the model's reason for not
being ready ("exporting: stage 7 of 16, fp32: parity gate on every graph form") and a line of the log.
A source that cannot be served ends the export with one line, which ExportFailed carries.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from service.core.repository import RepositoryError
from service.core.sources import NamedSource, parse_model_argument
from service.ops.settings import Settings

log = logging.getLogger(__name__)

_STAGE = re.compile(r"^export \[\s*[\d.]+ s\] stage\s+(\d+) of (\d+): (.*)$")
_PR_SET_PDEATHSIG = 1
MAX_REASON_CHARS = 200
"""A progress line longer than this is cut in the model's reason (the log has it whole)."""


class ExportFailed(RepositoryError):
    """A model given by name could not be exported (or was refused by the gate): the exporter's own line."""


def named_models(settings: Settings) -> list[NamedSource]:
    """The models `--model` names, in order (the settings checked that each one reads)."""
    return [parse_model_argument(text) for text in settings.model]


def cache_folder(settings: Settings) -> Path:
    """--export-cache, or $XDG_CACHE_HOME/encoder-serve, or ~/.cache/encoder-serve (as export.cache says)."""
    if settings.export_cache:
        return Path(settings.export_cache).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "encoder-serve"


def export_variants(settings: Settings) -> str:
    """--export-variants, or (auto) what this server can serve: fp32, fp16 where CUDA is usable, int8 if chosen."""
    if settings.export_variants != "auto":
        return settings.export_variants
    variants = ["fp32"]
    if settings.variant == "int8":
        variants.append("int8")
    if settings.device != "cpu" and settings.variant in ("auto", "fp16"):
        from service.core.runtime import cuda_unavailable_reason  # noqa: PLC0415 - ONNX Runtime: model processes only

        if cuda_unavailable_reason(settings.cuda_device_id) is None:
            variants.append("fp16")
    return ",".join(variants)


def export_command(model: NamedSource, settings: Settings) -> list[str]:
    """The exporter's command line for one model."""
    return [
        sys.executable, "-m", "export",
        "--source", model.source.text,
        "--name", model.name,
        "--export-cache", str(cache_folder(settings)),
        "--variants", export_variants(settings),
        "--threads", str(settings.resolved_intra_op_threads()),
        "--gate-forms", "fastest-first",
    ]  # fmt: skip


def _die_with_parent() -> None:
    """In the exporter, before it runs: killed when the server dies, so no export outlives it."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def progress_reason(line: str) -> str | None:
    """A line of the exporter's as the model's reason for not being ready yet; None for lines that are not progress."""
    match = _STAGE.match(line)
    if match is not None:
        reason = f"exporting: stage {match[1]} of {match[2]}, {match[3]}"
    elif line.startswith("export: ") and not line.startswith("export: error"):
        reason = "exporting: " + line.removeprefix("export: ")
    else:
        return None
    return reason if len(reason) <= MAX_REASON_CHARS else reason[: MAX_REASON_CHARS - 3] + "..."


async def export(model: NamedSource, settings: Settings, progress: Callable[[str], None]) -> Path:
    """Export one model into the cache (or find it there): its folder. ExportFailed with the exporter's line."""
    command = export_command(model, settings)
    log.info("model %s: %s", model.name, " ".join(command[1:]))
    progress("exporting: starting the exporter")
    process = await asyncio.create_subprocess_exec(
        *command,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        preexec_fn=_die_with_parent,
    )
    last = ""
    try:
        stdout = asyncio.ensure_future(process.stdout.read())
        async for raw in process.stderr:
            line = raw.decode(errors="replace").rstrip()
            if not line:
                continue
            last = line
            log.info("model %s: %s", model.name, line)
            reason = progress_reason(line)
            if reason is not None:
                progress(reason)
        lines = (await stdout).decode(errors="replace").splitlines()
        code = await process.wait()
    finally:
        if process.returncode is None:  # cancelled (the server stops): the export goes, its partial entry with it
            process.kill()
            await process.wait()
    if code != 0 or not lines:
        message = last.removeprefix("export: ").removeprefix("error: ") or f"the exporter exited with status {code}"
        raise ExportFailed(f"model {model.name}: {message}")
    return Path(lines[-1])
