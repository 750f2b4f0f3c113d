"""A served model: what it is, its tokenizer, and the queue its rows run through (a batcher here, or the engine's)."""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

from service.core.policy import BatchingPolicy
from service.core.repository import ModelSpec
from service.core.rows import TokenRows, WorkResult
from service.errors import Unavailable
from service.ops import metrics, statistics, tracing
from service.ops.metrics import ModelLabels
from service.ops.settings import Settings
from service.pipeline.answers import RAW_VALUE_BYTES, AnswerBudget
from service.pipeline.tokenizer import TextTokenizer
from service.pipeline.validation import ModelSignature, TextLimits, ValidRequest

T = TypeVar("T")

if TYPE_CHECKING:
    from opentelemetry.trace import SpanContext

# Defaults that depend on the device (settings of 0 mean "auto").
CUDA_LENGTH_BUCKET = 32
CPU_MAX_BATCH_TOKENS = 4096
CUDA_MAX_BATCH_TOKENS = 16384
CPU_PADDING = (1.25, 16)
"""On the CPU no row is padded past 1.25 times its own length or its length plus 16 tokens, whichever
is more: a CPU's run costs about rows x padded length, plus little per batch
(docs/decisions.md#padding-limits-per-device)."""
CUDA_PADDING = (2.0, 32)
"""On CUDA rows may be padded to twice their length (or plus 32 tokens): a GPU's fixed cost per batch
is larger against its cost per token (docs/decisions.md#padding-limits-per-device)."""


@dataclass(frozen=True)
class InstanceInfo:
    """Where one model instance runs."""

    provider: str
    """The ONNX Runtime execution provider its session runs on."""
    variant: str
    cuda_device_id: int
    """The CUDA device ordinal (meaningful on CUDAExecutionProvider only)."""


@dataclass(frozen=True)
class ModelInfo:
    """What a served model is: its repository facts, what it accepts, how it batches, where it runs."""

    spec: ModelSpec
    signature: ModelSignature
    policy: BatchingPolicy
    instances: tuple[InstanceInfo, ...]


def batching_policy(spec: ModelSpec, settings: Settings, device: str) -> BatchingPolicy:
    """The batching limits in force: the settings where given, else the model's config.pbtxt and device defaults."""
    batching = spec.config.dynamic_batching
    delay_us = (
        settings.max_queue_delay_us if settings.max_queue_delay_us >= 0 else batching.max_queue_delay_microseconds
    )
    padding = CUDA_PADDING if device == "cuda" else CPU_PADDING
    return BatchingPolicy(
        max_batch_size=settings.max_batch_size or spec.max_batch_size,
        max_batch_tokens=settings.max_batch_tokens
        or (CUDA_MAX_BATCH_TOKENS if device == "cuda" else CPU_MAX_BATCH_TOKENS),
        max_queue_delay_s=delay_us / 1e6,
        max_queue_size=settings.max_queue_size or batching.default_queue_policy.max_queue_size or 1024,
        length_bucket=settings.length_bucket or (CUDA_LENGTH_BUCKET if device == "cuda" else 1),
        pad_token_id=spec.pad_token_id,
        max_batch_run_s=settings.max_batch_run_s,
        max_length=spec.max_sequence_length,
        max_padding_factor=padding[0],
        padding_slack_tokens=padding[1],
    )


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

    def check_room(self) -> None:
        """Refuse at once (ServiceError) what `submit` would refuse now, or any new request while closing."""
        ...

    async def submit(
        self,
        rows: TokenRows,
        outputs: tuple[str, ...],
        deadline: float | None,
        trace: SpanContext | None = None,
    ) -> WorkResult:
        """Admit a request's rows (the one admission point, or a ServiceError), run them, return each requested output.

        Rows come back in the request's order. A closing queue still admits the rows of requests
        accepted before it began to close. `trace`: the request's span context (while tracing is on):
        the span of a batch its rows run in links to it.
        """
        ...

    def flush(self) -> None:
        """From now on, run queued rows without waiting out max_queue_delay for fuller batches (a drain)."""
        ...

    async def close(self, timeout_s: float) -> None:
        """Refuse new work (`check_room`), let submitted work finish (up to timeout_s), then stop."""
        ...


