"""Command line: export an encoder into a model repository.

python -m export --repository DIR                       # the default model, all-MiniLM-L6-v2
python -m export --repository DIR --source SOURCE       # a folder, or a Hugging Face id: org/name[@REVISION]
python -m export --export-cache DIR --source SOURCE     # into the export cache (export.cache), once per key
python -m export --repository DIR --random              # a small random encoder (tests)

With --export-cache the last line on stdout is the model's folder in the cache (what `python -m service
--model` serves); an entry already there is used as it is, without loading the exporter.

Progress is one line per stage on stderr; warnings from this project show, library chatter (the
ONNX Runtime optimiser and quantiser logs) only with --verbose.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from export.cache import CacheKey, ExportCache, exporter_version
from export.sources import ResolvedSource, UnusableSource, folder_digest, resolve
from service.core.repository import VARIANT_FILES
from service.core.sources import SourceSyntaxError, parse_source

if TYPE_CHECKING:
    from export.checkpoints.checkpoint import Checkpoint

DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"
VARIANTS = tuple(VARIANT_FILES)
SERVING_FLAGS = ("max_batch_size", "max_queue_delay_us", "max_queue_size")
"""Batching defaults written into config.pbtxt (export.publish.ServingDefaults's fields; unset: its defaults)."""
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
"""Write failures that mean the disk (or a quota, or a file size limit) is full."""
RANDOM_CONFIG = {
    "vocab_size": 1000,
    "d_model": 64,
    "num_heads": 4,
    "num_layers": 2,
    "ffn_dim": 128,
    "max_positions": 128,
}


OPENMP_ENVIRONMENT = {"OMP_WAIT_POLICY": "PASSIVE"}
"""Set unless the environment sets it: PyTorch's OpenMP threads sleep between parallel regions instead of
spinning (all-MiniLM-L6-v2's gate references, 2 threads, a shared 2-CPU machine: 51.5 CPU seconds spinning,
23.0 passive; docs/benchmarks.md)."""


def _variants(text: str) -> tuple[str, ...]:
    chosen = tuple(v.strip() for v in text.split(",") if v.strip())
    unknown = sorted(set(chosen) - set(VARIANTS))
    if unknown or "fp32" not in chosen:
        raise argparse.ArgumentTypeError(f"variants must include fp32 and come from {', '.join(VARIANTS)}")
    return chosen


def _dimensions(text: str) -> tuple[int, ...]:
    """A comma-separated list of positive widths."""
    try:
        widths = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from error
    if not widths or min(widths) <= 0:
        raise argparse.ArgumentTypeError(f"widths must be positive integers: {text!r}")
    return widths


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    """Parse and check the command line."""
    parser = argparse.ArgumentParser(prog="python -m export", description=__doc__.splitlines()[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--repository", type=Path, help="model repository to write into")
    target.add_argument("--export-cache", type=Path, help="export cache to export into, once per key (export.cache)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--source", help="a Hugging Face / sentence-transformers folder, or a Hugging Face id: org/name[@REVISION]"
    )
    source.add_argument("--random", action="store_true", help="a small randomly initialised encoder")
    parser.add_argument("--random-config", type=json.loads, default={}, help="JSON overrides for --random")
    parser.add_argument("--tokenizer", type=Path, help="with --random: a folder whose tokenizer.json to ship")
    parser.add_argument("--name", help="model name in the repository (default: the source's)")
    parser.add_argument(
        "--matryoshka-dimensions",
        type=_dimensions,
        default=(),
        help="comma-separated widths the embedding was trained to be shortened to (e.g. 768,512,256)",
    )
    parser.add_argument(
        "--embedding-calibration",
        type=Path,
        help="texts (one a line) the embedding's int8/uint8 ranges are measured on (default: the gate sentences)",
    )
    parser.add_argument("--variants", type=_variants, default=VARIANTS, help="comma-separated, fp32 always")
    parser.add_argument("--threads", type=_positive, default=2, help="threads for the measurements")
    parser.add_argument(
        "--gate-forms",
        choices=("all", "fastest-first"),
        default="all",
        help="gate every CPU graph form (all), or measure them and gate the fastest first until one passes"
        " (the same gate on what is published, in less time: python -m service --model uses it)",
    )
    parser.add_argument("--int8-min-speedup", type=float, default=1.6, help="int8 speed bar over fp32")
    parser.add_argument("--max-batch-size", type=_positive, help="config.pbtxt's (default 64)")
    parser.add_argument("--max-queue-delay-us", type=int, help="config.pbtxt's (default 0)")
    parser.add_argument("--max-queue-size", type=_positive, help="config.pbtxt's (default 1024)")
    parser.add_argument("--seed", type=int, default=0, help="seed for --random")
    parser.add_argument("--verbose", action="store_true", help="show every log line, library chatter included")
    parser.add_argument("--log-level", default="INFO", help="with --verbose: the logging level")
    arguments = parser.parse_args(argv)
    if arguments.export_cache is not None and arguments.random:
        parser.error("--random cannot be exported into the cache: give --repository")
    return arguments


class ProjectWarnings(logging.Filter):
    """Without --verbose: this project's warnings and anyone's errors, nothing else."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Keep a record or not."""
        ours = record.name.split(".")[0] in ("export", "service")
        return record.levelno >= (logging.WARNING if ours else logging.ERROR)


def _configure_logging(arguments: argparse.Namespace) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    if not arguments.verbose:
        handler.addFilter(ProjectWarnings())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(arguments.log_level.upper() if arguments.verbose else logging.WARNING)


class StageDisplay:
    """Prints each export stage as it starts (`stage 7 of 16: ...`), with the time since the export began."""

    def __init__(self, total: int) -> None:
        self.started = time.monotonic()
        self.count = 0
        self.total = total

    def __call__(self, name: str) -> None:
        """Announce one stage."""
        self.count += 1
        self.total = max(self.total, self.count)
        elapsed = time.monotonic() - self.started
        print(f"export [{elapsed:5.1f} s] stage {self.count:2d} of {self.total}: {name}", file=sys.stderr, flush=True)


def _say(text: str) -> None:
    """A line of progress that is not a stage (resolving the source, the cache)."""
    print(f"export: {text}", file=sys.stderr, flush=True)


def _checkpoint(arguments: argparse.Namespace, source: ResolvedSource | None, name: str) -> Checkpoint:
    """The source model the arguments name."""
    # Here, not at the top: a cache hit never loads torch and the exporter (seconds of a server's start).
    from export.checkpoints.checkpoint import default_model_folder, load_checkpoint, random_checkpoint  # noqa: PLC0415
    from export.families.bert import ConfigError, EncoderConfig  # noqa: PLC0415

    if arguments.random:
        try:
            config = EncoderConfig(**{**RANDOM_CONFIG, **arguments.random_config})
        except TypeError as error:
            raise ConfigError(f"--random-config: {error}") from error
        return random_checkpoint(
            config, arguments.name or "random-encoder", seed=arguments.seed, tokenizer_folder=arguments.tokenizer
        )
    folder = source.folder if source is not None else default_model_folder()
    return load_checkpoint(folder, name, arguments.matryoshka_dimensions)


def _options(arguments: argparse.Namespace) -> dict[str, object]:
    """The options that shape the result (they are part of the cache key), as plain values."""
    return {
        "variants": list(arguments.variants),
        "int8_min_speedup": arguments.int8_min_speedup,
        "gate_forms": arguments.gate_forms,
        "embedding_calibration": str(arguments.embedding_calibration or ""),
        "matryoshka_dimensions": list(arguments.matryoshka_dimensions),
        "serving": {flag: getattr(arguments, flag) for flag in SERVING_FLAGS if getattr(arguments, flag) is not None},
    }


def _export(
    arguments: argparse.Namespace, source: ResolvedSource | None, name: str, repository: Path, in_cache: bool = False
) -> int:
    """Load, export, gate and publish into a repository; the exit status (1: the gate refused).

    in_cache: the repository is a partial cache entry, which holds the intermediate graphs too (the cache's
    volume is sized for them; /tmp in a pod is not).
    """
    from export.build import ExportOptions, export_model, planned_stages  # noqa: PLC0415
    from export.gate.parity import GateRefused  # noqa: PLC0415
    from export.publish import ServingDefaults  # noqa: PLC0415

    settings = _options(arguments)
    options = ExportOptions(
        variants=arguments.variants,
        threads=arguments.threads,
        int8_min_speedup=arguments.int8_min_speedup,
        gate_forms=arguments.gate_forms,
        serving=ServingDefaults(**settings["serving"]),
    )
    if arguments.embedding_calibration is not None:
        options = dataclasses.replace(options, embedding_calibration=arguments.embedding_calibration)
    checkpoint = _checkpoint(arguments, source, name)
    try:
        display = StageDisplay(planned_stages(checkpoint, options))
        report = export_model(checkpoint, repository, options, display, scratch=repository if in_cache else None)
    except GateRefused as error:
        print(f"export: {error}", file=sys.stderr)
        return 1
    published = ", ".join(report["variants"])
    print(f"published {checkpoint.name} ({published}) to {repository / checkpoint.name}")
    for device, choice in report["preferred_variants_basis"].items():
        print(f"default on {device}: {choice['variant']} ({choice['basis']})")
    return 0


def _export_cached(arguments: argparse.Namespace, source: ResolvedSource | None, name: str) -> int:
    """Serve the key's entry from the cache, or export it there under the key's lock; the model folder on stdout."""
    if source is None:
        from export.checkpoints.checkpoint import default_model_folder  # noqa: PLC0415

        source = ResolvedSource(parse_source(str(default_model_folder())), default_model_folder())
    content = source.commit or folder_digest(source.folder)
    key = CacheKey(name, source.describe(), content, exporter_version(), _options(arguments))
    cache = ExportCache(arguments.export_cache)
    status = 0
    if cache.holds(key):
        _say(f"cache hit: {cache.entry(key)}")
    else:
        with cache.lock(key, _say):
            if cache.holds(key):
                _say(f"cache hit (exported meanwhile by another process): {cache.entry(key)}")
            else:
                _say(f"cache miss: exporting {source.describe()} into {cache.entry(key)}")
                with cache.writing(key) as partial:
                    status = _export(arguments, source, name, partial, in_cache=True)
                    if status != 0:
                        raise _Refused(status)
    print(cache.model_folder(key))
    return status


class _Refused(Exception):
    """The gate refused: the partial entry is removed, the status is the export's."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


def _name(arguments: argparse.Namespace, source: ResolvedSource | None) -> str:
    if arguments.name:
        return arguments.name
    if source is None:
        return "random-encoder" if arguments.random else DEFAULT_MODEL_NAME
    return source.source.default_name


def main(argv: list[str] | None = None) -> int:
    """Run the export; a bad source, a full disk or a refused gate is one line on stderr and a non-zero exit."""
    for name, value in OPENMP_ENVIRONMENT.items():
        os.environ.setdefault(name, value)  # before torch is loaded: libgomp reads it then
    arguments = parse_arguments(argv)
    _configure_logging(arguments)
    try:
        source = resolve(parse_source(arguments.source), _say) if arguments.source else None
        name = _name(arguments, source)
        if arguments.export_cache is not None:
            return _export_cached(arguments, source, name)
        return _export(arguments, source, name, arguments.repository)
    except (SourceSyntaxError, UnusableSource) as error:
        print(f"export: error: {error}", file=sys.stderr)
        return 2
    except _Refused as refused:
        return refused.status
    except OSError as error:
        if error.errno not in NO_ROOM:
            raise
        where = arguments.export_cache or arguments.repository
        print(
            f"export: error: no room left writing the export ({error.strerror}: {error.filename or where})",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
