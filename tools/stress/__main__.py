"""`python -m tools.stress`: hostile load against a running server, phase by phase, with a verdict.

Phases: baseline, burst_one_channel, burst_many_channels, huge_texts, deadline_storm, cancellation,
slow_readers, oversized_answers, slow_readers_big_answers, stream_recycle, malformed, burst_after
(the queue bound must still hold), then one normal request that must succeed. Per phase: outcomes
by gRPC status (HTTP ones as `HTTP 413`), requests accepted but never answered (must be 0), p50/p99
of a small probe request and p50/p99/max of a health check sent alongside (to --health-target, the
server's plaintext health port, when given), the server's RSS (from /proc, when the server runs on
this machine), and with --metrics-url its largest event-loop lag and its refusals by reason. After
each phase the suite waits until the server reports nothing in flight or queued (--metrics-url) and
its CPU is idle. The answer phases' HTTP halves need --http-target.
Results: a table on stdout, JSON and a PNG in --output. Exit status 0 when every phase passed, 1
when one did not, 2 on bad use or an unusable target, 130 if interrupted. UNKNOWN, INTERNAL and
unanswered requests always fail.
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
from tools.stress.config import QUICK_SCALE, StressConfig, StressConfigError
from tools.stress.phases import PHASE_NAMES
from tools.stress.report import format_table, write_reports
from tools.stress.suite import TargetError, run_suite

logger = logging.getLogger("tools.stress")

FAILED = 1
USAGE_ERROR = 2
INTERRUPTED = 130


class _Parser(argparse.ArgumentParser):
    """Raises StressConfigError instead of printing usage, so errors stay one line."""

    def error(self, message: str) -> NoReturn:
        raise StressConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    parser = _Parser(prog="stress", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="HOST:PORT of the server's gRPC port")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model name (default %(default)s)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--scale", type=float, default=1.0, help="multiplies every count and hold time (default 1)")
    size.add_argument("--quick", action="store_true", help=f"a short run: --scale {QUICK_SCALE}")
    parser.add_argument(
        "--phases", help=f"comma-separated subset of {','.join(PHASE_NAMES)} (the final request always runs)"
    )
    parser.add_argument(
        "--safety-timeout-s", type=float, default=60.0, help="no response by then = accepted but never answered"
    )
    parser.add_argument("--server-pid", type=int, help="the server's process id, for its RSS (found from the port)")
    parser.add_argument(
        "--metrics-url", help="the server's /metrics URL: in-flight and queued must return to 0; loop lag, refusals"
    )
    parser.add_argument(
        "--http-target", help="HOST:PORT of the server's HTTP port (KServe v2 REST), for the answer phases' HTTP halves"
    )
    parser.add_argument(
        "--health-target",
        help="HOST:PORT of the server's plaintext health port (--health-port), where probes go; default: --target",
    )
    parser.add_argument(
        "--stream-seconds",
        type=float,
        help="how long stream_recycle keeps sending (default 20 s x scale); above the server's --max-connection-age-s"
        " to see its streams recycled",
    )
    parser.add_argument(
        "--settle-timeout-s", type=float, default=15.0, help="longest wait after a phase for the server to settle"
    )
    parser.add_argument("--output", type=Path, default=Path("stress-results"), help="where JSON and PNG are written")
    parser.add_argument("--seed", type=int, default=0, help="seed of every random choice")
    add_security_arguments(parser)
    return parser


def _phases(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = sorted(set(names) - set(PHASE_NAMES))
    if unknown or not names:
        raise StressConfigError(f"unknown phase {unknown[0] if unknown else text!r}; known: {', '.join(PHASE_NAMES)}")
    return names


def config_from_args(args: argparse.Namespace) -> StressConfig:
    """The validated settings; raises StressConfigError."""
    try:
        security = security_from_args(args)
    except SecurityError as error:
        raise StressConfigError(str(error)) from None
    return StressConfig(
        target=args.target,
        model=args.model,
        security=security,
        scale=QUICK_SCALE if args.quick else args.scale,
        safety_timeout_s=args.safety_timeout_s,
        server_pid=args.server_pid,
        metrics_url=args.metrics_url,
        http_target=args.http_target,
        health_target=args.health_target,
        settle_timeout_s=args.settle_timeout_s,
        stream_seconds=args.stream_seconds,
        phases=_phases(args.phases),
        seed=args.seed,
    )


def _fail(error: Exception) -> int:
    print(f"stress: error: {error}", file=sys.stderr)
    return USAGE_ERROR


def main(argv: Sequence[str] | None = None) -> int:
    """Run the suite; returns the exit status."""
    try:
        args = build_parser().parse_args(argv)
        config = config_from_args(args)
    except StressConfigError as error:
        return _fail(error)
    logging.basicConfig(format="stress: %(message)s", stream=sys.stderr)
    logger.setLevel(logging.INFO)
    try:
        result = asyncio.run(run_suite(config))
    except TargetError as error:
        return _fail(error)
    except KeyboardInterrupt:
        logger.warning("interrupted")
        return INTERRUPTED
    print(format_table(result))
    write_reports(args.output, f"stress-{time.strftime('%Y%m%d-%H%M%S')}", result)
    return 0 if result.passed else FAILED


if __name__ == "__main__":
    sys.exit(main())
