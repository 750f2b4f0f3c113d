"""Triton's per-model inference statistics (the ModelStatistics RPC, GET .../stats), kept as plain counters.

Each process of the server keeps one `StatisticsTable` per served model version (`TABLES.of`):
every protocol's requests are recorded where the engine counts each request
(service.ops.metrics.TrackedRequest), batches where the batcher finishes them (`record_execution`). A
table is a row of int64 slots, written only by its process's event loop, in memory or (with several
processes) in a file; `TABLES.snapshot` adds up every process's table into one `ModelStatistics`.
The tables also hold two live values, the requests in flight and those waiting in the queue, which
the metrics read when scraped.

What each duration holds, per successful request (Triton's meaning, mapped onto this server):
- queue: its time in the batcher not spent running its rows (waiting for a batch; between the
  batches its rows were spread over);
- compute_infer: the run time of the batches its rows rode in (padding and the ONNX Runtime session);
- compute_output: handing its result back after its last row returned;
- compute_input: the rest of its time, from when the front end received it: decoding the wire
  format, validating, admission, tokenising its texts, handing its rows back after each run.
So success = compute_input + queue + compute_infer + compute_output for every request; as in
Triton, the protocol's encoding of the answer comes after and is not counted. Per executed batch
size (rows), `batch_stats` counts executions and their compute_infer time.
"""

from __future__ import annotations

import glob
import mmap
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

_NS_PER_S = 1_000_000_000


@dataclass
class Duration:
    """A count and the total nanoseconds of the things counted (Triton's StatisticDuration)."""

    count: int = 0
    ns: int = 0

    def add(self, seconds: float) -> None:
        """Count one more, lasting `seconds`."""
        self.count += 1
        self.ns += int(seconds * _NS_PER_S)


@dataclass
class ModelStatistics:
    """Cumulative statistics of one model version since the server started (a snapshot, summed over processes)."""

    inference_count: int = 0
    """Rows (sequences) of successful requests."""
    execution_count: int = 0
    """Batches run."""
    last_inference_ms: int = 0
    """Wall-clock milliseconds since the epoch of the last successful request; 0 before the first."""
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    batch_infer: dict[int, Duration] = field(default_factory=dict)
    """Executed batch size (rows) -> executions of that size and their run time."""
    inflight: int = 0
    """Inference requests received and not yet answered, now."""
    pending: int = 0
    """Requests with rows waiting in the batching queue, now."""


# Slots of a table: counters, then (count, ns) pairs, then two live values, then (count, ns) per batch size.
_INFERENCE_COUNT, _EXECUTION_COUNT, _LAST_INFERENCE_MS = 0, 1, 2
_DURATIONS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")
_SUCCESS, _FAIL, _QUEUE, _COMPUTE_INPUT, _COMPUTE_INFER, _COMPUTE_OUTPUT = range(3, 15, 2)
_INFLIGHT, _PENDING = 15, 16
_BATCHES = 17
_SLOT = 8
TABLE_SUFFIX = ".stats"


def _table_slots(max_batch_size: int) -> int:
    return _BATCHES + 2 * (max_batch_size + 1)


