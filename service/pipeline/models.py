"""A served model: what it is, its tokenizer, and the queue its rows run through (a batcher here, or the engine's).

A two-tower model also has its image preprocessing and its image tower's queue: a request's images are decoded
and preprocessed on the pipeline's worker threads (never on the event loop), then run as rows of their own.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

import numpy as np

from service.core.placement import InstanceInfo
from service.core.policy import BatchingPolicy
from service.core.repository import ModelSpec
from service.core.rows import DEFAULT_SHARE, PixelRows, Rows, Share, TokenRows, WorkResult
from service.errors import InvalidArgument, RequestTooLarge, Unavailable
from service.ops import metrics, statistics, tracing
from service.ops.metrics import ModelLabels
from service.ops.settings import Settings
from service.ops.tenants import Tenant
from service.pipeline import multivector
from service.pipeline.answers import RAW, Reservation, value_bytes
from service.pipeline.images import ImagePreprocessor
from service.pipeline.long_texts import Windows
from service.pipeline.outputs import output_width
from service.pipeline.requests import ModelSignature, TextLimits, ValidRequest
from service.pipeline.tokenizer import TextTokenizer
from service.pipeline.vocabulary import (
    CHUNKS,
    MULTIVECTOR,
    MULTIVECTOR_LENGTHS,
    PRIORITY,
    SCORE,
    TOKEN_COUNTS,
    TOKEN_IDS,
    TOKEN_OFFSETS,
    TOKEN_STATES,
)

T = TypeVar("T")

if TYPE_CHECKING:
    from opentelemetry.trace import SpanContext


@dataclass(frozen=True)
class ModelInfo:
    """What a served model is: its repository facts, what it accepts, how it batches, where it runs."""

    spec: ModelSpec
    signature: ModelSignature
    policy: BatchingPolicy
    instances: tuple[InstanceInfo, ...]


class ModelQueue(Protocol):
    """Where a served model's rows run: its batcher in this process, or the engine process's."""

    on_serving_change: Callable[[bool], None] | None
    """Told False when the model loses its last working instance, True when one comes back."""

    def start(self) -> None:
        """Start serving, on the running event loop."""
        ...

    @property
    def serving(self) -> bool:
        """Whether the model can run rows now (an instance in service)."""
        ...

    def check_room(self, priority: int = 0) -> None:
        """Refuse at once (ServiceError) what `submit` would refuse now at `priority` (0: the lowest)."""
        ...

    async def submit(
        self,
        rows: Rows,
        outputs: tuple[str, ...],
        deadline: float | None,
        trace: SpanContext | None = None,
        share: Share = DEFAULT_SHARE,
    ) -> WorkResult:
        """Admit a request's rows (the one admission point, or a ServiceError), run them, return each requested output.

        Rows come back in the request's order. A closing queue still admits the rows of requests
        accepted before it began to close. `trace`: the request's span context (while tracing is on):
        the span of a batch its rows run in links to it. `share`: its priority and tenant.
        """
        ...

    def flush(self) -> None:
        """From now on, run queued rows without waiting out max_queue_delay for fuller batches (a drain)."""
        ...

    async def close(self, timeout_s: float) -> None:
        """Refuse new work (`check_room`), let submitted work finish (up to timeout_s), then stop."""
        ...


@dataclass(frozen=True, slots=True)
class RowsAnswered:
    """A request's rows back from the core, with what the pipeline learnt on the way."""

    work: WorkResult
    prompt_tokens: int
    """Real (unpadded) tokens of its sequences, special tokens included."""
    answer_bytes: int
    """Its answer's size as sent, held in the request's reservation."""
    rows: Rows
    """The rows as tokenised (or sent), or the images preprocessed: what per-position outputs are read with."""
    windows: Windows | None = None
    """How long texts were split into windows (truncate false); None: a row a text."""
    spans: np.ndarray | None = None
    """Late chunking: each chunk's [start, stop) positions in the document's one row."""


