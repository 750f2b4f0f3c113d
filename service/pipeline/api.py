"""The pipeline's one API under every front end, with plain request and result types.

gRPC (unary and streaming), OpenAI, TEI, Cohere and KServe REST turn their wire format into an
`InferenceRequest` and, inside the request's envelope (service.envelope), make one `Pipeline.infer`
call; they ask the same object whether the server and its models are ready, and for their metadata,
configuration, statistics and repository index. Nothing here holds a protobuf message, an HTTP
request or a gRPC context: requests and results are numpy arrays, strings and small scalars.

Inside `infer`, in one place for every protocol: the request is checked against its model
(service.pipeline.validation), admitted or refused at once, tokenised when it carries text (images decoded and
preprocessed, for a two-tower model's image tower), its answer budgeted, and its rows batched with everyone's
(service.core.batcher, here or in the engine process). A request for its texts' tokens alone
(service.pipeline.vocabulary.TOKEN_OUTPUTS) is answered by the tokenizer and never reaches the batcher; so are
`tokenize` (texts to their tokens, each with its piece of the text) and `decode` (token ids to text), which
the envelope runs as it runs `infer`.
Counting, tenants and failures are the envelope's.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from service.core.placement import InstanceInfo
from service.core.repository import RepositoryError, served_names
from service.core.rows import TokenRows
from service.errors import ExecutionError, InvalidArgument, NotFound, TooLarge, Unavailable
from service.ops import metrics, tracing
from service.ops.settings import Settings
from service.ops.statistics import TABLES, ModelStatistics, StatisticsTable
from service.ops.tenants import Tenant
from service.pipeline.answers import (
    BASE64,
    INLINE_ENCODE_BYTES,
    JSON,
    RAW,
    AnswerBudget,
    Reservation,
    json_values,
    value_bytes,
)
from service.pipeline.embedding_types import embedding_types, type_output
from service.pipeline.long_texts import combined, late_chunked
from service.pipeline.models import ModelInfo, RowsAnswered, ServedModel
from service.pipeline.outputs import DEFAULT_NAMES, output_width
from service.pipeline.requests import InputTensor, ModelSignature, RowLimit
from service.pipeline.shaping import answer_outputs
from service.pipeline.tokenizer import TextTokenizer, Token
from service.pipeline.validation import check_rows, prompt_prefix, scheduling_parameters, valid_texts, validate
from service.pipeline.vocabulary import (
    CHUNK_COUNTS,
    CHUNKS,
    DIMENSIONS,
    EMBEDDING,
    EMBEDDING_TYPES,
    IMAGE_INPUT,
    INDICES,
    INPUT_TYPE,
    INSTRUCTION,
    MULTIVECTOR,
    MULTIVECTOR_LENGTHS,
    OUTPUT_OF_TYPE,
    PROMPT_NAME,
    QUERY_INPUT,
    REQUIRED_TOKEN_INPUTS,
    SCHEDULING,
    SCORE,
    TEXT_INPUT,
    TOKEN_STATES,
    TOKENS,
    TOP_K,
    TRUNCATE,
    VALUES,
)

log = logging.getLogger(__name__)

__all__ = [
    "BASE64",
    "DEFAULT_NAMES",
    "DIMENSIONS",
    "EMBEDDING",
    "EMBEDDING_TYPES",
    "IMAGE_INPUT",
    "INDICES",
    "INLINE_ENCODE_BYTES",
    "INPUT_TYPE",
    "INSTRUCTION",
    "JSON",
    "MULTIVECTOR",
    "MULTIVECTOR_LENGTHS",
    "OUTPUT_OF_TYPE",
    "PROMPT_NAME",
    "QUERY_INPUT",
    "RAW",
    "REQUIRED_TOKEN_INPUTS",
    "SCHEDULING",
    "SCORE",
    "TEXT_INPUT",
    "TOKENS",
    "TOKEN_STATES",
    "TOP_K",
    "TRUNCATE",
    "VALUES",
    "DecodeRequest",
    "DecodeResult",
    "InferenceRequest",
    "InferenceResult",
    "InputTensor",
    "InstanceInfo",
    "ModelInfo",
    "ModelSignature",
    "ModelState",
    "Pipeline",
    "PipelineResult",
    "Reservation",
    "RowLimit",
    "Token",
    "TokenizeRequest",
    "TokenizeResult",
    "embedding_types",
    "json_values",
    "output_width",
    "scheduling_parameters",
    "type_output",
]
"""The front ends' one door: the engine's API and request types, and the vocabulary their wire formats are written
in (the names of inputs, outputs and parameters, answer encodings, and the forms of an embedding), re-exported."""


@dataclass(slots=True)
class InferenceRequest:
    """One inference as a front end received it: which model, its inputs unchecked, what it wants back.

    Like every type on the request path, a slotted dataclass that is not changed after it is made.
    """

    model: str
    version: str = ""
    id: str = ""
    inputs: tuple[InputTensor, ...] = ()
    outputs: tuple[str, ...] = ()
    """Requested output names, in the order to answer them; empty = every output."""
    parameters: dict[str, bool | int | float | str] = field(default_factory=dict)
    """Triton's request parameters (`timeout`, microseconds, is honoured)."""
    row_limit: RowLimit | None = None
    """The front end's own bound on its rows; None = the model's max_batch_size."""
    dimensions: int | None = None
    """Embedding width asked for (OpenAI's `dimensions`); None = the model's own."""
    encodings: dict[str, str] = field(default_factory=dict)
    """How the front end sends each output, by name: answers.RAW (the default), JSON or BASE64 (the answer budget
    counts its bytes as sent)."""