class StatisticsTable:
    """One process's share of a model version's statistics: int64 slots, in memory or in a file others read.

    Only its own process writes a table, only on its event loop thread; readers (a statistics
    request, a scrape, other processes) sum every process's table for the model. A slot is one
    aligned 8-byte word, so a reader sees each value whole.
    """

    __slots__ = ("_memory", "_slots", "max_batch_size")

    def __init__(self, max_batch_size: int, path: Path | None = None) -> None:
        self.max_batch_size = max_batch_size
        size = _table_slots(max_batch_size) * _SLOT
        if path is None:
            self._memory: bytearray | mmap.mmap = bytearray(size)
        else:
            with path.open("w+b") as file:
                file.truncate(size)
                self._memory = mmap.mmap(file.fileno(), size)
        self._slots = memoryview(self._memory).cast("q")

    def record_success(self, rows: int, total_s: float, queue_s: float, compute_s: float, output_s: float) -> None:
        """A request answered with `rows` rows after `total_s` in the server, of which the parts given."""
        slots = self._slots
        slots[_INFERENCE_COUNT] += rows
        slots[_LAST_INFERENCE_MS] = time.time_ns() // 1_000_000
        input_s = max(0.0, total_s - queue_s - compute_s - output_s)
        slots[_SUCCESS] += 1
        slots[_SUCCESS + 1] += int(total_s * _NS_PER_S)
        slots[_QUEUE] += 1
        slots[_QUEUE + 1] += int(queue_s * _NS_PER_S)
        slots[_COMPUTE_INFER] += 1
        slots[_COMPUTE_INFER + 1] += int(compute_s * _NS_PER_S)
        slots[_COMPUTE_OUTPUT] += 1
        slots[_COMPUTE_OUTPUT + 1] += int(output_s * _NS_PER_S)
        slots[_COMPUTE_INPUT] += 1
        slots[_COMPUTE_INPUT + 1] += int(input_s * _NS_PER_S)

    def record_failure(self, total_s: float) -> None:
        """A request for this model that failed (any error after the model was found) after `total_s`."""
        self._slots[_FAIL] += 1
        self._slots[_FAIL + 1] += int(total_s * _NS_PER_S)

    def record_execution(self, rows: int, compute_s: float) -> None:
        """A batch of `rows` rows that ran for `compute_s`."""
        slots = self._slots
        slots[_EXECUTION_COUNT] += 1
        slot = _BATCHES + 2 * rows
        slots[slot] += 1
        slots[slot + 1] += int(compute_s * _NS_PER_S)

    def add_inflight(self, change: int) -> None:
        """Requests received and not yet answered: +1 when one comes in, -1 when it is answered."""
        self._slots[_INFLIGHT] += change

    def add_pending(self, change: int) -> None:
        """Requests with rows waiting in the model's batching queues: each queue adds what it gained or lost."""
        self._slots[_PENDING] += change

    def values(self) -> list[int]:
        """Every slot, as read now."""
        return self._slots.tolist()