class ServedModel:
    """One served model: what it is, its tokenizer when it takes text, and the queue its rows run through."""

    def __init__(
        self,
        spec: ModelSpec,
        policy: BatchingPolicy,
        instances: tuple[InstanceInfo, ...],
        queue: ModelQueue,
        *,
        settings: Settings,
        tokenizer_pool: ThreadPoolExecutor,
        image_queue: ModelQueue | None = None,
    ) -> None:
        self.spec = spec
        self.policy = policy
        self.queue = queue
        self.image_queue = image_queue
        """Where the image tower's rows run (a two-tower model); None: the model takes no images."""
        self.preprocessor = (
            ImagePreprocessor.from_file(spec.image_preprocessor, settings.max_image_pixels)
            if spec.image_preprocessor is not None
            else None
        )
        self.metrics = metrics.of(ModelLabels(spec.name, spec.version))
        self.statistics = statistics.TABLES.of(spec.name, spec.version, policy.max_batch_size)
        self.tokenizer = TextTokenizer.of_model(spec) if spec.tokenizer_file is not None else None
        self._tokenizer_pool = tokenizer_pool
        self._inline_tokenize_chars = settings.inline_tokenize_chars
        self._chunk_overlap = settings.chunk_overlap_tokens
        self._max_chunks = settings.max_chunks_per_request
        self.accepted = 0
        """Requests inside `run`: being tokenised, or queued or running (a drain waits for them)."""
        self._closing = False
        self.signature = ModelSignature(
            spec,
            self.tokenizer is not None,
            policy.max_batch_size,
            TextLimits(settings.max_text_bytes, settings.max_request_text_bytes),
            policy.priority_levels,
            settings.max_image_bytes,
        )
        self.info = ModelInfo(spec, self.signature, policy, instances)

    async def run(
        self,
        request: ValidRequest,
        deadline: float | None,
        encodings: dict[str, str],
        reservation: Reservation,
        trace: tracing.RequestTrace | None = None,
        *,
        tenant: Tenant | None = None,
    ) -> RowsAnswered:
        """Accept (or refuse at once), tokenise if needed, budget the answer, submit the rows and wait for them.

        `encodings`: how the front end sends each output (answers.RAW when absent). The answer's bytes as sent
        are held in the request's `reservation`, which its envelope releases. Small
        texts are tokenised inline, larger ones on a worker. `trace`: the request's span (while tracing
        is on), for the tokenize and queue stages. `tenant`: whose request it is (its share of the queue).
        """
        if request.timeout_s is not None:
            own_deadline = time.monotonic() + request.timeout_s
            deadline = own_deadline if deadline is None else min(deadline, own_deadline)
        if self._closing:
            raise Unavailable("the model is shutting down")
        share = self.share(request.priority, tenant)
        queue = self.queue if request.images is None else self.image_queue
        queue.check_room(share.priority)
        self.accepted += 1
        try:
            windows = spans = None
            if request.images is not None:
                rows = await self._preprocess(request.images, trace)
            elif request.late_chunking:
                started = time.perf_counter()
                with tracing.stage(trace, "tokenize"):
                    work = functools.partial(self.tokenizer.encode_chunks, request.texts)
                    rows, spans = await self.tokenizer_work(sum(map(len, request.texts)), work)
                self.metrics.tokenize_duration.observe(time.perf_counter() - started)
            elif request.texts is not None:
                started = time.perf_counter()
                with tracing.stage(trace, "tokenize"):
                    rows, windows = await self._tokenize(request)
                self.metrics.tokenize_duration.observe(time.perf_counter() - started)
                if windows is not None:
                    self._check_windows(rows, request)
            else:
                rows = request.tokens
            if request.adapter_id:
                rows = rows.with_adapter(request.adapter_id)
            answer_bytes = reservation.hold(self._answer_size(rows, request, encodings))
            graph = tuple(dict.fromkeys(self.signature.outputs[name].source for name in request.outputs))
            if spans is not None:
                graph = (TOKEN_STATES,)
            if trace is None:
                work = await queue.submit(rows, graph, deadline, share=share)
            else:
                submitted = queue.submit(rows, graph, deadline, trace=trace.span_context, share=share)
                work = await trace.queued(submitted)
        finally:
            self.accepted -= 1
        return RowsAnswered(work, rows.real_tokens, answer_bytes, rows, windows, spans)

    @property
    def queues(self) -> tuple[ModelQueue, ...]:
        """Every queue of the model: its text (or token) rows', then its image tower's where that is another."""
        if self.image_queue is None or self.image_queue is self.queue:
            return (self.queue,)
        return (self.queue, self.image_queue)

    @property
    def serving(self) -> bool:
        """Whether the model can run every kind of row now: each of its queues has an instance in service."""
        return all(queue.serving for queue in self.queues)

    def on_serving_change(self, listener: Callable[[bool], None]) -> None:
        """Tell `listener(self.serving)` when any of its queues loses, or gets back, its last working instance.

        A stuck image batch takes the model out of service as a stuck text batch does.
        """
        for queue in self.queues:
            queue.on_serving_change = lambda _queue_serving: listener(self.serving)

    async def _preprocess(self, images: list[bytes], trace: tracing.RequestTrace | None) -> PixelRows:
        """The images decoded and preprocessed on a worker thread (errors name the image by its index)."""
        started = time.perf_counter()
        with tracing.stage(trace, "preprocess"):
            loop = asyncio.get_running_loop()
            pixels = await loop.run_in_executor(self._tokenizer_pool, self.preprocessor.encode, images)
        self.metrics.tokenize_duration.observe(time.perf_counter() - started)
        self.metrics.images_decoded(images)
        return PixelRows(pixels)

    def share(self, priority: int, tenant: Tenant | None) -> Share:
        """Where a request's rows wait, and its tenant's share among those of that priority.

        The priority it asked for, else its tenant's (at most the model's lowest), else the model's default;
        never above its tenant's highest_priority (asking for more is refused).
        """
        if tenant is None:
            return Share(priority or self.policy.default_priority)
        levels = self.policy.priority_levels
        highest = min(tenant.highest_priority, levels)
        if priority and priority < highest:
            raise InvalidArgument(
                f"parameter {PRIORITY} may be no higher than {highest} for tenant {tenant.name!r} (its"
                f" highest_priority in the tenants file; 1 is the highest), got {priority}"
            )
        chosen = priority or min(tenant.priority, levels) or self.policy.default_priority
        return Share(max(chosen, highest), tenant.name, tenant.weight)

    async def tokens(
        self,
        request: ValidRequest,
        encodings: dict[str, str],
        reservation: Reservation,
        trace: tracing.RequestTrace | None = None,
    ) -> tuple[dict[str, np.ndarray], int, int]:
        """The texts' tokens (the token outputs requested), answered by the tokenizer without running the model.

        Returns the outputs, the texts' tokens in all, and the outputs' bytes as sent, held in the
        request's `reservation`.
        """
        if self._closing:
            raise Unavailable("the model is shutting down")
        started = time.perf_counter()
        with tracing.stage(trace, "tokenize"):
            work = functools.partial(
                self.tokenizer.token_table, request.texts, request.add_special_tokens, request.truncate
            )
            ids, offsets, counts = await self.tokenizer_work(sum(map(len, request.texts)), work)
        self.metrics.tokenize_duration.observe(time.perf_counter() - started)
        table = {TOKEN_IDS: ids, TOKEN_OFFSETS: offsets, TOKEN_COUNTS: counts}
        outputs = {name: table[name] for name in request.outputs}
        size = sum(array.size * value_bytes(encodings.get(name, RAW), "INT64") for name, array in outputs.items())
        return outputs, int(counts.sum()), reservation.hold(math.ceil(size))

    def stop_accepting(self) -> None:
        """Refuse new requests from now on (Unavailable); those accepted are still submitted and answered."""
        self._closing = True

    async def close(self, timeout_s: float) -> None:
        """Refuse new requests, wait (up to timeout_s) for those accepted, then close the queue in the time left."""
        self.stop_accepting()
        deadline = time.monotonic() + timeout_s
        while self.accepted and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        left_s = max(0.0, deadline - time.monotonic())
        await asyncio.gather(*(queue.close(left_s) for queue in self.queues))

    def _answer_size(self, rows: Rows, request: ValidRequest, encodings: dict[str, str]) -> int:
        """Bytes the requested outputs take as the front end sends them (values x each one's bytes as encoded)."""
        size = 0.0
        for name in request.outputs:
            output = self.signature.outputs[name]
            if output.form == CHUNKS:
                values = rows.rows * (request.dimensions or self.spec.hidden_size)
            elif output.source == "embedding":
                values = request.rows * output_width(output, request.dimensions or self.spec.hidden_size)
            elif output.form == MULTIVECTOR:
                # At most a vector a token; the answer as sent is checked once the rows' vectors are known.
                values = math.prod(self.spec.output_shape(output.source, rows.rows, rows.width))
            elif output.form in (MULTIVECTOR_LENGTHS, SCORE):
                values = request.rows
            elif output.form is not None:
                # Sparse terms: indices and values together count as a dense row of the vocabulary (what a SPLADE
                # model holds), half each; the answer as sent is checked once they are known.
                size += request.rows * self.spec.vocab_size * value_bytes(RAW, "FP32") / 2
                continue
            else:
                values = math.prod(self.spec.output_shape(name, rows.rows, rows.width))
            size += values * value_bytes(encodings.get(name, RAW), output.datatype)
        return math.ceil(size)

    async def _tokenize(self, request: ValidRequest) -> tuple[TokenRows, Windows | None]:
        """The request's texts (or pairs) as token rows, and how long texts were split into windows (if any were).

        Small requests are tokenised inline, larger ones on a worker.
        """
        texts, queries = request.texts, request.queries
        characters = sum(map(len, texts)) + (sum(map(len, queries)) if queries is not None else 0)
        if self.spec.task == "multivector" and not request.truncate:
            raise InvalidArgument(
                f"model {self.spec.name} cuts texts at its query and document lengths: truncate false is not"
                " supported for multi-vector texts"
            )
        if self.spec.multivector is not None and (queries is not None or self.spec.task == "multivector"):
            return await self.tokenizer_work(characters, functools.partial(self._marked_rows, request)), None
        if queries is None and not request.truncate and self.spec.task == "embed":
            work = functools.partial(self.tokenizer.encode_windows, texts, self._chunk_overlap)
            rows, counts = await self.tokenizer_work(characters, work)
            return rows, (Windows(counts, rows.lengths) if rows.rows > len(texts) else None)
        if queries is None:
            work = functools.partial(self.tokenizer.encode_rows, texts, request.truncate)
        else:
            pairs = list(zip(queries, texts, strict=True))
            work = functools.partial(self.tokenizer.encode_pair_rows, pairs, request.truncate, request.instruction)
        return await self.tokenizer_work(characters, work), None

    def _marked_rows(self, request: ValidRequest) -> TokenRows:
        """A multi-vector model's rows: the texts as its input type says; for pairs, the distinct queries first."""
        tokenizer, spec = self.tokenizer, self.spec
        if request.queries is None:
            return multivector.tokenized(tokenizer, spec, request.texts, request.input_type)
        queries = multivector.tokenized(tokenizer, spec, list(dict.fromkeys(request.queries)), multivector.QUERY)
        return queries.joined(multivector.tokenized(tokenizer, spec, request.texts, multivector.DOCUMENT))

    def _check_windows(self, rows: TokenRows, request: ValidRequest) -> None:
        """Refuse a split request over --max-chunks-per-request, or one asking for an output windows cannot give."""
        if rows.rows > self._max_chunks:
            raise RequestTooLarge(
                f"the texts of this request make {rows.rows} windows of up to {self.spec.max_sequence_length} tokens,"
                f" over the limit of {self._max_chunks} per request (--max-chunks-per-request)",
                "too_many_chunks",
            )
        for name in request.outputs:
            if self.signature.outputs[name].source != "embedding":
                raise InvalidArgument(
                    f"output {name} cannot be answered for texts longer than the model's"
                    f" {self.spec.max_sequence_length} tokens with truncate false: they are embedded in windows;"
                    " ask for the embedding"
                )

    async def tokenizer_work(self, characters: int, work: Callable[[], T]) -> T:
        """Work on `characters` of text: on the event loop up to --inline-tokenize-chars, else on a worker."""
        if characters <= self._inline_tokenize_chars:
            return work()
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, work)
