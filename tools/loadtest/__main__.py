"""`python -m tools.loadtest`: sweep load levels against a KServe v2 gRPC server and report latency.

Closed loop: `--concurrency 1,8,32,64` workers each send the next request when the previous one is
answered. Open loop: `--rate 50,100,200` requests/s with Poisson arrivals, latency measured from
each request's scheduled send time. Results: a table on stdout; JSON, CSV and a PNG plot in
--output-dir. Bad arguments or an unusable target: one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from client import DEFAULT_MODEL
from protocol.channel_security import SecurityError, add_security_arguments, security_from_args
from tools.loadtest.config import ConfigError, Level, LoadConfig, parse_levels, parse_mix
from tools.loadtest.report import format_table, write_reports
from tools.loadtest.result import LevelResult
from tools.loadtest.runner import TargetError, check_target, run_level
from tools.loadtest.workload import Workload

logger = logging.getLogger("tools.loadtest")

USAGE_ERROR = 2
INTERRUPTED = 130
DEFAULT_CONCURRENCY = "1,8,32,64"


class _Parser(argparse.ArgumentParser):
    """An argument parser that raises ConfigError instead of printing usage, so errors stay one line."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    parser = _Parser(prog="loadtest", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="HOST:PORT, or dns:///NAME:PORT for round-robin")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model name (default %(default)s)")
    levels = parser.add_mutually_exclusive_group()
    levels.add_argument("--concurrency", help=f"closed-loop worker counts to sweep (default {DEFAULT_CONCURRENCY})")
    levels.add_argument("--rate", help="open-loop request rates to sweep, requests/s (Poisson arrivals)")
    parser.add_argument("--duration-s", type=float, default=30.0, help="measured window per level")
    parser.add_argument("--warmup-s", type=float, default=5.0, help="uncounted load before each window")
    parser.add_argument("--input", choices=("text", "tokens"), default="text", help="BYTES text or INT64 token ids")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer.json for --input tokens")
    parser.add_argument("--max-length", type=int, default=256, help="token truncation for --input tokens")
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per request")
    parser.add_argument("--mix", default="short=1", help="request kinds, e.g. short=0.8,long=0.2")
    parser.add_argument("--timeout-s", type=float, default=10.0, help="deadline per request")
    parser.add_argument("--max-outstanding", type=int, default=1000, help="open-loop cap on requests in flight")
    parser.add_argument("--pool-size", type=int, default=128, help="distinct requests built up front")
    parser.add_argument("--output-dir", type=Path, default=Path("loadtest-results"), help="where results are written")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--seed", type=int, default=0, help="seed of the request mix and arrival times")
    parser.add_argument(
        "--streaming",
        action="store_true",
        help="closed loop over ModelStreamInfer: one stream per worker, the next request after each answer",
    )
    add_security_arguments(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> tuple[LoadConfig, tuple[Level, ...]]:
    """The validated run settings and levels; raises ConfigError."""
    if args.rate is not None and args.streaming:
        raise ConfigError("--streaming is a closed loop: use it with --concurrency, not --rate")
    if args.rate is not None:
        levels = parse_levels(args.rate, "open")
    else:
        levels = parse_levels(args.concurrency or DEFAULT_CONCURRENCY, "closed")
    try:
        security = security_from_args(args)
    except SecurityError as error:
        raise ConfigError(str(error)) from None
    config = LoadConfig(
        target=args.target,
        model=args.model,
        duration_s=args.duration_s,
        warmup_s=args.warmup_s,
        input_kind=args.input,
        tokenizer_path=args.tokenizer,
        max_length=args.max_length,
        batch_size=args.batch_size,
        mix=parse_mix(args.mix),
        timeout_s=args.timeout_s,
        max_outstanding=args.max_outstanding,
        pool_size=args.pool_size,
        seed=args.seed,
        progress=not args.no_progress and sys.stderr.isatty(),
        security=security,
        streaming=args.streaming,
    )
    return config, levels


async def _run(config: LoadConfig, levels: Sequence[Level], workload: Workload, results: list[LevelResult]) -> None:
    await check_target(config, workload)
    for level in levels:
        results.append(await run_level(config, level, workload))


def _fail(error: Exception) -> int:
    print(f"loadtest: error: {error}", file=sys.stderr)
    return USAGE_ERROR


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sweep; returns the exit status (0, 2 on bad use or an unusable target, 130 if interrupted)."""
    try:
        args = build_parser().parse_args(argv)
        config, levels = config_from_args(args)
        workload = Workload.build(config)
    except ConfigError as error:
        return _fail(error)
    logging.basicConfig(format="loadtest: %(message)s", stream=sys.stderr)
    logger.setLevel(logging.INFO)
    results: list[LevelResult] = []
    status = 0
    try:
        asyncio.run(_run(config, levels, workload, results))
    except TargetError as error:
        return _fail(error)
    except KeyboardInterrupt:
        logger.warning("interrupted; reporting the %d completed levels", len(results))
        status = INTERRUPTED
    if results:
        print(format_table(results))
        stem = f"loadtest-{time.strftime('%Y%m%d-%H%M%S')}"
        write_reports(args.output_dir, stem, config, results)
    return status


if __name__ == "__main__":
    sys.exit(main())
