"""Served models: loading from the repository, tokenisation, batching; the engine the servicer calls."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from service import metrics, statistics
from service.batcher import Batcher, BatchingPolicy, WorkResult
from service.codec import InferenceRequest, ModelSignature, TextLimits
from service.errors import InvalidArgument, NotFound, Unavailable
from service.metrics import ModelLabels, ModelMetrics
from service.repository import OUTPUTS, ModelSpec, RepositoryError, model_directories, read_model
from service.runtime import ExecutionError, ExecutionSettings, ModelRuntime, create_instances
from service.settings import Settings
from service.tokenizer import TextTokenizer, TokenizedBatch

log = logging.getLogger(__name__)

# Defaults that depend on the device (settings of 0 mean "auto").
CUDA_LENGTH_BUCKET = 32
CPU_MAX_BATCH_TOKENS = 4096
CUDA_MAX_BATCH_TOKENS = 16384


@dataclass(frozen=True)
class ModelState:
    """A model's place in the repository index."""

    name: str
    version: str
    state: str
    """READY, LOADING or UNAVAILABLE (as Triton reports it)."""
    reason: str = ""


@dataclass(frozen=True)
class InferenceResult(WorkResult):
    """The engine's answer to one request: the batcher's result, and what the request held."""

    prompt_tokens: int = 0
    """Real (unpadded) tokens of the request's sequences, special tokens included (OpenAI's `usage`)."""


