"""One process serving a model, driven by h2load: what the server itself costs, without a Python client's share.

    python -m tools.served_bench --repository model_repository [--model all-MiniLM-L6-v2]
        [--variants fp32,int8] [--transports grpcio,envoy] [--rounds 2] [--seconds 8] [--output FILE]

For each round, variant and gRPC transport in turn (alternated: a shared machine's drift touches
each alike), on one sentence:

1. In this process, tokenise + ONNX Runtime with the server's threads: sequences/s in batches of
   32 (the ceiling), and the median latency of a batch of one.
2. A server (one process: the variant, the same threads, the transport): 32 ModelInfer calls in
   flight over 16 HTTP/2 connections for `--seconds` (requests/s, counted by the server; rows per
   model run, from encoder_batch_size); then one call at a time (median latency, from h2load's log).
3. In this process again, sequences/s in batches of the served rows per run: what a server costing
   nothing would reach with the batches it formed (the batching bound).

Reported: served ÷ ceiling (targets ≥ 0.9 fp32, ≥ 0.8 int8), the batching bound ÷ ceiling, and one
call's median over the batch of one's (target ≤ 1 ms). h2load (tools.h2load) costs the server's
machine little, so the figures are the server's; tools.bench measures the same with a Python
client beside the server, as a co-located client would be.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from service.core.repository import read_model
from service.core.runtime import ExecutionSettings, ModelRuntime
from service.pipeline.tokenizer import TextTokenizer
from tools import h2load
from tools.bench import CEILING_BATCH
from tools.local_server import RunningServer, start_server
from tools.protocols_bench import SENTENCE, grpc_request

LATENCY_REQUESTS = 1000
BATCH_ONE_RUNS = 300
TARGET_SHARE = {"fp32": 0.9, "int8": 0.8}
TARGET_OVER_BATCH_ONE_MS = 1.0


@dataclass(frozen=True)
class Round:
    """One variant on one transport, in one round."""

    variant: str
    transport: str
    ceiling_per_s: float
    """Sequences/s in process, batches of CEILING_BATCH."""
    served_per_s: float
    rows_per_run: float
    bound_per_s: float
    """Sequences/s in process, batches of the served rows per run (rounded)."""
    batch_one_ms: float
    single_ms: float
    """One call at a time: the median call."""

    @property
    def share(self) -> float:
        """Served ÷ ceiling."""
        return self.served_per_s / self.ceiling_per_s

    @property
    def bound_share(self) -> float:
        """The batching bound ÷ ceiling."""
        return self.bound_per_s / self.ceiling_per_s


class InProcess:
    """The model in this process, as the server runs it: tokenise + ONNX Runtime, one sentence repeated."""

    def __init__(self, repository: Path, model: str, variant: str, threads: int) -> None:
        spec = read_model(repository / model)
        self._runtime = ModelRuntime(spec, ExecutionSettings(device="cpu", variant=variant, intra_op_threads=threads))
        self._tokenizer = TextTokenizer.of_model(spec)

    def _run(self, rows: int) -> None:
        self._runtime.run(self._tokenizer.encode([SENTENCE] * rows).feed(), ("embedding",))

    def sequences_per_s(self, rows: int, seconds: float) -> float:
        """Batches of `rows` for `seconds` (after one to warm up)."""
        self._run(rows)
        done, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            self._run(rows)
            done += rows
        return done / (time.perf_counter() - started)

    def batch_one_ms(self) -> float:
        """The median latency of a batch of one."""
        latencies = []
        for _ in range(BATCH_ONE_RUNS):
            started = time.perf_counter()
            self._run(1)
            latencies.append((time.perf_counter() - started) * 1e3)
        return statistics.median(latencies)


def _served(server: RunningServer, model: str, body: Path, seconds: float, scratch: Path) -> tuple[float, float, float]:
    """(requests/s at h2load.IN_FLIGHT, rows per model run meanwhile, one call at a time's median ms)."""
    h2load.run(h2load.model_infer(server.target, body, requests=h2load.WARM_UP_REQUESTS))
    answers, batches, started = h2load.Answers(server.answered(model)), server.batch_totals(model), time.monotonic()
    h2load.run(h2load.model_infer(server.target, body, seconds=seconds))
    elapsed = time.monotonic() - started
    requests = answers.ok_since_last(server.answered(model), abandoned=h2load.IN_FLIGHT)
    rows, runs = (after - before for after, before in zip(server.batch_totals(model), batches, strict=True))
    log = scratch / "single.log"
    h2load.run(h2load.model_infer(server.target, body, requests=LATENCY_REQUESTS, connections=1, streams=1, log=log))
    answers.ok_since_last(server.answered(model))  # the timed run's abandoned requests may be counted only now
    return requests / elapsed, rows / runs, statistics.median(h2load.latencies_ms(log))


def measure(repository: Path, model: str, variant: str, transport: str, *, threads: int, seconds: float) -> Round:
    """One round of one variant on one transport."""
    local = InProcess(repository, model, variant, threads)
    ceiling, batch_one = local.sequences_per_s(CEILING_BATCH, seconds), local.batch_one_ms()
    with tempfile.TemporaryDirectory() as folder:
        scratch = Path(folder)
        body = scratch / "request"
        body.write_bytes(h2load.grpc_body(grpc_request(model)))
        flags = ("--variant", variant, "--intra-op-threads", str(threads), "--grpc-transport", transport)
        with start_server(repository, scratch / "server.log", *flags) as server:
            served, rows_per_run, single = _served(server, model, body, seconds, scratch)
    bound = local.sequences_per_s(max(1, round(rows_per_run)), seconds)
    return Round(variant, transport, ceiling, served, rows_per_run, bound, batch_one, single)


def line(result: Round) -> str:
    """One round's figures and verdicts, on one line."""
    share_met = result.share >= TARGET_SHARE.get(result.variant, 0.0)
    over = result.single_ms - result.batch_one_ms
    return (
        f"{result.variant} on {result.transport}: served {result.served_per_s:.0f} req/s ÷ ceiling"
        f" {result.ceiling_per_s:.0f} seq/s = {result.share:.2f} (target >= {TARGET_SHARE.get(result.variant, 0):g}:"
        f" {'met' if share_met else 'MISSED'}); {result.rows_per_run:.1f} rows per run, whose in-process rate"
        f" {result.bound_per_s:.0f} seq/s = {result.bound_share:.2f} of the ceiling; one call {result.single_ms:.2f} ms"
        f" against a batch of one {result.batch_one_ms:.2f} ms (+{over:.2f} ms, target <= {TARGET_OVER_BATCH_ONE_MS:g}:"
        f" {'met' if over <= TARGET_OVER_BATCH_ONE_MS else 'MISSED'})"
    )


def main(argv: list[str] | None = None) -> int:
    """Measure each variant on each transport, round after round; print (and with --output, save) the figures."""
    parser = argparse.ArgumentParser(prog="python -m tools.served_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--repository", type=Path, default=Path("model_repository"))
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--variants", default="fp32,int8")
    parser.add_argument("--transports", default="grpcio,envoy", help="gRPC transports, comma-separated")
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime threads, in process and served")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--output", type=Path)
    arguments = parser.parse_args(argv)
    results = []
    for _ in range(arguments.rounds):
        for variant in arguments.variants.split(","):
            for transport in arguments.transports.split(","):
                where = (arguments.repository, arguments.model, variant, transport)
                results.append(measure(*where, threads=arguments.threads, seconds=arguments.seconds))
                print(line(results[-1]), flush=True)
    if arguments.output:
        arguments.output.parent.mkdir(parents=True, exist_ok=True)
        rows = [{**asdict(result), "share": result.share, "bound_share": result.bound_share} for result in results]
        arguments.output.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
