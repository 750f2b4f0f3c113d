"""Triton's per-model inference statistics (the ModelStatistics RPC, GET .../stats), kept as plain counters.

Each served model (name, version) has one `ModelStatistics`, found with `of`. Every protocol's
requests (gRPC, KServe REST, OpenAI) are recorded where the engine counts every request
(service.metrics.TrackedRequest); batches where the batcher finishes them (`record_execution`). Every update is a
few integer additions on the event loop thread, so there is no lock; a statistics read sees a
consistent snapshot because it runs on that thread too.

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

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

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
    """Cumulative statistics of one model version since the server started."""

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

    def record_success(self, rows: int, total_s: float, queue_s: float, compute_s: float, output_s: float) -> None:
        """A request answered with `rows` rows after `total_s` in the server, of which the parts given."""
        self.inference_count += rows
        self.last_inference_ms = time.time_ns() // 1_000_000
        self.success.add(total_s)
        self.queue.add(queue_s)
        self.compute_infer.add(compute_s)
        self.compute_output.add(output_s)
        self.compute_input.add(max(0.0, total_s - queue_s - compute_s - output_s))

    def record_failure(self, total_s: float) -> None:
        """A request for this model that failed (any error after the model was found) after `total_s`."""
        self.fail.add(total_s)

    def record_execution(self, rows: int, compute_s: float) -> None:
        """A batch of `rows` rows that ran for `compute_s`."""
        self.execution_count += 1
        duration = self.batch_infer.get(rows)
        if duration is None:
            duration = self.batch_infer[rows] = Duration()
        duration.add(compute_s)


_BY_MODEL: dict[tuple[str, str], ModelStatistics] = {}


def of(model: str, version: str) -> ModelStatistics:
    """The statistics of a model version, created empty on first use (like a metric's labelled child)."""
    statistics = _BY_MODEL.get((model, version))
    if statistics is None:
        statistics = _BY_MODEL[(model, version)] = ModelStatistics()
    return statistics


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
    untyped series alike. The scrape runs on the metrics server's thread: it copies the table
    first and reads plain integers.
    """

    def __init__(self, queue_depths: Callable[[], dict[tuple[str, str], int]]) -> None:
        self._queue_depths = queue_depths
        """(model, version) -> requests waiting in its queue now: Triton's pending request count."""

    def collect(self) -> Iterator[Metric]:
        """One family per Triton metric, one sample per model version."""
        pending = Metric(TRITON_PENDING, "Inference requests waiting in the queue for a batch.", "gauge")
        for (model, version), depth in self._queue_depths().items():
            pending.add_sample(TRITON_PENDING, {"model": model, "version": version}, depth)
        yield pending
        models = list(_BY_MODEL.items())
        for name, text, read in TRITON_COUNTERS:
            family = Metric(name, text, "unknown")
            for (model, version), statistics in models:
                family.add_sample(name, {"model": model, "version": version}, read(statistics))
            yield family
