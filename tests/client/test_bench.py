"""The serving benchmark's measuring parts, against a real server (figures are never asserted)."""

from __future__ import annotations

import asyncio

from client.bench import CallCpu, Ceiling, _cpu_per_call, target_lines
from client.loadtest import Level, LevelResult, LoadConfig, Workload, run_level
from tests.conftest import TINY_MODEL
from tests.servers import RunningServer


def test_server_cpu_per_call_is_read_from_the_kernel_for_both_methods(tiny_server: RunningServer) -> None:
    pid = tiny_server.process.pid
    ready = asyncio.run(_cpu_per_call(tiny_server.target, pid, "ModelReady", 320))
    infer = asyncio.run(_cpu_per_call(tiny_server.target, pid, "ModelInfer", 320))
    # /proc counts in clock ticks (10 ms): 320 calls cost at least a few of them.
    assert ready > 0 and infer > 0


def test_the_targets_are_printed_with_their_figures_and_verdicts(tiny_server: RunningServer) -> None:
    config = LoadConfig(target=tiny_server.target, model=TINY_MODEL, duration_s=1.0, warmup_s=0.2, mix={"short": 1.0})
    workload = Workload.build(config)
    results: list[LevelResult] = [asyncio.run(run_level(config, Level("closed", c), workload)) for c in (1, 32)]
    assert all(result.succeeded and not result.failed for result in results)
    cpu = CallCpu(ready_us=300, infer_us=600, ratio=2.0, rounds=[(300, 600)])
    ceiling = Ceiling(sequences_per_s=results[1].sequences_per_s / 0.5, by_batch={}, single_p50_ms=0.1)
    lines = target_lines(cpu, {"fp32": ceiling}, {"fp32": results})
    assert lines[0].endswith("= 2.00x (target <= 1.5x: MISSED)")
    assert "= 0.50x (target >= 0.8x: MISSED)" in lines[1]
    extra = results[0].latency_p50_ms - 0.1
    assert f"+{extra:.2f} ms" in lines[2]
    assert len(lines) == 3
