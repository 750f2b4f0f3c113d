"""Serving benchmark: the request path's three targets, measured in one run on this machine.

    python -m client.bench --repository model_repository [--variants fp32,int8] [--output FILE]

1. Server CPU per call: a tiny random encoder (exported here by the real exporter) behind a
   default server; the server process's CPU time (user + system, as the kernel counts it) per
   single-sentence ModelInfer against per ModelReady, same server, same concurrency, in
   interleaved rounds. Target: ModelInfer <= 1.5x ModelReady.
2. Throughput: for each variant, tokenisation + ONNX Runtime in this process in batches of 32,
   with the server's instance and threads (the ceiling), against the server at 32 concurrent
   single-sentence clients. Target: >= 0.8x the ceiling.
3. Latency: one client at a time, the server's p50 against the model's own batch-1 latency
   (tokenise + run, in this process). Target: <= +1.0 ms.

The load generator runs in this process, on the same machine: its CPU is part of what the
server competes with, as it would be for any co-located client. `--extended` adds batching off
and an open loop at 70% of the best throughput.
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
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from client.loadtest import Level, LevelResult, LoadConfig, Workload, check_target, load_corpus, run_level
from client.local_server import process_cpu_seconds, start_server
from client.protocol import text_request
from export.checkpoint import default_model_folder, random_checkpoint
from export.config import EncoderConfig
from export.pipeline import ExportOptions, export_model
from service.proto import grpc_service_pb2 as pb
from service.proto import grpc_service_pb2_grpc as pb_grpc
from service.repository import read_model
from service.runtime import ExecutionSettings, ModelRuntime
from service.tokenizer import TextTokenizer

BATCH_SIZES = (1, 4, 8, 16, 32, 64)
CEILING_BATCH = 32
OPEN_LOOP_SHARE = 0.7
TINY_MODEL = "tiny-text-encoder"
TINY_CONFIG = EncoderConfig(vocab_size=30522, d_model=32, num_heads=2, num_layers=2, ffn_dim=64, max_positions=128)
CALL_CPU_CONCURRENCY = 16
CALL_CPU_ROUNDS = 5
CALL_CPU_CALLS = 3000
SENTENCE = "A man is playing a guitar on the street."

TARGET_CALL_CPU_RATIO = 1.5
TARGET_SHARE_OF_CEILING = 0.8
TARGET_EXTRA_LATENCY_MS = 1.0


@dataclass(frozen=True)
class Plan:
    """What every way of serving is measured with."""

    repository: Path
    model: str
    instances: int
    threads: int
    duration_s: float
    warmup_s: float


@dataclass(frozen=True)
class Ceiling:
    """In-process figures for one variant and kind of text."""

    sequences_per_s: float
    """At CEILING_BATCH."""
    by_batch: dict[int, float]
    single_p50_ms: float


@dataclass(frozen=True)
class CallCpu:
    """Server CPU microseconds per call, median of interleaved rounds, and each round's figures."""

    ready_us: float
    infer_us: float
    ratio: float
    rounds: list[tuple[float, float]]


def in_process(plan: Plan, variant: str, kind: str, seconds: float) -> Ceiling:
    """Tokenise + run in this process, with the server's instances and threads.

    Throughput per batch size runs one Python thread per instance, each with its own session
    (ONNX Runtime releases the GIL), as the server does; single-request latency uses one session.
    The ceiling's batch size runs as long as a served level (`plan.duration_s`), the others for
    `seconds`: on a shared machine a short window can catch a quiet or a busy moment.
    """
    spec = read_model(plan.repository / plan.model)
    settings = ExecutionSettings(device="cpu", variant=variant, intra_op_threads=plan.threads)
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
            until = start + (plan.duration_s if batch_size == CEILING_BATCH else seconds)
            counts = pool.map(lambda r, b=batches, u=until: sequences_in(r, b, u), runtimes)
            by_batch[batch_size] = sum(counts) / (time.perf_counter() - start)
    latencies = []
    for index in range(min(300, len(texts) * 4)):
        started = time.perf_counter()
        run(runtimes[0], [texts[index % len(texts)]])
        latencies.append((time.perf_counter() - started) * 1e3)
    return Ceiling(by_batch[CEILING_BATCH], by_batch, statistics.median(latencies))


async def _sweep(plan: Plan, target: str, kind: str, levels: list[Level]) -> list[LevelResult]:
    config = LoadConfig(
        target=target, model=plan.model, duration_s=plan.duration_s, warmup_s=plan.warmup_s, mix={kind: 1.0}
    )
    workload = Workload.build(config)
    await check_target(config, workload)
    return [await run_level(config, level, workload) for level in levels]