@dataclass(slots=True)
class InferenceResult:
    """The engine's answer: each requested output (rows in the request's order), and what the request held."""

    model: str
    version: str
    id: str
    outputs: dict[str, np.ndarray]
    """Requested output name -> array (float32; int8 or uint8 for compact embeddings), in the order requested."""
    prompt_tokens: int
    """Real (unpadded) tokens of the request's sequences, special tokens included (OpenAI's `usage`)."""
    answer_bytes: int = 0
    """The answer's size as sent, held in the request's reservation (answers.Reservation) until it ends."""
    rows: int = 0
    """The request's rows (texts, pairs or token sequences)."""
    queue_s: float = 0.0
    """How long its rows waited to run."""
    compute_s: float = 0.0
    """How long the batches its rows ran in took."""
    row_tokens: np.ndarray | None = None
    """int64 [rows]: each row's tokens up to its last attended one, i.e. its unpadded part of last_hidden_state."""


@dataclass(slots=True)
class TokenizeRequest:
    """Texts to split into their tokens with a model's tokenizer (TEI's /tokenize): no inference runs."""

    model: str
    texts: list[bytes]
    """UTF-8, as a BYTES input's elements: held to the limits of an inference's texts."""
    add_special_tokens: bool = True
    parameters: dict[str, bool | int | float | str] = field(default_factory=dict)
    """prompt_name (or task): the model's prompt put before each text, as for inference."""
    row_limit: RowLimit | None = None
    """The front end's own bound on its texts; None = the model's max_batch_size."""
    version: str = ""


@dataclass(slots=True)
class TokenizeResult:
    """Each text's tokens (prompt included, truncated at the model's maximum), each with its piece of the text."""

    model: str
    version: str
    tokens: list[list[Token]]
    prompt_tokens: int
    """The tokens of every text: what the request is charged, as an inference's prompt tokens."""
    rows: int
    encode_inline: bool
    """Whether its answer is written on the event loop (its texts were tokenised there: --inline-tokenize-chars)."""
    answer_bytes: int = 0
    """The answer's size as sent, held in the request's reservation once written (`Pipeline.hold_written`)."""


@dataclass(slots=True)
class DecodeRequest:
    """Sequences of token ids to turn back into text with a model's tokenizer (TEI's /decode): no inference runs."""

    model: str
    sequences: list[list[int]]
    skip_special_tokens: bool = True
    row_limit: RowLimit | None = None
    """The front end's own bound on its sequences; None = the model's max_batch_size."""
    version: str = ""


@dataclass(slots=True)
class DecodeResult:
    """The text of each sequence of token ids."""

    model: str
    version: str
    texts: list[str]
    prompt_tokens: int
    """The ids decoded: what the request is charged, as an inference's prompt tokens."""
    rows: int
    encode_inline: bool
    """Whether its answer is written on the event loop (its ids were decoded there: --inline-tokenize-chars)."""
    answer_bytes: int = 0
    """The answer's size as sent, held in the request's reservation once written (`Pipeline.hold_written`)."""


PipelineResult = InferenceResult | TokenizeResult | DecodeResult
"""What one call of the pipeline answers; its `answer_bytes` are held in its request's reservation."""