def _summed(tables: Iterable[list[int]]) -> ModelStatistics:
    """The snapshot of a model from its tables' slots: counts added, the last inference the latest."""
    total: list[int] = []
    for slots in tables:
        if len(slots) > len(total):
            total += [0] * (len(slots) - len(total))
        for index, value in enumerate(slots):
            total[index] = max(total[index], value) if index == _LAST_INFERENCE_MS else total[index] + value
    if not total:
        return ModelStatistics()
    durations = {
        name: Duration(total[start], total[start + 1]) for name, start in zip(_DURATIONS, range(3, 15, 2), strict=True)
    }
    batches = {
        rows: Duration(total[_BATCHES + 2 * rows], total[_BATCHES + 2 * rows + 1])
        for rows in range(1, (len(total) - _BATCHES) // 2)
        if total[_BATCHES + 2 * rows]
    }
    return ModelStatistics(
        inference_count=total[_INFERENCE_COUNT],
        execution_count=total[_EXECUTION_COUNT],
        last_inference_ms=total[_LAST_INFERENCE_MS],
        batch_infer=batches,
        inflight=total[_INFLIGHT],
        pending=total[_PENDING],
        **durations,
    )


class StatisticsTables:
    """The statistics tables of a process, by model version; and the snapshots summed over every process.

    In one process the tables live in memory. When the server runs in several processes, each
    writes its tables as files in one shared folder (`share_in`), and a snapshot adds up the files.
    """

    def __init__(self) -> None:
        self._tables: dict[tuple[str, str], StatisticsTable] = {}
        self._folder: Path | None = None

    def share_in(self, folder: Path) -> None:
        """Write this process's tables into `folder` from now on (call before any table is made)."""
        self._folder = folder

    def of(self, model: str, version: str, max_batch_size: int) -> StatisticsTable:
        """The process's own table of a model version, made empty on first use."""
        table = self._tables.get((model, version))
        if table is None:
            path = None
            if self._folder is not None:
                path = self._folder / f"{model}@{version}@{os.getpid()}{TABLE_SUFFIX}"
            table = self._tables[(model, version)] = StatisticsTable(max_batch_size, path)
        return table

    def snapshot(self, model: str, version: str) -> ModelStatistics:
        """A model version's statistics now, summed over every process of the server."""
        if self._folder is None:
            table = self._tables.get((model, version))
            return _summed([] if table is None else [table.values()])
        return _summed(_read(path) for path in self._folder.glob(f"{glob.escape(model)}@{glob.escape(version)}@*"))

    def models(self) -> list[tuple[str, str]]:
        """Every model version any process of the server keeps statistics of."""
        if self._folder is None:
            return sorted(self._tables)
        names = {tuple(path.name.removesuffix(TABLE_SUFFIX).split("@")[:2]) for path in self._folder.iterdir()}
        return sorted(names)


def table_snapshot(path: Path) -> ModelStatistics:
    """One process's share of a model version's statistics, read from its table's file."""
    return _summed([_read(path)])


def _read(path: Path) -> list[int]:
    data = path.read_bytes()
    return memoryview(data[: len(data) // _SLOT * _SLOT]).cast("q").tolist()


TABLES = StatisticsTables()
"""The process's statistics tables (one set per process, like the metrics registry)."""


_NS_PER_US = 1000

TRITON_COUNTERS: tuple[tuple[str, str, Callable[[ModelStatistics], int]], ...] = (
    ("nv_inference_request_success", "Successful inference requests, every protocol's.", lambda s: s.success.count),
    ("nv_inference_request_failure", "Failed inference requests (their model was found).", lambda s: s.fail.count),
    ("nv_inference_count", "Inferences performed: the rows of successful requests.", lambda s: s.inference_count),
    ("nv_inference_exec_count", "Model executions (batches run).", lambda s: s.execution_count),
    (
        "nv_inference_request_duration_us",
        "Cumulative time of successful requests in the server, microseconds.",
        lambda s: s.success.ns // _NS_PER_US,
    ),
    (
        "nv_inference_queue_duration_us",
        "Cumulative time successful requests waited in the queue, microseconds.",
        lambda s: s.queue.ns // _NS_PER_US,
    ),
    (
        "nv_inference_compute_input_duration_us",
        "Cumulative compute_input time of successful requests, microseconds.",
        lambda s: s.compute_input.ns // _NS_PER_US,
    ),
    (
        "nv_inference_compute_infer_duration_us",
        "Cumulative compute_infer time of successful requests, microseconds.",
        lambda s: s.compute_infer.ns // _NS_PER_US,
    ),
    (
        "nv_inference_compute_output_duration_us",
        "Cumulative compute_output time of successful requests, microseconds.",
        lambda s: s.compute_output.ns // _NS_PER_US,
    ),
)
"""Triton's per-model inference counters: the name and unit Triton exports each under, its help, its reader."""
TRITON_PENDING = "nv_inference_pending_request_count"


class TritonMetricsCollector(Collector):
    """Triton's nv_inference_* metrics on /metrics (`--triton-metrics`), read when scraped.

    The counters come from the statistics; the pending request count is each model's queue depth.
    Dashboards and alerts written for Triton read them unchanged: the same names (without `_total`),
    the same `model` and `version` labels, the same figures as ModelStatistics. They are exposed as
    untyped: prometheus_client writes every counter family as `<name>_total`, and rate() reads
    untyped series alike. The scrape reads the statistics tables (every process's, summed).
    """

    def __init__(self, tables: StatisticsTables) -> None:
        self._tables = tables

    def collect(self) -> Iterator[Metric]:
        """One family per Triton metric, one sample per model version."""
        snapshots = [
            (model, version, self._tables.snapshot(model, version)) for model, version in self._tables.models()
        ]
        pending = Metric(TRITON_PENDING, "Inference requests waiting in the queue for a batch.", "gauge")
        for model, version, statistics in snapshots:
            pending.add_sample(TRITON_PENDING, {"model": model, "version": version}, statistics.pending)
        yield pending
        for name, text, read in TRITON_COUNTERS:
            family = Metric(name, text, "unknown")
            for model, version, statistics in snapshots:
                family.add_sample(name, {"model": model, "version": version}, read(statistics))
            yield family
