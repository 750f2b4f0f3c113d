"""Serving benchmark: the request path's targets, measured in one run on this machine.

    python -m tools.bench --repository model_repository [--variants fp32,int8] [--output FILE]

1. Server CPU per call: a tiny random encoder (exported here by the real exporter) behind a
   default server; the server process's CPU time (user + system, as the kernel counts it) per
   single-sentence ModelInfer against per ModelReady, same server, same concurrency, in
   interleaved rounds. Target: ModelInfer <= 2.0x ModelReady (goal 1.5x).
2. Throughput: for each variant, tokenisation + ONNX Runtime in this process in batches of 32,
   with the server's instance and threads (the ceiling), against the server at 32 concurrent
   single-sentence clients. Target: >= 0.8x the ceiling.
3. Mixed-length ingestion (fp32): the same work both ways, timed from start to end. Served: 16
   requests of 32 document chunks (8-240 words), sent twice over by 4 clients (each takes the next
   request). In this process: the same texts sorted by length and run 32 at a time, each batch
   padded to its own longest. Target: >= 0.85x.
4. Reported, not a target: one client's p50 against the model's own batch-1 latency (tokenise +
   run, in this process), and the throughput at 8 clients.

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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from client.protocol import text_request
from export.build import ExportOptions, export_model
from export.checkpoints.checkpoint import default_model_folder, random_checkpoint
from export.families.bert import EncoderConfig
from protocol import grpc_service_pb2 as pb
from protocol import grpc_service_pb2_grpc as pb_grpc
from service.core.repository import read_model
from service.core.runtime import ExecutionSettings, ModelRuntime
from service.pipeline.tokenizer import TextTokenizer
from tools.loadtest import Level, LevelResult, LoadConfig, Workload, check_target, load_corpus, run_level
from tools.local_server import rows_per_run, server_cpu_seconds, start_server

BATCH_SIZES = (1, 4, 8, 16, 32, 64)
CEILING_BATCH = 32
OPEN_LOOP_SHARE = 0.7
TINY_MODEL = "tiny-text-encoder"
TINY_CONFIG = EncoderConfig(vocab_size=30522, d_model=32, num_heads=2, num_layers=2, ffn_dim=64, max_positions=128)
CALL_CPU_CONCURRENCY = 16
CALL_CPU_ROUNDS = 5
CALL_CPU_CALLS = 3000
SENTENCE = "A man is playing a guitar on the street."

INGESTION_MODEL_VARIANT = "fp32"
INGESTION_CLIENTS = 4
INGESTION_BATCH = 32
INGESTION_REQUESTS = 16
"""Distinct requests of the ingestion workload; the ceiling runs exactly their texts."""
INGESTION_ROUNDS = 2
"""Times each ingestion request is sent (and its texts run in process): work of ~1,000 texts, timed whole.
At ~20 texts/s a window of seconds holds a handful of 32-text requests: counting those completed in
it quantised the share in steps of ~0.15, so the same work is timed from first send to last answer."""
INGESTION_TIMEOUT_S = 300.0

TARGET_CALL_CPU_RATIO = 2.0
GOAL_CALL_CPU_RATIO = 1.5
TARGET_SHARE_OF_CEILING = 0.8
TARGET_INGESTION_SHARE = 0.85


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
    rows_per_run: float | None = None
    """Rows per model run while ModelInfer was measured, median of the rounds (None if no batch ran)."""


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
    tokenizer = TextTokenizer.of_model(spec)
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


def ingestion_config(plan: Plan, target: str) -> LoadConfig:
    """The ingestion level's load: INGESTION_REQUESTS distinct requests of INGESTION_BATCH chunks each."""
    return LoadConfig(
        target=target,
        model=plan.model,
        duration_s=plan.duration_s,
        warmup_s=plan.warmup_s,
        mix={"chunks": 1.0},
        batch_size=INGESTION_BATCH,
        pool_size=INGESTION_REQUESTS,
    )


def ingestion_ceiling(plan: Plan, texts: list[str]) -> float:
    """Texts/s of tokenise + run in this process: the texts sorted by token length, INGESTION_BATCH at a time.

    Each batch is padded to its own longest (the best a server can do with these texts); one
    Python thread per instance takes the next batch, as the server's instances do.
    """
    spec = read_model(plan.repository / plan.model)
    settings = ExecutionSettings(device="cpu", variant=INGESTION_MODEL_VARIANT, intra_op_threads=plan.threads)
    runtimes = [ModelRuntime(spec, settings) for _ in range(plan.instances)]
    tokenizer = TextTokenizer.of_model(spec)
    by_length = sorted(texts, key=lambda text: int(tokenizer.encode([text]).attention_mask.sum()))
    batches = [by_length[start : start + INGESTION_BATCH] for start in range(0, len(by_length), INGESTION_BATCH)]
    runtimes[0].run(tokenizer.encode(batches[-1]).feed(), ("embedding",))  # warm at the longest shape
    remaining = iter(batches)

    def work(runtime: ModelRuntime) -> None:
        for batch in remaining:  # one shared iterator: each thread takes the next batch
            runtime.run(tokenizer.encode(batch).feed(), ("embedding",))

    started = time.perf_counter()
    with ThreadPoolExecutor(plan.instances) as pool:
        list(pool.map(work, runtimes))
    return len(texts) / (time.perf_counter() - started)


