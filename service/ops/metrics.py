"""Prometheus metrics, declared once here; served on the metrics port at /metrics.

Names follow Prometheus conventions: base units (seconds), `_total` for counters, labelled by
model and version.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from service.errors import outcome
from service.ops.statistics import TABLES, StatisticsTable, StatisticsTables

# `*_created` timestamps double the series count and no dashboard or alert here reads them.
disable_created_metrics()

PREFIX = "encoder"
MODEL_LABELS = ("model", "version")
# Latency buckets from sub-millisecond (a lone short request on a GPU) to many seconds (queues
# behind long batches on a CPU).
LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.025,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.25,
    0.4,
    0.6,
    1.0,
    2.5,
    5.0,
    10.0,
)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)
RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)

REQUESTS = Counter(f"{PREFIX}_requests", "Inference requests answered, by gRPC status code.", (*MODEL_LABELS, "code"))
REQUEST_DURATION = Histogram(
    f"{PREFIX}_request_duration_seconds",
    "Time from receiving an inference request to answering it, by gRPC status code.",
    (*MODEL_LABELS, "code"),
    buckets=LATENCY_BUCKETS,
)
REJECTED = Counter(
    f"{PREFIX}_requests_rejected",
    "Requests refused at a limit or check before any work, by reason (queue_full, text_too_large,"
    " request_text_too_large, response_too_large, answer_budget, unauthenticated, no_instance, tenant_requests,"
    " tenant_tokens; images: image_too_large, image_unreadable, image_corrupt, image_not_rgb; over HTTP also"
    " message_too_large, too_many_inputs, http_concurrency, image_url, image_data).",
    ("reason",),
)
# Tenants (service.ops.tenants, docs/tenants.md): the label's values are the tenants of --api-key-file only.
TENANT_REQUESTS = Counter(
    f"{PREFIX}_tenant_requests",
    "Inference requests answered for each tenant of --api-key-file, by gRPC status code (as encoder_requests_total).",
    ("tenant", "code"),
)
TENANT_PROMPT_TOKENS = Counter(
    f"{PREFIX}_tenant_prompt_tokens",
    "Prompt tokens of each tenant's answered inference requests, counted by the model's tokenizer (special tokens"
    " included, no padding): what its tokens_per_minute limit is charged.",
    ("tenant",),
)
TENANT_QUEUE_DURATION = Histogram(
    f"{PREFIX}_tenant_queue_duration_seconds",
    "Time each tenant's inference requests waited in the batching queue (as encoder_queue_duration_seconds).",
    ("tenant",),
    buckets=LATENCY_BUCKETS,
)
TENANT_REJECTED = Counter(
    f"{PREFIX}_tenant_requests_rejected",
    "Inference requests refused because their tenant was over one of its limits, by limit (requests_per_second,"
    " tokens_per_minute).",
    ("tenant", "limit"),
)
HTTP_REQUESTS = Counter(
    f"{PREFIX}_http_requests",
    "Requests answered on the HTTP port, by route (its template, e.g. /v2/models/{name}/infer, or unmatched) and"
    " HTTP status. Inferences are also in encoder_requests_total with every protocol's.",
    ("route", "status"),
)
TOKENIZE_DURATION = Histogram(
    f"{PREFIX}_tokenize_duration_seconds",
    "Time spent tokenising the texts of one request, or decoding and preprocessing its images.",
    MODEL_LABELS,
    buckets=LATENCY_BUCKETS,
)
QUEUE_DURATION = Histogram(
    f"{PREFIX}_queue_duration_seconds",
    "Time a request waited in the batching queue.",
    MODEL_LABELS,
    buckets=LATENCY_BUCKETS,
)
COMPUTE_DURATION = Histogram(
    f"{PREFIX}_compute_duration_seconds",
    "Time the model took to run one batch.",
    MODEL_LABELS,
    buckets=LATENCY_BUCKETS,
)
BATCH_SIZE = Histogram(
    f"{PREFIX}_batch_size", "Sequences per batch run by the model.", MODEL_LABELS, buckets=BATCH_SIZE_BUCKETS
)
PADDING_RATIO = Histogram(
    f"{PREFIX}_padding_ratio", "Share of a batch's token slots that are padding.", MODEL_LABELS, buckets=RATIO_BUCKETS
)
SEQUENCES = Counter(f"{PREFIX}_sequences", "Sequences run through the model.", MODEL_LABELS)
TOKENS = Counter(f"{PREFIX}_tokens", "Real (unpadded) tokens run through the model.", MODEL_LABELS)
IMAGES = Counter(
    f"{PREFIX}_images",
    "Images decoded and preprocessed into pixel values for a two-tower model's image tower (refused ones are in"
    " encoder_requests_rejected_total).",
    MODEL_LABELS,
)
IMAGE_BYTES = Counter(
    f"{PREFIX}_image_bytes",
    "Bytes of the encoded images (PNG, JPEG, WebP, GIF, as sent) in encoder_images_total.",
    MODEL_LABELS,
)
ROWS_RUN = Counter(
    f"{PREFIX}_rows_run",
    "Rows (sequences) run through the model, by priority (1 the highest) and tenant (empty without API keys): how"
    " the engine was shared. They sum to encoder_sequences_total.",
    (*MODEL_LABELS, "priority", "tenant"),
)
DROPPED = Counter(
    f"{PREFIX}_requests_dropped",
    "Queued requests dropped before running, by reason (cancelled, expired).",
    (*MODEL_LABELS, "reason"),
)
TRACE_SPANS_DROPPED = Counter(
    f"{PREFIX}_trace_spans_dropped",
    "Trace spans dropped instead of exported, by reason (queue_full: the exporter's queue, OTEL_BSP_MAX_QUEUE_SIZE,"
    " was full; export_failed: the OTLP receiver did not take them). Requests never wait for the exporter.",
    ("reason",),
)
QUEUE_DEPTH = f"{PREFIX}_queue_depth"
QUEUE_DEPTH_HELP = "Requests waiting in the batching queue."
INFLIGHT = f"{PREFIX}_inflight_requests"
INFLIGHT_HELP = "Inference requests received and not yet answered."
# The engine's gauges: written by one process (the engine's), so "max" over processes is its value.
QUEUE_CAPACITY = Gauge(
    f"{PREFIX}_queue_capacity",
    "Requests the batching queue holds before rejecting.",
    MODEL_LABELS,
    multiprocess_mode="max",
)
QUEUE_ROWS = Gauge(
    f"{PREFIX}_queue_rows",
    "Rows waiting in the batching queue, by priority (1 the highest) and tenant (empty without API keys).",
    (*MODEL_LABELS, "priority", "tenant"),
    multiprocess_mode="max",
)
STUCK_INSTANCES = Gauge(
    f"{PREFIX}_stuck_instances",
    "Model instances whose run exceeded --max-batch-run-s and has not returned yet.",
    MODEL_LABELS,
    multiprocess_mode="max",
)
MODEL_READY = Gauge(
    f"{PREFIX}_model_ready", "1 when the model is loaded and warmed up, else 0.", MODEL_LABELS, multiprocess_mode="max"
)
PROVIDER = Gauge(
    f"{PREFIX}_execution_provider_info",
    "Model instances running on each ONNX Runtime execution provider and variant.",
    (*MODEL_LABELS, "provider", "variant"),
    multiprocess_mode="max",
)

# Gauges each front-end process writes for itself: the server's figure is their sum.
ANSWER_BYTES = Gauge(
    f"{PREFIX}_answer_bytes_in_flight",
    "Bytes of answers (as sent) accepted and not yet handed to the transport (--max-answer-bytes-in-flight).",
    multiprocess_mode="livesum",
)
ANSWER_BYTES_CAPACITY = Gauge(
    f"{PREFIX}_answer_bytes_capacity",
    "Bytes of answers the server may hold in flight before refusing more (--max-answer-bytes-in-flight).",
    multiprocess_mode="livesum",
)
HTTP_REQUESTS_ACTIVE = Gauge(
    f"{PREFIX}_http_requests_active",
    "HTTP requests being read, run or answered (--max-concurrent-http-requests).",
    multiprocess_mode="livesum",
)
EVENT_LOOP_LAG = Histogram(
    f"{PREFIX}_event_loop_lag_seconds",
    "How late a timer of the event loop fires, sampled every 100 ms in every process: the wait a health check or"
    " a new request meets before any of its work starts.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)


class LiveGauges(Collector):
    """encoder_inflight_requests and encoder_queue_depth, read from the statistics tables when scraped.

    The counts live where the request path keeps them anyway (every process's tables, summed), so
    the request path updates no gauge for them.
    """

    def __init__(self, tables: StatisticsTables) -> None:
        self._tables = tables

    def describe(self) -> Iterator[GaugeMetricFamily]:
        """The two gauge families, without samples."""
        yield GaugeMetricFamily(INFLIGHT, INFLIGHT_HELP, labels=MODEL_LABELS)
        yield GaugeMetricFamily(QUEUE_DEPTH, QUEUE_DEPTH_HELP, labels=MODEL_LABELS)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """One sample per model version of each gauge."""
        inflight = GaugeMetricFamily(INFLIGHT, INFLIGHT_HELP, labels=MODEL_LABELS)
        depth = GaugeMetricFamily(QUEUE_DEPTH, QUEUE_DEPTH_HELP, labels=MODEL_LABELS)
        for model, version in self._tables.models():
            snapshot = self._tables.snapshot(model, version)
            inflight.add_metric([model, version], snapshot.inflight)
            depth.add_metric([model, version], snapshot.pending)
        yield inflight
        yield depth


LIVE_GAUGES = LiveGauges(TABLES)
REGISTRY.register(LIVE_GAUGES)


@dataclass(frozen=True)
class ModelLabels:
    """The (model, version) label values of one served model."""

    model: str
    version: str

    def values(self) -> tuple[str, str]:
        """As positional label values."""
        return (self.model, self.version)


def report_in_service(labels: ModelLabels, placements: Iterable[tuple[str, str]]) -> None:
    """A model version loaded and in service: encoder_model_ready 1, its instances by (provider, variant)."""
    values = labels.values()
    MODEL_READY.labels(*values).set(1)
    for (provider, variant), count in collections.Counter(placements).items():
        PROVIDER.labels(*values, provider, variant).set(count)


UNKNOWN_MODEL = ModelLabels("", "")
"""Labels for requests naming a model that is not served (client-chosen names would explode cardinality)."""


class ModelMetrics:
    """One model version's labelled metric children, resolved once.

    `labels()` takes a lock and a dictionary lookup on every call; the request path instead uses
    these children.
    """

    def __init__(self, labels: ModelLabels) -> None:
        values = labels.values()
        self.labels = labels
        self.tokenize_duration = TOKENIZE_DURATION.labels(*values)
        self.queue_duration = QUEUE_DURATION.labels(*values)
        self.compute_duration = COMPUTE_DURATION.labels(*values)
        self.batch_size = BATCH_SIZE.labels(*values)
        self.padding_ratio = PADDING_RATIO.labels(*values)
        self.sequences = SEQUENCES.labels(*values)
        self.tokens = TOKENS.labels(*values)
        self._images = IMAGES.labels(*values)
        self._image_bytes = IMAGE_BYTES.labels(*values)
        self._answered: dict[str, tuple[Any, Any]] = {}
        self._rows_run: dict[tuple[int, str], Any] = {}

    def answered(self, code: str, seconds: float) -> None:
        """Count one answered request with its status code's name and its time in the server."""
        children = self._answered.get(code)
        if children is None:
            values = self.labels.values()
            children = self._answered[code] = (REQUESTS.labels(*values, code), REQUEST_DURATION.labels(*values, code))
        children[0].inc()
        children[1].observe(seconds)

    def images_decoded(self, images: Sequence[bytes]) -> None:
        """Count encoded images decoded and preprocessed into pixel values, and their bytes."""
        self._images.inc(len(images))
        self._image_bytes.inc(sum(map(len, images)))

    def dropped(self, reason: str) -> None:
        """Count one queued request dropped before it ran (cancelled, expired)."""
        DROPPED.labels(*self.labels.values(), reason).inc()

    def ran(self, priority: int, tenant: str, rows: int) -> None:
        """Count `rows` of a tenant's request, queued at `priority`, run in a batch that returned."""
        child = self._rows_run.get((priority, tenant))
        if child is None:
            child = self._rows_run[priority, tenant] = ROWS_RUN.labels(*self.labels.values(), str(priority), tenant)
        child.inc(rows)


_BY_MODEL: dict[ModelLabels, ModelMetrics] = {}


def of(labels: ModelLabels) -> ModelMetrics:
    """The metric children of a model version, resolved on first use."""
    model_metrics = _BY_MODEL.get(labels)
    if model_metrics is None:
        model_metrics = _BY_MODEL[labels] = ModelMetrics(labels)
    return model_metrics


class TenantMetrics:
    """One tenant's labelled metric children, resolved once (as ModelMetrics)."""

    def __init__(self, tenant: str) -> None:
        self.tenant = tenant
        self.prompt_tokens = TENANT_PROMPT_TOKENS.labels(tenant)
        self.queue_duration = TENANT_QUEUE_DURATION.labels(tenant)
        self._answered: dict[str, Any] = {}
        self._rejected: dict[str, Any] = {}

    def answered(self, code: str) -> None:
        """Count one of the tenant's requests answered, with its status code's name."""
        child = self._answered.get(code)
        if child is None:
            child = self._answered[code] = TENANT_REQUESTS.labels(self.tenant, code)
        child.inc()

    def rejected(self, limit: str) -> None:
        """Count one of the tenant's requests refused at one of its limits."""
        child = self._rejected.get(limit)
        if child is None:
            child = self._rejected[limit] = TENANT_REJECTED.labels(self.tenant, limit)
        child.inc()


_BY_TENANT: dict[str, TenantMetrics] = {}


def of_tenant(tenant: str) -> TenantMetrics:
    """The metric children of a tenant, resolved on first use."""
    tenant_metrics = _BY_TENANT.get(tenant)
    if tenant_metrics is None:
        tenant_metrics = _BY_TENANT[tenant] = TenantMetrics(tenant)
    return tenant_metrics


class TrackedRequest:
    """Count one inference request: in flight while inside, then its status code and duration, and Triton's statistics.

    `statistics`: the model's table (None for a request naming a model that is not served). The
    duration counts from `received` (time.perf_counter, when the front end received it); `inferred`
    marks its rows' return (rows, queue and compute time). It counts in the statistics as a success
    if `inferred` was called and no exception left the block, else as a failure; its outcome is
    service.errors.outcome's. `tenant`: the metrics of the caller's tenant (API keys on), which count it too.
    The request envelope (service.envelope) is its one user; refusals at a limit are counted there.
    """

    __slots__ = (
        "_compute_s",
        "_deadline",
        "_inferred",
        "_metrics",
        "_queue_s",
        "_received",
        "_rows",
        "_statistics",
        "_tenant",
    )

    def __init__(
        self,
        model_metrics: ModelMetrics,
        statistics: StatisticsTable | None,
        deadline: float | None,
        received: float,
        tenant: TenantMetrics | None = None,
    ) -> None:
        self._metrics = model_metrics
        self._tenant = tenant
        self._statistics = statistics
        self._deadline = deadline
        """The caller's monotonic deadline: a cancellation at it is counted DEADLINE_EXCEEDED."""
        self._received = received
        self._inferred = 0.0
        self._rows = 0
        self._queue_s = self._compute_s = 0.0

    def __enter__(self) -> TrackedRequest:
        if self._statistics is not None:
            self._statistics.add_inflight(1)
        return self

    def inferred(self, rows: int, queue_s: float, compute_s: float) -> None:
        """The request's rows are back, after `queue_s` queued and `compute_s` running."""
        self._inferred = time.perf_counter()
        self._rows, self._queue_s, self._compute_s = rows, queue_s, compute_s
        self._metrics.queue_duration.observe(queue_s)
        if self._tenant is not None:
            self._tenant.queue_duration.observe(queue_s)

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, traceback: object) -> None:
        answered = time.perf_counter()
        total_s = answered - self._received
        code = outcome(error, self._deadline)
        self._metrics.answered(code, total_s)
        if self._tenant is not None:
            self._tenant.answered(code)
        statistics = self._statistics
        if statistics is None:
            return
        statistics.add_inflight(-1)
        if error is None and self._inferred:
            statistics.record_success(self._rows, total_s, self._queue_s, self._compute_s, answered - self._inferred)
        else:
            statistics.record_failure(total_s)


LOOP_LAG_INTERVAL_S = 0.1


async def watch_event_loop_lag(interval_s: float = LOOP_LAG_INTERVAL_S) -> None:
    """Observe, every interval, how late the running event loop wakes a sleeping task (until cancelled)."""
    while True:
        expected = time.monotonic() + interval_s
        await asyncio.sleep(interval_s)
        EVENT_LOOP_LAG.observe(max(0.0, time.monotonic() - expected))
