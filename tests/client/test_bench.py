"""The serving benchmark's measuring parts, against a real server (figures are never asserted)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from client.bench import (
    CallCpu,
    Ceiling,
    Ingestion,
    Plan,
    _cpu_per_call,
    ingestion_ceiling,
    ingestion_config,
    target_lines,
)
from client.loadtest import Level, LevelResult, Workload, run_level
from tests.conftest import TINY_MODEL
from tests.servers import RunningServer


def test_server_cpu_per_call_is_read_from_the_kernel_for_both_methods(tiny_server: RunningServer) -> None:
    pid = tiny_server.process.pid
    ready = asyncio.run(_cpu_per_call(tiny_server.target, pid, "ModelReady", 320))
    infer = asyncio.run(_cpu_per_call(tiny_server.target, pid, "ModelInfer", 320))
    # /proc counts in clock ticks (10 ms): 320 calls cost at least a few of them.
    assert ready > 0 and infer > 0


def test_ingestion_sends_chunks_of_every_length_and_the_ceiling_runs_exactly_their_texts(
    tiny_server: RunningServer, tiny_repository: Path
) -> None:
    plan = Plan(tiny_repository, TINY_MODEL, instances=1, threads=1, duration_s=1.0, warmup_s=0.2)
    config = ingestion_config(plan, tiny_server.target)
    workload = Workload.build(config)
    words = sorted(len(text.split()) for request in workload.requests for text in request.texts)
    assert all(request.sequences == 32 for request in workload.requests)
    assert words[0] < 40 and words[-1] > 200  # spread as document chunks are
    result = asyncio.run(run_level(config, Level("closed", 4), workload))
    assert result.succeeded and not result.failed
    assert result.sequences_per_s == result.throughput_rps * 32
    texts = [text for request in workload.requests for text in request.texts]
    assert ingestion_ceiling(plan, texts) > 0


def _level(label: str, rps: float, p50_ms: float, sequences: int = 1) -> LevelResult:
    counts = ("closed", 1, label, 1.0, 10, 10, 0, {}, 0, 10 * sequences, 10)
    return LevelResult(*counts, rps, rps * sequences, p50_ms, *[p50_ms] * 4)


def test_each_target_is_judged_against_its_own_bar() -> None:
    ceiling = Ceiling(sequences_per_s=1000, by_batch={}, single_p50_ms=4.0)
    served = {"fp32": [_level("c=1", 150, 5.5), _level("c=8", 400, 19.0), _level("c=32", 801, 40.0)]}
    met = target_lines(CallCpu(100, 199, 1.99, [(100, 199)]), {"fp32": ceiling}, served, Ingestion(86, 100, 900, 0))
    assert met[0].endswith("(target <= 2.0x: met; goal 1.5x not yet)")
    assert met[1].endswith("= 0.80x (target >= 0.8x: met)")
    assert met[2].endswith("= 0.86x (target >= 0.85x: met)")
    assert met[3] == "4. fp32: c=1 p50 5.50 ms vs model batch-1 4.00 ms (+1.50 ms)"
    assert met[4] == "4. fp32: c=8 400 req/s, p50 19.00 ms"
    served["fp32"][2] = _level("c=32", 799, 40.0)
    missed = target_lines(CallCpu(100, 201, 2.01, [(100, 201)]), {"fp32": ceiling}, served, Ingestion(84, 100, 900, 0))
    assert "MISSED" in missed[0] and "MISSED" in missed[1] and "MISSED" in missed[2]
    best = target_lines(CallCpu(100, 150, 1.5, [(100, 150)]), {"fp32": ceiling}, served, None)
    assert best[0].endswith("met; goal met)") and not any(line.startswith("3.") for line in best)