def warm_up_shapes(spec: ModelSpec, policy: BatchingPolicy) -> list[tuple[int, int]]:
    """(rows, length) shapes the batcher can form: every bucketed length, then the largest batch.

    Without length buckets (CPU) a short batch stands for the lengths. The largest batch, by
    memory, is the longest length with as many rows as the token budget allows there (a batch of
    longer rows holds fewer of them; a single row is always allowed).
    """
    longest = spec.max_sequence_length
    if policy.length_bucket > 1:
        lengths = sorted({policy.padded_length(n) for n in range(1, longest + 1, policy.length_bucket)})
    else:
        lengths = [min(8, longest)]
    widest = policy.padded_length(longest)
    largest_rows = max(1, min(policy.max_batch_size, policy.max_batch_tokens // widest))
    return [(1, length) for length in lengths] + [(largest_rows, widest)]


@dataclass(frozen=True, slots=True)
class RowsAnswered:
    """A request's rows back from the core, with what the pipeline learnt on the way."""

    work: WorkResult
    prompt_tokens: int
    """Real (unpadded) tokens of its sequences, special tokens included."""
    answer_bytes: int
    """Its answer's size as sent, counted in the answer budget until released."""


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
    ) -> None:
        self.spec = spec
        self.policy = policy
        self.queue = queue
        self.metrics = metrics.of(ModelLabels(spec.name, spec.version))
        self.statistics = statistics.TABLES.of(spec.name, spec.version, policy.max_batch_size)
        self.tokenizer = (
            TextTokenizer(spec.tokenizer_file, spec.max_sequence_length, spec.pad_token_id)
            if spec.tokenizer_file is not None
            else None
        )
        self._tokenizer_pool = tokenizer_pool
        self._inline_tokenize_chars = settings.inline_tokenize_chars
        self.accepted = 0
        """Requests inside `run`: being tokenised, or queued or running (a drain waits for them)."""
        self._closing = False
        self.signature = ModelSignature(
            spec,
            self.tokenizer is not None,
            policy.max_batch_size,
            TextLimits(settings.max_text_bytes, settings.max_request_text_bytes),
        )
        self.info = ModelInfo(spec, self.signature, policy, instances)

    async def run(
        self,
        request: ValidRequest,
        deadline: float | None,
        value_bytes: dict[str, float],
        answers: AnswerBudget,
        trace: tracing.RequestTrace | None = None,
    ) -> RowsAnswered:
        """Accept (or refuse at once), tokenise if needed, budget the answer, submit the rows and wait for them.

        The answer's bytes as sent stay counted in `answers` until the front end releases them. Small
        texts are tokenised inline, larger ones on a worker. `trace`: the request's span (while tracing
        is on), for the tokenize and queue stages.
        """
        if request.timeout_s is not None:
            own_deadline = time.monotonic() + request.timeout_s
            deadline = own_deadline if deadline is None else min(deadline, own_deadline)
        if self._closing:
            raise Unavailable("the model is shutting down")
        self.queue.check_room()
        self.accepted += 1
        try:
            if request.texts is not None:
                started = time.perf_counter()
                with tracing.stage(trace, "tokenize"):
                    rows = await self._tokenize(request)
                self.metrics.tokenize_duration.observe(time.perf_counter() - started)
            else:
                rows = request.tokens
            answer_bytes = answers.reserve(self._answer_size(rows, request.outputs, value_bytes))
            try:
                if trace is None:
                    work = await self.queue.submit(rows, request.outputs, deadline)
                else:
                    work = await trace.queued(
                        self.queue.submit(rows, request.outputs, deadline, trace=trace.span_context)
                    )
            except BaseException:
                answers.release(answer_bytes)
                raise
        finally:
            self.accepted -= 1
        return RowsAnswered(work, rows.real_tokens, answer_bytes)

    def stop_accepting(self) -> None:
        """Refuse new requests from now on (Unavailable); those accepted are still submitted and answered."""
        self._closing = True

    async def close(self, timeout_s: float) -> None:
        """Refuse new requests, wait (up to timeout_s) for those accepted, then close the queue in the time left."""
        self.stop_accepting()
        deadline = time.monotonic() + timeout_s
        while self.accepted and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await self.queue.close(max(0.0, deadline - time.monotonic()))

    def _answer_size(self, rows: TokenRows, outputs: tuple[str, ...], value_bytes: dict[str, float]) -> int:
        """Bytes the requested outputs take as the front end sends them (values x each one's bytes)."""
        values = {name: math.prod(self.spec.output_shape(name, rows.rows, rows.width)) for name in outputs}
        return math.ceil(sum(values[name] * value_bytes.get(name, RAW_VALUE_BYTES) for name in outputs))

    async def _tokenize(self, request: ValidRequest) -> TokenRows:
        """The request's texts (or pairs) as token rows: small ones inline, larger ones on a worker."""
        texts, queries = request.texts, request.queries
        if queries is None:
            work = functools.partial(self.tokenizer.encode_rows, texts, request.truncate)
        else:
            work = functools.partial(
                self.tokenizer.encode_pair_rows, list(zip(queries, texts, strict=True)), request.truncate
            )
        characters = sum(map(len, texts)) + (sum(map(len, queries)) if queries is not None else 0)
        return await self.tokenizer_work(characters, work)

    async def tokenizer_work(self, characters: int, work: Callable[[], T]) -> T:
        """Work on `characters` of text: on the event loop up to --inline-tokenize-chars, else on a worker."""
        if characters <= self._inline_tokenize_chars:
            return work()
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, work)