def served(plan: Plan, variant: str, flags: list[str], levels: list[Level]) -> list[LevelResult]:
    """Start a server with these flags and run each level of single short sentences through it."""
    with tempfile.TemporaryDirectory() as scratch:
        server = start_server(
            plan.repository,
            Path(scratch) / "server.log",
            *("--variant", variant, "--instances", str(plan.instances), "--intra-op-threads", str(plan.threads)),
            *flags,
        )
        try:
            return asyncio.run(_sweep(plan, server.target, "short", levels))
        finally:
            server.stop()


async def _cpu_per_call(target: str, pid: int, call: str, calls: int) -> float:
    """Server CPU microseconds per call of one kind, CALL_CPU_CONCURRENCY callers on one channel."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        if call == "ModelReady":
            message, method = pb.ModelReadyRequest(name=TINY_MODEL), stub.ModelReady
        else:
            message, method = text_request(TINY_MODEL, [SENTENCE]), stub.ModelInfer

        async def caller(count: int) -> None:
            for _ in range(count):
                await method(message)

        await caller(100)  # warm the channel and the server's caches
        before = process_cpu_seconds(pid)
        await asyncio.gather(*(caller(calls // CALL_CPU_CONCURRENCY) for _ in range(CALL_CPU_CONCURRENCY)))
        return (process_cpu_seconds(pid) - before) / (calls // CALL_CPU_CONCURRENCY * CALL_CPU_CONCURRENCY) * 1e6


def call_cpu(scratch: Path) -> CallCpu:
    """Target 1: ModelInfer vs ModelReady server CPU on a tiny random encoder, default server settings."""
    checkpoint = random_checkpoint(TINY_CONFIG, TINY_MODEL, seed=1, tokenizer_folder=default_model_folder())
    repository = scratch / "tiny-repository"
    export_model(checkpoint, repository, ExportOptions(variants=("fp32",), threads=1))
    with start_server(repository, scratch / "tiny-server.log") as server:
        rounds = []
        for _ in range(CALL_CPU_ROUNDS):
            ready = asyncio.run(_cpu_per_call(server.target, server.process.pid, "ModelReady", CALL_CPU_CALLS))
            infer = asyncio.run(_cpu_per_call(server.target, server.process.pid, "ModelInfer", CALL_CPU_CALLS))
            rounds.append((round(ready), round(infer)))
    return CallCpu(
        ready_us=statistics.median(ready for ready, _ in rounds),
        infer_us=statistics.median(infer for _, infer in rounds),
        ratio=round(statistics.median(infer / ready for ready, infer in rounds), 2),
        rounds=rounds,
    )


def _at(results: list[LevelResult], label: str) -> LevelResult | None:
    return next((result for result in results if result.label == label), None)


def _verdict(met: bool) -> str:
    return "met" if met else "MISSED"


def target_lines(cpu: CallCpu, ceilings: dict[str, Ceiling], batched: dict[str, list[LevelResult]]) -> list[str]:
    """The three targets with their figures."""
    lines = [
        f"1. server CPU per call (tiny model, {CALL_CPU_CONCURRENCY} callers): ModelInfer {cpu.infer_us:.0f} us vs "
        f"ModelReady {cpu.ready_us:.0f} us = {cpu.ratio:.2f}x (target <= {TARGET_CALL_CPU_RATIO}x: "
        f"{_verdict(cpu.ratio <= TARGET_CALL_CPU_RATIO)})"
    ]
    for variant, ceiling in ceilings.items():
        at32 = _at(batched[variant], "c=32")
        if at32 is not None:
            share = at32.sequences_per_s / ceiling.sequences_per_s
            lines.append(
                f"2. {variant}: served at c=32 {at32.sequences_per_s:.0f} seq/s vs in-process ceiling "
                f"{ceiling.sequences_per_s:.0f} seq/s (batch {CEILING_BATCH}) = {share:.2f}x "
                f"(target >= {TARGET_SHARE_OF_CEILING}x: {_verdict(share >= TARGET_SHARE_OF_CEILING)})"
            )
    for variant, ceiling in ceilings.items():
        at1 = _at(batched[variant], "c=1")
        if at1 is not None and at1.latency_p50_ms is not None:
            extra = at1.latency_p50_ms - ceiling.single_p50_ms
            lines.append(
                f"3. {variant}: c=1 p50 {at1.latency_p50_ms:.2f} ms vs model batch-1 {ceiling.single_p50_ms:.2f} ms "
                f"= +{extra:.2f} ms (target <= +{TARGET_EXTRA_LATENCY_MS} ms: "
                f"{_verdict(extra <= TARGET_EXTRA_LATENCY_MS)})"
            )
    return lines


def _row(variant: str, way: str, result: LevelResult, ceiling: Ceiling) -> dict[str, object]:
    return {
        "variant": variant,
        "way": way,
        "level": result.label,
        "requests_per_s": result.throughput_rps,
        "p50_ms": result.latency_p50_ms,
        "p99_ms": result.latency_p99_ms,
        "share_of_ceiling": round(result.sequences_per_s / ceiling.sequences_per_s, 3),
        "failed": result.failed,
    }


def main(argv: list[str] | None = None) -> int:
    """Measure the three targets (and, with --extended, batching off and an open loop); print and save them."""
    parser = argparse.ArgumentParser(prog="python -m client.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--repository", type=Path, default=Path("model_repository"))
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--variants", default="fp32,int8", help="CPU variants to serve and compare, in turn")
    parser.add_argument("--instances", type=int, default=1, help="model instances, in-process and served")
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime threads per instance")
    parser.add_argument("--concurrency", default="1,32", help="closed-loop client counts (1 and 32 hold the targets)")
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--extended", action="store_true", help="also batching off, and an open loop")
    parser.add_argument("--output", type=Path, help="write every figure as JSON here")
    arguments = parser.parse_args(argv)
    spec = read_model(arguments.repository / arguments.model)
    variants = [variant for variant in arguments.variants.split(",") if variant in spec.variants]
    closed = [Level("closed", int(c)) for c in arguments.concurrency.split(",")]
    plan = Plan(
        repository=arguments.repository,
        model=arguments.model,
        instances=arguments.instances,
        threads=arguments.threads,
        duration_s=arguments.duration_s,
        warmup_s=arguments.warmup_s,
    )

    with tempfile.TemporaryDirectory() as scratch:
        cpu = call_cpu(Path(scratch))
    ceilings, batched = {}, {}
    for variant in variants:  # each variant's ceiling right before its served levels
        ceilings[variant] = in_process(plan, variant, "short", 3.0)
        batched[variant] = served(plan, variant, [], closed)
    rows = [_row(v, "batched", result, ceilings[v]) for v in variants for result in batched[v]]
    if arguments.extended:
        for variant in variants:
            unbatched = served(plan, variant, ["--max-batch-size", "1"], closed)
            rate = round(OPEN_LOOP_SHARE * max(r.throughput_rps for r in batched[variant]), 1)
            open_loop = served(plan, variant, [], [Level("open", rate)])
            rows += [_row(variant, "batching off", result, ceilings[variant]) for result in unbatched]
            rows += [_row(variant, "open loop", result, ceilings[variant]) for result in open_loop]

    print(f"instances={plan.instances} threads/instance={plan.threads}; closed loop {plan.duration_s:g} s per level")
    print(f"server CPU per call, rounds (ModelReady us, ModelInfer us): {cpu.rounds}")
    for variant, ceiling in ceilings.items():
        per_batch = ", ".join(f"{b}: {v:.0f}" for b, v in ceiling.by_batch.items())
        print(f"{variant}: in-process seq/s by batch size {{{per_batch}}}; batch-1 p50 {ceiling.single_p50_ms:.2f} ms")
    print(
        f"{'variant':<8} {'way':<13} {'level':>10} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'of ceiling':>10} failed"
    )
    for row in rows:
        print(
            f"{row['variant']:<8} {row['way']:<13} {row['level']:>10} {row['requests_per_s']:>8.1f} "
            f"{row['p50_ms'] or 0:>8.2f} {row['p99_ms'] or 0:>8.2f} {row['share_of_ceiling']:>10.0%} {row['failed']:>6}"
        )
    for line in target_lines(cpu, ceilings, batched):
        print(line)
    if arguments.output:
        arguments.output.parent.mkdir(parents=True, exist_ok=True)
        document = {
            "instances": plan.instances,
            "threads": plan.threads,
            "call_cpu": asdict(cpu),
            "ceilings": {variant: asdict(ceiling) for variant, ceiling in ceilings.items()},
            "rows": rows,
            "targets": target_lines(cpu, ceilings, batched),
        }
        arguments.output.write_text(json.dumps(document, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