async def _ingest(target: str, requests: list[pb.ModelInferRequest], clients: int) -> tuple[float, int, list[float]]:
    """Send every request once, `clients` at a time, each caller taking the next one.

    Returns the seconds from the first send to the last answer, the texts answered, and each
    answered request's latency in ms.
    """
    latencies_ms: list[float] = []
    answered_texts = 0
    remaining = iter(requests)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)

        async def caller() -> None:
            nonlocal answered_texts
            for request in remaining:
                sent = time.perf_counter()
                try:
                    await stub.ModelInfer(request, timeout=INGESTION_TIMEOUT_S)
                except grpc.aio.AioRpcError:
                    continue
                latencies_ms.append((time.perf_counter() - sent) * 1e3)
                answered_texts += request.inputs[0].shape[0]

        started = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(clients)))
        return time.perf_counter() - started, answered_texts, latencies_ms


async def _sweep(config: LoadConfig, levels: list[Level]) -> list[LevelResult]:
    workload = Workload.build(config)
    await check_target(config, workload)
    return [await run_level(config, level, workload) for level in levels]


def _sentences(plan: Plan, target: str) -> LoadConfig:
    return LoadConfig(
        target=target, model=plan.model, duration_s=plan.duration_s, warmup_s=plan.warmup_s, mix={"short": 1.0}
    )


def served(
    plan: Plan,
    variant: str,
    flags: list[str],
    levels: list[Level],
    load: Callable[[Plan, str], LoadConfig] = _sentences,
) -> list[LevelResult]:
    """Start a server with these flags and run each level of `load` (single short sentences) through it."""
    with tempfile.TemporaryDirectory() as scratch:
        server = start_server(
            plan.repository,
            Path(scratch) / "server.log",
            *("--variant", variant, "--instances", str(plan.instances), "--intra-op-threads", str(plan.threads)),
            *flags,
        )
        try:
            return asyncio.run(_sweep(load(plan, server.target), levels))
        finally:
            server.stop()


@dataclass(frozen=True)
class Ingestion:
    """Mixed-length ingestion: served texts/s against the in-process length-sorted ceiling."""

    served_texts_per_s: float
    ceiling_texts_per_s: float
    p50_ms: float | None
    failed: int

    @property
    def share(self) -> float:
        """Served / ceiling."""
        return self.served_texts_per_s / self.ceiling_texts_per_s