class ServedModel:
    """One loaded model: its runtimes behind a batcher, and a tokenizer when it takes text."""

    def __init__(
        self, spec: ModelSpec, runtimes: list[ModelRuntime], settings: Settings, tokenizer_pool: ThreadPoolExecutor
    ) -> None:
        self.spec = spec
        self.runtimes = runtimes
        self.metrics = metrics.of(ModelLabels(spec.name, spec.version))
        self.statistics = statistics.of(spec.name, spec.version)
        self.tokenizer = (
            TextTokenizer(spec.tokenizer_file, spec.max_sequence_length, spec.pad_token_id)
            if spec.tokenizer_file is not None
            else None
        )
        self._tokenizer_pool = tokenizer_pool
        self._inline_tokenize_chars = settings.inline_tokenize_chars
        self._max_response_bytes = settings.max_response_bytes
        batching = spec.config.dynamic_batching
        primary = runtimes[0]
        self.policy = BatchingPolicy(
            max_batch_size=settings.max_batch_size or spec.max_batch_size,
            max_batch_tokens=settings.max_batch_tokens
            or (CUDA_MAX_BATCH_TOKENS if primary.device == "cuda" else CPU_MAX_BATCH_TOKENS),
            max_queue_delay_s=(
                settings.max_queue_delay_us
                if settings.max_queue_delay_us >= 0
                else batching.max_queue_delay_microseconds
            )
            / 1e6,
            max_queue_size=settings.max_queue_size or batching.default_queue_policy.max_queue_size or 1024,
            length_bucket=settings.length_bucket or (CUDA_LENGTH_BUCKET if primary.device == "cuda" else 1),
            pad_token_id=spec.pad_token_id,
            max_batch_run_s=settings.max_batch_run_s,
            max_length=spec.max_sequence_length,
        )
        self.signature = ModelSignature(
            spec,
            self.tokenizer is not None,
            self.policy.max_batch_size,
            TextLimits(settings.max_text_bytes, settings.max_request_text_bytes),
        )
        self.batcher = Batcher(runtimes, self.policy, self.metrics.labels, OUTPUTS)
        self.provider = primary.provider
        self.variant = primary.variant

    def warm_up_shapes(self) -> list[tuple[int, int]]:
        """(rows, length) shapes the batcher can form: every bucketed length, then the largest batch.

        Without length buckets (CPU) a short batch stands for the lengths. The largest batch, by
        memory, is the longest length with as many rows as the token budget allows there (a longer
        request is queued in parts that fit the budget; a single row is always allowed).
        """
        policy, longest = self.policy, self.spec.max_sequence_length
        if policy.length_bucket > 1:
            lengths = sorted({policy.padded_length(n) for n in range(1, longest + 1, policy.length_bucket)})
        else:
            lengths = [min(8, longest)]
        widest = policy.padded_length(longest)
        largest_rows = max(1, min(policy.max_batch_size, policy.max_batch_tokens // widest))
        return [(1, length) for length in lengths] + [(largest_rows, widest)]

    def warm_up(self) -> None:
        """Run every served shape once on every instance (blocking); a failure is an ExecutionError."""
        shapes = self.warm_up_shapes()
        for runtime in self.runtimes:
            runtime.warm_up(shapes)

    async def infer(self, request: InferenceRequest, deadline: float | None) -> InferenceResult:
        """Admit (or refuse at once), tokenise if needed, queue, await this request's rows.

        Small texts are tokenised inline, larger ones on a worker. A request over the batch token
        budget is queued in parts, each part re-entering the queue when the previous one is done,
        so it cannot hold the model while shorter requests wait behind all of it.
        """
        if request.timeout_s is not None:
            own_deadline = time.monotonic() + request.timeout_s
            deadline = own_deadline if deadline is None else min(deadline, own_deadline)
        self.batcher.admit()
        admitted = True
        try:
            tokenize_s = 0.0
            if request.texts is not None:
                started = time.perf_counter()
                tokens = (await self._tokenize(request.texts)).feed()
                tokenize_s = time.perf_counter() - started
                self.metrics.tokenize_duration.observe(tokenize_s)
            else:
                tokens = request.tokens
            self._check_response_size(tokens["input_ids"].shape, request.outputs)
            parts = []
            for part in self._parts(tokens):
                # submit() takes over the admitted place at once, whatever happens next.
                holds_place, admitted = admitted, False
                parts.append(await self.batcher.submit(part, request.outputs, deadline, holds_place))
        finally:
            if admitted:
                self.batcher.withdraw()
        joined = parts[0] if len(parts) == 1 else _joined(parts)
        result = InferenceResult(
            joined.outputs,
            joined.queue_s,
            joined.compute_s,
            joined.batch_rows,
            prompt_tokens=int(np.count_nonzero(tokens["attention_mask"])),
        )
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "request id=%r model=%s rows=%d length=%d tokenize=%.2fms queue=%.2fms compute=%.2fms batch_rows=%d",
                request.id,
                self.spec.name,
                request.rows,
                tokens["input_ids"].shape[1],
                tokenize_s * 1e3,
                result.queue_s * 1e3,
                result.compute_s * 1e3,
                result.batch_rows,
            )
        return result

    def _check_response_size(self, shape: tuple[int, int], outputs: tuple[str, ...]) -> None:
        """Refuse, before running it, a request whose answer would exceed --max-response-bytes."""
        rows, length = shape
        floats = {"embedding": rows * self.spec.hidden_size, "last_hidden_state": rows * length * self.spec.hidden_size}
        size = 4 * sum(floats[name] for name in outputs)
        if size > self._max_response_bytes:
            raise InvalidArgument(
                f"the requested outputs would take {size} bytes, over the limit of {self._max_response_bytes} bytes"
                " per response (--max-response-bytes); request fewer rows or only the embedding",
                "response_too_large",
            )

    async def _tokenize(self, texts: list[str]) -> TokenizedBatch:
        if sum(map(len, texts)) <= self._inline_tokenize_chars:
            return self.tokenizer.encode(texts)
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, self.tokenizer.encode, texts)

    def _parts(self, tokens: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        """The request's rows in slices that each fit the batch token budget (at least one row each)."""
        rows, length = tokens["input_ids"].shape
        per_part = max(
            1, min(self.policy.max_batch_size, self.policy.max_batch_tokens // self.policy.padded_length(length))
        )
        if rows <= per_part:
            return [tokens]
        return [
            {name: array[start : start + per_part] for name, array in tokens.items()}
            for start in range(0, rows, per_part)
        ]


def _joined(parts: list[WorkResult]) -> WorkResult:
    """One request's result from the results of its parts, in order."""
    outputs = {name: np.concatenate([part.outputs[name] for part in parts]) for name in parts[0].outputs}
    return WorkResult(
        outputs,
        queue_s=sum(part.queue_s for part in parts),
        compute_s=sum(part.compute_s for part in parts),
        batch_rows=max(part.batch_rows for part in parts),
    )


def _execution_settings(settings: Settings) -> ExecutionSettings:
    return ExecutionSettings(
        device=settings.device,
        require_gpu=settings.require_gpu,
        variant=settings.variant,
        intra_op_threads=settings.resolved_intra_op_threads(),
        allow_spinning=settings.allow_spinning,
        cuda_device_id=settings.cuda_device_id,
        gpu_mem_limit_bytes=settings.gpu_mem_limit_bytes,
        arena_extend_strategy=settings.arena_extend_strategy,
        cudnn_conv_algo_search=settings.cudnn_conv_algo_search,
    )


class ModelRegistry:
    """The models of one repository: loading, lookup, readiness, draining."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.models: dict[str, ServedModel] = {}
        self.states: dict[str, ModelState] = {}
        self.draining = False
        self.tokenizer_pool = ThreadPoolExecutor(max_workers=settings.tokenizer_threads, thread_name_prefix="tokenizer")

    def discover(self) -> list[str]:
        """Model folders in the repository; each starts LOADING."""
        names = [directory.name for directory in model_directories(self.settings.model_repository)]
        for name in names:
            self.states[name] = ModelState(name, "", "LOADING")
        return names

    def _load_blocking(self, name: str) -> ServedModel:
        spec = read_model(self.settings.model_repository / name)
        execution = _execution_settings(self.settings)
        runtimes = create_instances(spec, execution, self.settings.instances)
        model = ServedModel(spec, runtimes, self.settings, self.tokenizer_pool)
        if self.settings.warmup:
            model.warm_up()
        return model

    async def load(self, name: str) -> ServedModel:
        """Load and warm one model off the event loop; a failure marks it UNAVAILABLE and re-raises."""
        try:
            model = await asyncio.get_running_loop().run_in_executor(None, self._load_blocking, name)
        except (RepositoryError, ExecutionError) as error:
            self.states[name] = ModelState(name, "", "UNAVAILABLE", str(error))
            raise
        model.batcher.start()
        self.models[name] = model
        self.states[name] = ModelState(name, model.spec.version, "READY")
        metrics.MODEL_READY.labels(*model.metrics.labels.values()).set(1)
        for (provider, variant), count in Counter((r.provider, r.variant) for r in model.runtimes).items():
            metrics.PROVIDER.labels(*model.metrics.labels.values(), provider, variant).set(count)
        return model

    def metrics_for(self, name: str, version: str) -> ModelMetrics:
        """Metrics a request is counted in: its model's, or UNKNOWN_MODEL's for names not served."""
        model = self.models.get(name)
        if model is None or version not in ("", model.spec.version):
            return metrics.of(metrics.UNKNOWN_MODEL)
        return model.metrics

    def get(self, name: str, version: str = "") -> ServedModel:
        """The served model for a request; NOT_FOUND or UNAVAILABLE otherwise."""
        model = self.models.get(name)
        if model is None:
            state = self.states.get(name)
            if state is not None and state.state == "LOADING":
                raise Unavailable(f"model {name} is loading")
            if state is not None:
                raise Unavailable(f"model {name} failed to load: {state.reason}")
            raise NotFound(f"unknown model {name!r}")
        if version not in ("", model.spec.version):
            raise NotFound(f"model {name} has no version {version!r} (served: {model.spec.version})")
        return model

    def get_for_inference(self, name: str, version: str) -> ServedModel:
        """As get(), refusing new work while draining."""
        model = self.get(name, version)
        if self.draining:
            raise Unavailable("the server is shutting down")
        return model

    @property
    def ready(self) -> bool:
        """Every discovered model is loaded, and none has lost all its instances to overlong runs."""
        loaded = bool(self.states) and all(state.state == "READY" for state in self.states.values())
        return loaded and all(model.batcher.serving for model in self.models.values())

    async def close(self, timeout_s: float) -> None:
        """Drain every model's queue (bounded by timeout_s) and release the workers."""
        self.draining = True
        await asyncio.gather(*(model.batcher.close(timeout_s) for model in self.models.values()))
        for model in self.models.values():
            metrics.MODEL_READY.labels(*model.metrics.labels.values()).set(0)
        self.tokenizer_pool.shutdown(wait=False, cancel_futures=True)