@dataclass(frozen=True)
class ModelState:
    """A model's place in the repository index."""

    name: str
    version: str
    state: str
    """READY, LOADING or UNAVAILABLE (as Triton reports it)."""
    reason: str = ""


class Pipeline:
    """The models of one repository behind one API: loading, readiness, description, statistics, inference."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._models: dict[str, ServedModel] = {}
        self._states: dict[str, ModelState] = {}
        self._folders: dict[str, Path] = {}
        self.draining = False
        self.answers = AnswerBudget(
            settings.max_response_bytes, settings.max_answer_bytes_in_flight // max(1, settings.frontends)
        )
        """This process's answers in flight: its share of --max-answer-bytes-in-flight."""
        self._tokenizer_pool = ThreadPoolExecutor(
            max_workers=settings.tokenizer_threads, thread_name_prefix="tokenizer"
        )

    def discover(self) -> list[str]:
        """The models to serve: the repository's folders, then those given by name (--model); each starts LOADING."""
        names = served_names(self.settings)
        for name in names:
            self.set_state(name, "LOADING")
        return names

    def set_folder(self, name: str, folder: Path) -> None:
        """Where a model's folder is, when not in the repository (a model served by name: its export cache entry)."""
        self._folders[name] = folder

    def folder(self, name: str) -> Path:
        """A model's folder: in the repository, or where set_folder said."""
        return self._folders.get(name, self.settings.model_repository / name)

    async def load(self, name: str) -> ModelInfo:
        """Load and warm one model off the event loop and serve it; a failure marks it UNAVAILABLE and re-raises."""
        try:
            model = await asyncio.get_running_loop().run_in_executor(None, self._load, name)
        except (RepositoryError, ExecutionError) as error:
            self.set_state(name, "UNAVAILABLE", str(error))
            raise
        self.add(model)
        return model.info

    def _load(self, name: str) -> ServedModel:
        """A model loaded in this process (the core's part), with its tokenizer: blocking."""
        # Here, not at the top: front-end processes use this module and never load ONNX Runtime (~18 MB each).
        from service.core.loading import load_model  # noqa: PLC0415

        loaded = load_model(self.folder(name), self.settings)
        return ServedModel(
            loaded.spec,
            loaded.policy,
            loaded.instances,
            loaded.batcher,
            settings=self.settings,
            tokenizer_pool=self._tokenizer_pool,
            image_queue=loaded.image_batcher,
        )

    def add(self, model: ServedModel) -> None:
        """Serve a model (its queue started on the running loop): READY from now on."""
        for queue in model.queues:
            queue.start()
        self._models[model.spec.name] = model
        self.set_state(model.spec.name, "READY", version=model.spec.version)
        metrics.report_in_service(model.metrics.labels, ((i.provider, i.variant) for i in model.info.instances))

    def set_state(self, name: str, state: str, reason: str = "", version: str = "") -> None:
        """A model's place in the repository index: LOADING, READY or UNAVAILABLE (with why)."""
        self._states[name] = ModelState(name, version, state, reason)

    def tokenizer_pool(self) -> ThreadPoolExecutor:
        """The threads that tokenise large requests, for models served here."""
        return self._tokenizer_pool

    def served_names(self) -> list[str]:
        """The names of the models served now."""
        return sorted(self._models)

    def models(self) -> list[ModelInfo]:
        """Every loaded model, by name."""
        return [model.info for _, model in sorted(self._models.items())]

    def on_serving_change(self, name: str, listener: Callable[[bool], None]) -> None:
        """Tell `listener(serving)` when the model loses, or gets back, its last working instance (of any tower)."""
        self._models[name].on_serving_change(listener)

    @property
    def ready(self) -> bool:
        """Every discovered model is loaded and has an instance in service, and the server is not draining."""
        loaded = bool(self._states) and all(state.state == "READY" for state in self._states.values())
        return loaded and not self.draining and all(model.serving for model in self._models.values())

    def model_ready(self, name: str, version: str = "") -> bool:
        """That model (and version, if given) is loaded and in service, and the server is not draining."""
        model = self._models.get(name)
        return model is not None and version in ("", model.spec.version) and model.serving and not self.draining

    def model(self, name: str, version: str = "") -> ModelInfo:
        """What a served model is (its signature, batching and instances); NOT_FOUND or UNAVAILABLE otherwise."""
        return self.served(name, version).info

    def statistics(self, name: str = "", version: str = "") -> list[tuple[str, str, ModelStatistics]]:
        """Triton's cumulative statistics (model, version, figures) of one model (and version), or of every model."""
        models = [self.served(name, version)] if name else [model for _, model in sorted(self._models.items())]
        return [
            (model.spec.name, model.spec.version, TABLES.snapshot(model.spec.name, model.spec.version))
            for model in models
        ]

    def index(self, ready_only: bool = False) -> list[ModelState]:
        """Every model of the repository with its state (only READY ones if asked), by name."""
        states = sorted(self._states.values(), key=lambda state: state.name)
        return [state for state in states if state.state == "READY" or not ready_only]

    def served(self, name: str, version: str = "") -> ServedModel:
        """A served model by name (and version); NOT_FOUND or UNAVAILABLE otherwise."""
        model = self._models.get(name)
        if model is None:
            state = self._states.get(name)
            if state is not None and state.state == "LOADING":
                # A model served by name says how far its export is ("exporting: stage 7 of 16, ...").
                why = f"is not ready: {state.reason}" if state.reason else "is loading"
                raise Unavailable(f"model {name} {why}")
            if state is not None:
                # The reason (paths, library messages) is the log's and the repository index's, not every caller's.
                raise Unavailable(f"model {name} failed to load; see the server log or the repository index")
            raise NotFound(f"unknown model {name!r}")
        if version not in ("", model.spec.version):
            raise NotFound(f"model {name} has no version {version!r} (served: {model.spec.version})")
        return model

    def check_room(self, name: str, version: str = "") -> None:
        """Refuse at once, before a request is read, what its model's queue would refuse now at any priority."""
        self.served(name, version).queue.check_room(1)

    def counters(self, name: str, version: str = "") -> tuple[metrics.ModelMetrics, StatisticsTable | None]:
        """Where a request for this model is counted: its metrics and Triton's statistics table.

        A request naming a model (or version) that is not served is counted without a model label and
        in no table (client-chosen names would explode the metrics' cardinality).
        """
        served = self._models.get(name)
        if served is not None and version in ("", served.spec.version):
            return served.metrics, served.statistics
        return metrics.of(metrics.UNKNOWN_MODEL), None

    def reservation(self) -> Reservation:
        """A request's place in this process's answer budget, held once its answer's size is known."""
        return Reservation(self.answers)

    async def infer(
        self,
        request: InferenceRequest,
        reservation: Reservation,
        deadline: float | None = None,
        trace: tracing.RequestTrace | None = None,
        tenant: Tenant | None = None,
    ) -> InferenceResult:
        """Check, admit (or refuse at once), tokenise, batch: this request's outputs, or a ServiceError.

        `reservation`: where its answer's bytes are held (the caller releases it when the request
        ends). `deadline`: the caller's (time.monotonic), if any. `trace`: the request's span (while
        tracing is on), which gets the stages from here on. `tenant`: whose request it is, for its place
        in the queue (its priority and fair share); counting and tenants' limits are the envelope's
        (service.envelope).
        """
        model = self.served(request.model, request.version)
        with tracing.stage(trace, "validate"):
            valid = validate(
                request.inputs,
                request.outputs,
                request.parameters,
                model.signature,
                request.row_limit,
                dimensions=request.dimensions,
            )
        if valid.tokens_only:
            outputs, prompt_tokens, answer_bytes = await model.tokens(valid, request.encodings, reservation, trace)
            return InferenceResult(
                model.spec.name, model.spec.version, request.id, outputs, prompt_tokens, answer_bytes, valid.rows
            )
        answered = await model.run(valid, deadline, request.encodings, reservation, trace, tenant=tenant)
        work = answered.work
        if trace is not None:
            trace.answered(valid.rows, answered.prompt_tokens, work.batch_rows)
        graph = work.outputs
        if answered.windows is not None:
            windows = answered.windows
            graph = {
                "embedding": combined(graph["embedding"], windows, model.spec.normalize),
                CHUNKS: graph["embedding"],
                CHUNK_COUNTS: windows.counts[:, None],
            }
        elif answered.spans is not None:
            graph = {"embedding": late_chunked(graph["last_hidden_state"], answered.spans, model.spec.normalize)}
        outputs = answer_outputs(model.signature, valid, graph, answered.rows)
        if any(output_width(model.signature.outputs[name], 1) < 0 for name in valid.outputs):
            self._check_sent_size(outputs, model, request.encodings)
        return InferenceResult(
            model.spec.name,
            model.spec.version,
            request.id,
            outputs,
            answered.prompt_tokens,
            answered.answer_bytes,
            valid.rows,
            work.queue_s,
            work.compute_s,
            _row_tokens(answered),
        )

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResult:
        """Each text's tokens by the model's tokenizer, its texts checked as an inference's; large ones on a worker."""
        model = self.served(request.model, request.version)
        tokenizer = _tokenizer_of(model)
        prefix = prompt_prefix(request.parameters, model.spec)
        texts = valid_texts({"inputs": request.texts}, prefix, model.signature, request.row_limit)
        characters = sum(map(len, texts))
        special = request.add_special_tokens
        tokens = await model.tokenizer_work(characters, lambda: [tokenizer.tokens(text, special) for text in texts])
        return TokenizeResult(
            model.spec.name,
            model.spec.version,
            tokens,
            sum(map(len, tokens)),
            len(texts),
            encode_inline=characters <= self.settings.inline_tokenize_chars,
        )

    async def decode(self, request: DecodeRequest) -> DecodeResult:
        """The text of each sequence of ids by the model's tokenizer; an id outside its vocabulary is refused."""
        model = self.served(request.model, request.version)
        tokenizer = _tokenizer_of(model)
        check_rows(len(request.sequences), model.signature, request.row_limit)
        ids = sum(map(len, request.sequences))
        texts = await model.tokenizer_work(
            ids, lambda: tokenizer.decode(request.sequences, request.skip_special_tokens)
        )
        return DecodeResult(
            model.spec.name,
            model.spec.version,
            texts,
            ids,
            len(request.sequences),
            encode_inline=ids <= self.settings.inline_tokenize_chars,
        )

    def hold_written(self, result: TokenizeResult | DecodeResult, size: int, reservation: Reservation) -> None:
        """Hold a tokenizer's answer, now written (`size` bytes as sent), in `reservation`; or refuse it.

        Over --max-response-bytes: TooLarge; over --max-answer-bytes-in-flight: Overloaded.
        """
        limit = self.answers.max_response_bytes
        if size > limit:
            what, fewer = (
                ("the tokens of these texts", "texts")
                if isinstance(result, TokenizeResult)
                else ("the texts of these ids", "sequences")
            )
            raise TooLarge(
                f"{what} take {size} bytes as sent, over the limit of {limit} bytes per response"
                f" (--max-response-bytes); send fewer {fewer}",
                "response_too_large",
            )
        result.answer_bytes = reservation.hold(size)

    def _check_sent_size(self, outputs: dict[str, np.ndarray], model: ServedModel, encodings: dict[str, str]) -> None:
        """Refuse an answer over --max-response-bytes once its size is known (sparse terms, token vectors)."""
        size = sum(
            array.size * value_bytes(encodings.get(name, RAW), model.signature.outputs[name].datatype)
            for name, array in outputs.items()
        )
        if size > self.answers.max_response_bytes:
            raise TooLarge(
                f"the answer would take {math.ceil(size)} bytes as sent, over the limit of"
                f" {self.answers.max_response_bytes} bytes per response (--max-response-bytes); request fewer rows"
                " (or set top_k, for sparse terms)",
                "response_too_large",
            )

    def drain(self) -> None:
        """Start draining: not ready from now on, and queued work runs without waiting for fuller batches.

        Requests that reach the engine meanwhile are still taken: the transports stop accepting new
        ones themselves, and what they accepted is answered.
        """
        self.draining = True
        for model in self._models.values():
            for queue in model.queues:
                queue.flush()

    async def close(self, timeout_s: float) -> None:
        """Drain every model's queue (bounded by timeout_s), then refuse new work and release the workers."""
        self.drain()
        for model in self._models.values():
            model.stop_accepting()  # now, not when each close first runs
        await asyncio.gather(*(model.close(timeout_s) for model in self._models.values()))
        for model in self._models.values():
            metrics.MODEL_READY.labels(*model.metrics.labels.values()).set(0)
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)


def _row_tokens(answered: RowsAnswered) -> np.ndarray | None:
    """Each row's tokens, where a row is one of the request's texts (not windows, chunks or images)."""
    if isinstance(answered.rows, TokenRows) and answered.windows is None and answered.spans is None:
        return answered.rows.lengths
    return None


def _tokenizer_of(model: ServedModel) -> TextTokenizer:
    """The model's tokenizer; a model that takes token ids only has none (InvalidArgument)."""
    if model.tokenizer is None:
        raise InvalidArgument(f"model {model.spec.name} takes token ids, not text: it has no tokenizer")
    return model.tokenizer
