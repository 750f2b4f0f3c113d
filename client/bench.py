"""Serving benchmark: the same workload three ways, in one process tree, with the ratios that matter.

    python -m client.bench --repository model_repository [--output bench-results/serving.json]

1. in-process: tokenisation + ONNX Runtime in this process, at the best batch size (the ceiling),
   and one request at a time (the latency floor);
2. the server with dynamic batching (its defaults);
3. the server with batching off (--max-batch-size 1);
for short (~12 words) and long (~200 words) texts, closed loop at each concurrency; then an open
loop at 70% of the batched server's best throughput. The load generator runs in this process, on
the same machine: its CPU cost is part of what the server competes with, as it would be for any
co-located client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from client.loadtest import Level, LevelResult, LoadConfig, Workload, check_target, load_corpus, run_level
from client.local_server import start_server
from service.repository import read_model
from service.runtime import ExecutionSettings, ModelRuntime
from service.tokenizer import TextTokenizer

BATCH_SIZES = (1, 4, 8, 16, 32, 64)
KINDS = ("short", "long")
OPEN_LOOP_SHARE = 0.7


@dataclass(frozen=True)
class Ceiling:
    """In-process figures for one kind of text."""

    best_batch: int
    sequences_per_s: float
    by_batch: dict[int, float]
    single_p50_ms: float


def in_process(plan: Plan, kind: str, seconds: float) -> Ceiling:
    """Tokenise + run in this process, with the server's instances and threads.

    Throughput per batch size runs one Python thread per instance, each with its own session
    (ONNX Runtime releases the GIL), as the server does; single-request latency uses one session.
    """
    spec = read_model(plan.repository / plan.model)
    settings = ExecutionSettings(device="cpu", variant=plan.variant, intra_op_threads=plan.threads)
    runtimes = [ModelRuntime(spec, settings) for _ in range(plan.instances)]
    tokenizer = TextTokenizer(spec.tokenizer_file, spec.max_sequence_length, spec.pad_token_id)
    texts = list(load_corpus(kind))

    def run(runtime: ModelRuntime, batch: list[str]) -> None:
        runtime.run(tokenizer.encode(batch).feed(), ("embedding",))

    def sequences_in(runtime: ModelRuntime, batches: list[list[str]], until: float) -> int:
        done = 0
        while time.perf_counter() < until:
            run(runtime, batches[done % len(batches)])
            done += 1
        return done * len(batches[0])

    by_batch = {}
    with ThreadPoolExecutor(plan.instances) as pool:
        for batch_size in BATCH_SIZES:
            cycled = texts * batch_size
            batches = [cycled[start : start + batch_size] for start in range(len(texts))]
            for runtime in runtimes:
                run(runtime, batches[0])
            start = time.perf_counter()
            counts = pool.map(lambda r, b=batches, u=start + seconds: sequences_in(r, b, u), runtimes)
            by_batch[batch_size] = sum(counts) / (time.perf_counter() - start)
    latencies = []
    for index in range(min(200, len(texts) * 4)):
        started = time.perf_counter()
        run(runtimes[0], [texts[index % len(texts)]])
        latencies.append((time.perf_counter() - started) * 1e3)
    best = max(by_batch, key=by_batch.get)
    return Ceiling(best, by_batch[best], by_batch, statistics.median(latencies))


@dataclass(frozen=True)
class Plan:
    """What every way of serving is measured with."""

    repository: Path
    model: str
    variant: str
    instances: int
    threads: int
    duration_s: float
    warmup_s: float


async def _sweep(plan: Plan, target: str, kind: str, levels: list[Level]) -> list[LevelResult]:
    config = LoadConfig(
        target=target, model=plan.model, duration_s=plan.duration_s, warmup_s=plan.warmup_s, mix={kind: 1.0}
    )
    workload = Workload.build(config)
    await check_target(config, workload)
    return [await run_level(config, level, workload) for level in levels]


def served(plan: Plan, flags: list[str], levels_by_kind: dict[str, list[Level]]) -> dict[str, list[LevelResult]]:
    """Start a server with these flags and sweep each kind of text through it."""
    with tempfile.TemporaryDirectory() as scratch:
        server = start_server(
            plan.repository,
            Path(scratch) / "server.log",
            *("--variant", plan.variant, "--instances", str(plan.instances), "--intra-op-threads", str(plan.threads)),
            *flags,
        )
        try:
            return {
                kind: asyncio.run(_sweep(plan, server.target, kind, levels)) for kind, levels in levels_by_kind.items()
            }
        finally:
            server.stop()


def _row(kind: str, way: str, result: LevelResult, ceiling: Ceiling) -> dict[str, object]:
    return {
        "texts": kind,
        "way": way,
        "level": result.label,
        "requests_per_s": result.throughput_rps,
        "p50_ms": result.latency_p50_ms,
        "p99_ms": result.latency_p99_ms,
        "share_of_ceiling": round(result.sequences_per_s / ceiling.sequences_per_s, 3),
        "failed": result.failed,
    }


def _targets(ceilings: dict[str, Ceiling], batched: dict, unbatched: dict, open_loop: dict) -> list[str]:
    lines = []
    for kind, ceiling in ceilings.items():
        at32 = next((r for r in batched[kind] if r.label == "c=32"), None)
        if at32 is not None:
            share = at32.sequences_per_s / ceiling.sequences_per_s
            lines.append(f"{kind}: served at c=32 = {share:.0%} of the in-process ceiling (target >= 85%)")
        off32 = next((r for r in unbatched[kind] if r.label == "c=32"), None)
        if at32 is not None and off32 is not None and off32.throughput_rps:
            lines.append(f"{kind}: batching on/off at c=32 = {at32.throughput_rps / off32.throughput_rps:.2f}x"
                         " (target >= 2x on short texts)")  # fmt: skip
        at1 = next((r for r in batched[kind] if r.label == "c=1"), None)
        if at1 is not None:
            lines.append(f"{kind}: c=1 p50 {at1.latency_p50_ms:.2f} ms vs in-process {ceiling.single_p50_ms:.2f} ms"
                         f" (+{at1.latency_p50_ms - ceiling.single_p50_ms:.2f} ms; target <= +2 ms)")  # fmt: skip
        result = open_loop.get(kind)
        if result is not None and result.latency_p50_ms:
            ratio = result.latency_p99_ms / result.latency_p50_ms
            lines.append(f"{kind}: open loop at {result.label}: p99/p50 = {ratio:.2f} (target <= 5)")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Run the three ways and print the table and the target ratios."""
    parser = argparse.ArgumentParser(prog="python -m client.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--repository", type=Path, default=Path("model_repository"))
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--variant", default="auto", help="auto: the repository's preferred CPU variant")
    parser.add_argument("--instances", type=int, default=1, help="model instances, in-process and served")
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime threads per instance")
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--output", type=Path, help="write every figure as JSON here")
    arguments = parser.parse_args(argv)
    spec = read_model(arguments.repository / arguments.model)
    variant = arguments.variant if arguments.variant != "auto" else spec.preferred_variants.get("cpu", "fp32")
    kinds = arguments.kinds.split(",")
    closed = [Level("closed", int(c)) for c in arguments.concurrency.split(",")]
    plan = Plan(
        repository=arguments.repository,
        model=arguments.model,
        variant=variant,
        instances=arguments.instances,
        threads=arguments.threads,
        duration_s=arguments.duration_s,
        warmup_s=arguments.warmup_s,
    )

    ceilings = {kind: in_process(plan, kind, 3.0) for kind in kinds}
    batched = served(plan, [], dict.fromkeys(kinds, closed))
    unbatched = served(plan, ["--max-batch-size", "1"], dict.fromkeys(kinds, closed))
    rates = {
        kind: [Level("open", round(OPEN_LOOP_SHARE * max(r.throughput_rps for r in batched[kind]), 1))]
        for kind in kinds
    }
    open_loop = {kind: results[0] for kind, results in served(plan, [], rates).items()}

    rows = []
    print(
        f"variant={variant} instances={plan.instances} threads/instance={plan.threads}; "
        f"closed loop {plan.duration_s:g} s per level"
    )
    for kind, ceiling in ceilings.items():
        per_batch = ", ".join(f"{b}: {v:.0f}" for b, v in ceiling.by_batch.items())
        print(
            f"{kind}: in-process seq/s by batch size {{{per_batch}}}; single request p50 {ceiling.single_p50_ms:.2f} ms"
        )
        for way, results in (
            ("batched", batched[kind]),
            ("batching off", unbatched[kind]),
            ("open loop", [open_loop[kind]]),
        ):
            rows += [_row(kind, way, result, ceiling) for result in results]
    print(f"{'texts':<6} {'way':<13} {'level':>8} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'of ceiling':>10} failed")
    for row in rows:
        print(
            f"{row['texts']:<6} {row['way']:<13} {row['level']:>8} {row['requests_per_s']:>8.1f} "
            f"{row['p50_ms']:>8.2f} {row['p99_ms']:>8.2f} {row['share_of_ceiling']:>10.0%} {row['failed']:>6}"
        )
    for line in _targets(ceilings, batched, unbatched, open_loop):
        print(line)
    if arguments.output:
        arguments.output.parent.mkdir(parents=True, exist_ok=True)
        document = {
            "variant": variant,
            "instances": plan.instances,
            "threads": plan.threads,
            "ceilings": {kind: vars(ceiling) for kind, ceiling in ceilings.items()},
            "rows": rows,
        }
        arguments.output.write_text(json.dumps(document, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
