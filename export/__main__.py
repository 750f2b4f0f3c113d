"""Command line: export an encoder into a model repository.

python -m export --repository DIR                   # the default model, all-MiniLM-L6-v2
python -m export --repository DIR --source FOLDER   # any local BERT-family checkpoint
python -m export --repository DIR --random          # a small random encoder (tests)

Progress is one line per stage on stderr; warnings from this project show, library chatter (the
ONNX Runtime optimiser and quantiser logs) only with --verbose.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from export.checkpoint import Checkpoint, CheckpointError, default_model_folder, load_checkpoint, random_checkpoint
from export.config import ConfigError, EncoderConfig
from export.pipeline import VARIANTS, ExportOptions, GateRefused, export_model
from export.publish import ServingDefaults

DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"
RANDOM_CONFIG = {
    "vocab_size": 1000,
    "d_model": 64,
    "num_heads": 4,
    "num_layers": 2,
    "ffn_dim": 128,
    "max_positions": 128,
}


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
    parser.add_argument("--repository", type=Path, required=True, help="model repository to write into")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--source", type=Path, help="a Hugging Face / sentence-transformers folder")
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
        default=ExportOptions.embedding_calibration,
        help="texts (one a line) the embedding's int8/uint8 ranges are measured on (default: the gate sentences)",
    )
    parser.add_argument("--variants", type=_variants, default=VARIANTS, help="comma-separated, fp32 always")
    parser.add_argument("--threads", type=_positive, default=2, help="threads for the measurements")
    parser.add_argument("--int8-min-speedup", type=float, default=1.6, help="int8 speed bar over fp32")
    parser.add_argument("--max-batch-size", type=_positive, default=ServingDefaults.max_batch_size)
    parser.add_argument("--max-queue-delay-us", type=int, default=ServingDefaults.max_queue_delay_us)
    parser.add_argument("--max-queue-size", type=_positive, default=ServingDefaults.max_queue_size)
    parser.add_argument("--seed", type=int, default=0, help="seed for --random")
    parser.add_argument("--verbose", action="store_true", help="show every log line, library chatter included")
    parser.add_argument("--log-level", default="INFO", help="with --verbose: the logging level")
    return parser.parse_args(argv)


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
    """Prints each export stage as it starts, with the time since the export began."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.count = 0

    def __call__(self, name: str) -> None:
        """Announce one stage."""
        self.count += 1
        print(f"export [{time.monotonic() - self.started:5.1f} s] {self.count:2d}. {name}", file=sys.stderr, flush=True)


def _checkpoint(arguments: argparse.Namespace) -> Checkpoint:
    """The source model the arguments name."""
    if arguments.random:
        try:
            config = EncoderConfig(**{**RANDOM_CONFIG, **arguments.random_config})
        except TypeError as error:
            raise ConfigError(f"--random-config: {error}") from error
        return random_checkpoint(
            config, arguments.name or "random-encoder", seed=arguments.seed, tokenizer_folder=arguments.tokenizer
        )
    if arguments.source is not None:
        return load_checkpoint(arguments.source, arguments.name, arguments.matryoshka_dimensions)
    name = arguments.name or DEFAULT_MODEL_NAME
    return load_checkpoint(default_model_folder(), name, arguments.matryoshka_dimensions)


def main(argv: list[str] | None = None) -> int:
    """Run the export; a bad source or a refused gate is one line on stderr and a non-zero exit."""
    arguments = parse_arguments(argv)
    _configure_logging(arguments)
    options = ExportOptions(
        variants=arguments.variants,
        threads=arguments.threads,
        int8_min_speedup=arguments.int8_min_speedup,
        embedding_calibration=arguments.embedding_calibration,
        serving=ServingDefaults(
            max_batch_size=arguments.max_batch_size,
            max_queue_delay_us=arguments.max_queue_delay_us,
            max_queue_size=arguments.max_queue_size,
        ),
    )
    try:
        checkpoint = _checkpoint(arguments)
        report = export_model(checkpoint, arguments.repository, options, StageDisplay())
    except (CheckpointError, ConfigError) as error:
        print(f"export: error: {error}", file=sys.stderr)
        return 2
    except GateRefused as error:
        print(f"export: {error}", file=sys.stderr)
        return 1
    published = ", ".join(report["variants"])
    print(f"published {checkpoint.name} ({published}) to {arguments.repository / checkpoint.name}")
    for device, choice in report["preferred_variants_basis"].items():
        print(f"default on {device}: {choice['variant']} ({choice['basis']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
