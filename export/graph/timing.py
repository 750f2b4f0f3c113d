"""Throughput measurement shared by the exporter's choices, its gate and the bench command.

The machine is shared and noisy, so callers compare candidates measured in one run, and each
figure is the best of a few rounds (the least disturbed one).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort

from service.core.runtime import (
    CPU,
    CUDA,
    ExecutionSettings,
    cuda_provider_options,
    cuda_unavailable_reason,
    session_options,
)

Feed = dict[str, np.ndarray]


def cpu_session(path: str, threads: int, graph_optimization: str = "all") -> ort.InferenceSession:
    """A CPU session configured as the server configures one (service.core.runtime.session_options): fixed threads.

    `graph_optimization`: ONNX Runtime's online graph optimisation (service.core.runtime.GRAPH_OPTIMIZATION's names).
    """
    options = session_options(ExecutionSettings(intra_op_threads=threads), graph_optimization)
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def fp16_session(path: Path, threads: int) -> tuple[ort.InferenceSession, str | None]:
    """An fp16 graph's session on CUDA where it can run here, else on the CPU; with the reason CUDA was not used."""
    settings = ExecutionSettings(intra_op_threads=threads)
    reason = cuda_unavailable_reason(settings.cuda_device_id)
    providers: list = [CPU] if reason else [(CUDA, cuda_provider_options(settings)), CPU]
    return ort.InferenceSession(str(path), session_options(settings), providers=providers), reason


def token_feed(input_names: list[str], batch: int, length: int, vocab_size: int, seed: int = 0) -> Feed:
    """A full (unpadded) batch of random token ids for the named graph inputs."""
    rng = np.random.default_rng(seed)
    feed = {
        "input_ids": rng.integers(1, vocab_size, size=(batch, length), dtype=np.int64),
        "attention_mask": np.ones((batch, length), dtype=np.int64),
        "token_type_ids": np.zeros((batch, length), dtype=np.int64),
        "adapter_ids": np.zeros((batch, length), dtype=np.int64),
    }
    return {name: feed[name] for name in input_names}


def _seconds_per_call(run: Callable[[], object], min_seconds: float) -> float:
    calls = 0
    start = time.perf_counter()
    while True:
        run()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return elapsed / calls


def compare_seconds(
    runs: dict[str, Callable[[], object]], rounds: int = 3, min_seconds: float = 0.3, until_settled: bool = False
) -> dict[str, float]:
    """Seconds per call of each callable, rounds interleaved across them; the best round is kept.

    until_settled: stop before `rounds` once a round leaves the order (fastest to slowest, by the best so far)
    as the round before left it (at least two rounds): enough to choose the fastest.
    """
    for run in runs.values():
        run()  # warm-up: first-call allocations and kernel selection
    best = dict.fromkeys(runs, float("inf"))
    order: list[str] = []
    for _ in range(rounds):
        for name, run in runs.items():
            best[name] = min(best[name], _seconds_per_call(run, min_seconds))
        settled, order = order, sorted(best, key=best.__getitem__)
        if until_settled and settled == order:
            break
    return best


def compare_throughput(
    sessions: dict[str, ort.InferenceSession],
    feed: Feed,
    rounds: int = 3,
    min_seconds: float = 0.3,
    until_settled: bool = False,
) -> dict[str, float]:
    """Sequences/s of each ONNX Runtime session on one feed, measured side by side (compare_seconds)."""
    batch = next(iter(feed.values())).shape[0]
    runs = {name: (lambda s=session: s.run(None, feed)) for name, session in sessions.items()}
    seconds = compare_seconds(runs, rounds, min_seconds, until_settled)
    return {name: batch / per_call for name, per_call in seconds.items()}