def ingestion(plan: Plan) -> Ingestion:
    """Target 3: the ceiling on the workload's texts, then the same requests served, each INGESTION_ROUNDS times."""
    workload = Workload.build(ingestion_config(plan, "127.0.0.1:1"))
    batches = [list(request.texts) for request in workload.requests] * INGESTION_ROUNDS
    texts = [text for batch in batches for text in batch]
    ceiling = ingestion_ceiling(plan, texts)
    requests = [text_request(plan.model, batch) for batch in batches]
    with tempfile.TemporaryDirectory() as scratch:
        server = start_server(
            plan.repository,
            Path(scratch) / "server.log",
            *("--variant", INGESTION_MODEL_VARIANT, "--instances", str(plan.instances)),
            *("--intra-op-threads", str(plan.threads)),
        )
        try:
            seconds, answered_texts, latencies_ms = asyncio.run(_ingest(server.target, requests, INGESTION_CLIENTS))
        finally:
            server.stop()
    p50 = statistics.median(latencies_ms) if latencies_ms else None
    return Ingestion(round(answered_texts / seconds, 1), round(ceiling, 1), p50, len(requests) - len(latencies_ms))


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
        before = server_cpu_seconds(pid)
        await asyncio.gather(*(caller(calls // CALL_CPU_CONCURRENCY) for _ in range(CALL_CPU_CONCURRENCY)))
        return (server_cpu_seconds(pid) - before) / (calls // CALL_CPU_CONCURRENCY * CALL_CPU_CONCURRENCY) * 1e6


def call_cpu(scratch: Path) -> CallCpu:
    """Target 1: ModelInfer vs ModelReady server CPU on a tiny random encoder, default server settings."""
    checkpoint = random_checkpoint(TINY_CONFIG, TINY_MODEL, seed=1, tokenizer_folder=default_model_folder())
    repository = scratch / "tiny-repository"
    export_model(checkpoint, repository, ExportOptions(variants=("fp32",), threads=1))
    with start_server(repository, scratch / "tiny-server.log") as server:
        rounds, batching = [], []
        for _ in range(CALL_CPU_ROUNDS):
            ready = asyncio.run(_cpu_per_call(server.target, server.process.pid, "ModelReady", CALL_CPU_CALLS))
            before = server.batch_totals(TINY_MODEL)
            infer = asyncio.run(_cpu_per_call(server.target, server.process.pid, "ModelInfer", CALL_CPU_CALLS))
            rounds.append((round(ready), round(infer)))
            batching.append(rows_per_run(before, server.batch_totals(TINY_MODEL)))
    measured = [rows for rows in batching if rows is not None]
    return CallCpu(
        ready_us=statistics.median(ready for ready, _ in rounds),
        infer_us=statistics.median(infer for _, infer in rounds),
        ratio=round(statistics.median(infer / ready for ready, infer in rounds), 2),
        rounds=rounds,
        rows_per_run=round(statistics.median(measured), 2) if measured else None,
    )


def _at(results: list[LevelResult], label: str) -> LevelResult | None:
    return next((result for result in results if result.label == label), None)


def _verdict(met: bool) -> str:
    return "met" if met else "MISSED"


def target_lines(
    cpu: CallCpu, ceilings: dict[str, Ceiling], batched: dict[str, list[LevelResult]], mixed: Ingestion | None
) -> list[str]:
    """The targets with their figures, then the reported latency and c=8 throughput."""
    goal = "goal met" if cpu.ratio <= GOAL_CALL_CPU_RATIO else f"goal {GOAL_CALL_CPU_RATIO}x not yet"
    batching = "" if cpu.rows_per_run is None else f" ({cpu.rows_per_run:.1f} rows per model run)"
    lines = [
        f"1. server CPU per call (tiny model, {CALL_CPU_CONCURRENCY} callers): ModelInfer {cpu.infer_us:.0f} us"
        f"{batching} vs "
        f"ModelReady {cpu.ready_us:.0f} us = {cpu.ratio:.2f}x (target <= {TARGET_CALL_CPU_RATIO}x: "
        f"{_verdict(cpu.ratio <= TARGET_CALL_CPU_RATIO)}; {goal})"
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
    if mixed is not None:
        lines.append(
            f"3. {INGESTION_MODEL_VARIANT} mixed-length ingestion ({INGESTION_CLIENTS} clients x {INGESTION_BATCH} "
            f"chunks): served {mixed.served_texts_per_s:.1f} texts/s vs in-process length-sorted "
            f"{mixed.ceiling_texts_per_s:.1f} texts/s = {mixed.share:.2f}x (target >= {TARGET_INGESTION_SHARE}x: "
            f"{_verdict(mixed.share >= TARGET_INGESTION_SHARE)})"
        )
    for variant, ceiling in ceilings.items():
        at1, at8 = _at(batched[variant], "c=1"), _at(batched[variant], "c=8")
        if at1 is not None and at1.latency_p50_ms is not None:
            extra = at1.latency_p50_ms - ceiling.single_p50_ms
            lines.append(
                f"4. {variant}: c=1 p50 {at1.latency_p50_ms:.2f} ms vs model batch-1 {ceiling.single_p50_ms:.2f} ms "
                f"(+{extra:.2f} ms)"
            )
        if at8 is not None:
            lines.append(f"4. {variant}: c=8 {at8.throughput_rps:.0f} req/s, p50 {at8.latency_p50_ms or 0:.2f} ms")
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
    """Measure the targets (and, with --extended, batching off and an open loop); print and save them."""
    parser = argparse.ArgumentParser(prog="python -m tools.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--repository", type=Path, default=Path("model_repository"))
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--variants", default="fp32,int8", help="CPU variants to serve and compare, in turn")
    parser.add_argument("--instances", type=int, default=1, help="model instances, in-process and served")
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime threads per instance")
    parser.add_argument("--concurrency", default="1,8,32", help="closed-loop client counts (1, 8 and 32 are reported)")
    parser.add_argument("--skip-ingestion", action="store_true", help="leave out the mixed-length ingestion target")
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
    mixed = None if arguments.skip_ingestion or INGESTION_MODEL_VARIANT not in spec.variants else ingestion(plan)
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
    targets = target_lines(cpu, ceilings, batched, mixed)
    for line in targets:
        print(line)
    if arguments.output:
        arguments.output.parent.mkdir(parents=True, exist_ok=True)
        document = {
            "instances": plan.instances,
            "threads": plan.threads,
            "call_cpu": asdict(cpu),
            "ceilings": {variant: asdict(ceiling) for variant, ceiling in ceilings.items()},
            "rows": rows,
            "ingestion": None if mixed is None else {**asdict(mixed), "share": round(mixed.share, 3)},
            "targets": targets,
        }
        arguments.output.write_text(json.dumps(document, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
