"""The client without its I/O: settings, every task's steps, model info and when to try a call again.

A task (embed, rerank...) is written once here as steps: a generator that yields the calls it needs
answered, is sent their answers, and returns its result (requests built and checked, answers read,
through client.tasks). The blocking client (client.blocking) and the asyncio one (client.aio) only
send the calls: one after another, or concurrently, each retried as the client's policy says.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import TYPE_CHECKING, Concatenate, Generic, ParamSpec, TypeVar, overload

import numpy as np
from google.protobuf.message import Message

from client import tasks
from client.channels import Connections
from client.errors import EmbeddingError, named_item
from client.images import ImageItem
from client.retry import RetryPolicy
from protocol import grpc_service_pb2 as pb
from protocol.channel_security import ClientSecurity

if TYPE_CHECKING:
    from client.aio import AsyncEmbeddingClient
    from client.blocking import EmbeddingClient

DEFAULT_MODEL = "all-MiniLM-L6-v2"
Arguments = ParamSpec("Arguments")
Result = TypeVar("Result")


@dataclasses.dataclass(frozen=True)
class Call:
    """One call a task needs answered: a method of GRPCInferenceService and its request."""

    method: str
    request: Message
    places: Sequence[int] | None = None
    """Where each row of the request is among the call's inputs, to name the item a refusal names; None: as sent."""


Steps = Generator[Sequence[Call], list[Message], Result]
"""A task without its I/O: it yields calls that may be sent together, is sent their answers in order, and returns
its result."""


class Task(Generic[Arguments, Result]):
    """A client method written once as steps: asked of a client, it is run by that client's `_run`.

    The blocking client's `_run` returns the result, the asyncio client's is a coroutine of it.
    """

    def __init__(self, steps: Callable[Concatenate[BaseClient, Arguments], Steps[Result]]) -> None:
        self.steps = steps
        functools.update_wrapper(self, steps)

        @functools.wraps(steps)
        def method(client: BaseClient, /, *args: Arguments.args, **kwargs: Arguments.kwargs) -> object:
            return client._run(steps(client, *args, **kwargs))

        self._method = method

    @overload
    def __get__(self, client: None, owner: type) -> Task[Arguments, Result]: ...
    @overload
    def __get__(self, client: EmbeddingClient, owner: type) -> Callable[Arguments, Result]: ...
    @overload
    def __get__(self, client: AsyncEmbeddingClient, owner: type) -> Callable[Arguments, Awaitable[Result]]: ...
    def __get__(self, client: BaseClient | None, owner: type) -> object:
        return self if client is None else types.MethodType(self._method, client)


class BaseClient:
    """A client's target, default model, limits, security and retries.

    `target` is `host:port`, or `dns:///name:port` to balance round-robin over every address the name
    resolves to (a headless Kubernetes Service). `connections` channels are opened to it, each its own
    TCP connection to every address (client.channels says why several pay). `security` turns on TLS,
    mutual TLS and an API key (`ClientSecurity.from_files(ca_file=..., api_key_file=...)`); `api_key`
    sets (or replaces) the key alone: it names the tenant on a server with tenants. Each call is given
    `timeout_s`; a call refused RESOURCE_EXHAUSTED or UNAVAILABLE is tried again as `retry` says.
    """

    def __init__(
        self,
        target: str,
        model: str = DEFAULT_MODEL,
        timeout_s: float = 30.0,
        batch_size: int = 32,
        security: ClientSecurity | None = None,
        *,
        api_key: str | None = None,
        connections: int = 1,
        retry: RetryPolicy | None = None,
    ) -> None:
        if batch_size < 1 or timeout_s <= 0:
            raise ValueError("batch_size must be at least 1 and timeout_s above 0")
        security = security or ClientSecurity()
        if api_key is not None:
            security = dataclasses.replace(security, api_key=api_key)
        self.target = target
        self.model = model
        self.timeout_s = timeout_s
        self.batch_size = batch_size
        self.security = security
        self.connection_count = connections
        self.retry = retry or RetryPolicy()
        self.retries = 0
        """Calls tried again so far (after RESOURCE_EXHAUSTED or UNAVAILABLE)."""
        self.call_metadata = security.metadata()
        self._infos: dict[str, tasks.ModelInfo] = {}
        self.connections = self._connect(target, connections, security)

    @staticmethod
    def _connect(target: str, count: int, security: ClientSecurity) -> Connections:
        """The client's connections (blocking or asyncio channels)."""
        raise NotImplementedError

    def _run(self, steps: Steps[Result]) -> object:
        """A task's result (or a coroutine of it): every call its steps ask sent."""
        raise NotImplementedError

    def _sent_call(self, call: Call) -> object:
        """The call as sent on the next connection (the answer, or an awaitable of it), with the client's deadline."""
        method = getattr(self.connections.next_stub(), call.method)
        return method(call.request, timeout=self.timeout_s, metadata=self.call_metadata)

    def _retry_delay_s(self, call: Call, error: EmbeddingError, attempt: int) -> float:
        """Seconds to wait before a call's next try, its `attempt`-th having failed.

        Raises the error if none is due, naming the call's item it refuses.
        """
        delay_s = self.retry.delay_s(error, attempt)
        if delay_s is None:
            raise error if call.places is None else named_item(error, call.places)
        self.retries += 1
        return delay_s

    @Task
    def embed(
        self,
        inputs: Sequence[str | ImageItem],
        *,
        model: str | None = None,
        prompt_name: str | None = None,
        dimensions: int | None = None,
        truncate: bool | None = None,
        embedding_type: str = "float",
        task: str | None = None,
        priority: int | None = None,
    ) -> Steps[np.ndarray]:
        """Embeddings of the inputs, in order: float32 [n, d], or the int8/uint8/binary/ubinary form asked.

        inputs: texts (str) and, on a model with an image tower (CLIP, SigLIP), images: encoded bytes (PNG, JPEG,
        WebP, GIF) sent as they are, paths (pathlib.Path) whose files are sent, PIL images sent as PNG
        (client.images). Texts and images go in requests of their own (the server takes one kind a request),
        their answers put back in the inputs' order; a refusal names the item (`inputs[i]: ...`).
        prompt_name, truncate, task: for the texts. task: one of the model's task adapters
        (`model_info(...).tasks`), with its prompt of that name.
        priority: where the inputs wait in the server's queue, 1 the highest (bulk work: the lowest,
        `model_info(...).priority_levels`); None: the server's default for the caller.
        """
        output = tasks.embedding_output(embedding_type)
        options = tasks.EmbedOptions(prompt_name, dimensions, truncate, task=task, priority=priority)
        placed = tasks.embed_requests(model or self.model, inputs, [output], options, self.batch_size)
        places = [request.places for request in placed]
        responses = yield from _inferred([request.request for request in placed], places)
        return tasks.placed_rows(responses, places, output)

    @Task
    def embed_sparse(
        self,
        texts: Sequence[str],
        *,
        model: str | None = None,
        prompt_name: str | None = None,
        truncate: bool | None = None,
        top_k: int | None = None,
    ) -> Steps[tasks.SparseEmbeddings]:
        """Sparse (SPLADE, bge-m3 lexical) embeddings of the texts, each its top_k largest terms (all by default)."""
        options = tasks.EmbedOptions(prompt_name, None, truncate, top_k)
        requests = tasks.text_requests(model or self.model, texts, tasks.SPARSE_OUTPUTS, options, self.batch_size)
        return tasks.sparse((yield from _inferred(requests)))

    @Task
    def tokenize(
        self,
        texts: Sequence[str],
        *,
        model: str | None = None,
        prompt_name: str | None = None,
        truncate: bool | None = None,
        add_special_tokens: bool | None = None,
    ) -> Steps[list[tasks.Tokens]]:
        """Each text's tokens as the model reads it (ids and character offsets); the model does not run.

        The model's prompt (prompt_name, else its default) is put before each text, as `embed` does;
        truncate False: every token of a text longer than the model's maximum.
        """
        options = tasks.EmbedOptions(prompt_name, None, truncate)
        requests = tasks.tokenize_requests(model or self.model, texts, options, add_special_tokens, self.batch_size)
        return tasks.tokens((yield from _inferred(requests)))

    @Task
    def rerank(
        self,
        query: str | ImageItem,
        documents: Sequence[str | ImageItem],
        *,
        model: str | None = None,
        top_n: int | None = None,
        truncate: bool | None = None,
        raw_scores: bool = False,
        instruction: str | None = None,
    ) -> Steps[tasks.Ranking]:
        """The documents ranked for the query by a reranker (or a multi-vector model): best first, top_n of them.

        A two-tower model (CLIP, SigLIP: `model_info(...).takes_images`) ranks by the cosine of its vectors, as the
        server's /rerank does: the query and the documents each a text or an image (as `embed` takes them); a
        refusal names the item by its place in [query, *documents] (`inputs[0]` is the query).
        instruction: a reranker with a pair template's instruction (Qwen3-Reranker's), in place of its default.
        """
        info = yield from self._described(model)
        if info.takes_images:
            if instruction is not None:
                raise ValueError(f"model {info.name} ranks by cosine: an instruction is a reranker's")
            placed = tasks.cosine_rerank_requests(info, query, documents, truncate, self.batch_size)
            places = [request.places for request in placed]
            responses = yield from _inferred([request.request for request in placed], places)
            return tasks.cosine_ranking(tasks.placed_rows(responses, places, "embedding"), top_n)
        requests = tasks.rerank_requests(info, query, documents, truncate, self.batch_size, instruction=instruction)
        return tasks.ranking(info, (yield from _inferred(requests)), top_n, raw_scores)

    @Task
    def classify(
        self,
        texts: Sequence[str],
        *,
        model: str | None = None,
        pairs_with: Sequence[str] | None = None,
        truncate: bool | None = None,
        raw_scores: bool = False,
    ) -> Steps[tasks.Classification]:
        """Scores over a classifier's labels per text; with `pairs_with`, row i is (pairs_with[i], texts[i])."""
        info = yield from self._described(model)
        requests = tasks.classify_requests(info, texts, pairs_with, truncate, self.batch_size)
        return tasks.classification(info, (yield from _inferred(requests)), raw_scores)

    @Task
    def models(self) -> Steps[list[str]]:
        """The names of the models the server has ready."""
        (index,) = yield [Call("RepositoryIndex", pb.RepositoryIndexRequest(ready=True))]
        return sorted({model.name for model in index.models})

    @Task
    def model_info(self, model: str | None = None) -> Steps[tasks.ModelInfo]:
        """What a model is (task, outputs, width, prompts, labels); asked once per model."""
        return (yield from self._described(model))

    @Task
    def infer(self, request: pb.ModelInferRequest) -> Steps[pb.ModelInferResponse]:
        """One ModelInfer call, retried as the client's retry policy says; EmbeddingError (typed) on failure."""
        (response,) = yield from _inferred([request])
        return response

    def _described(self, model: str | None) -> Steps[tasks.ModelInfo]:
        name = model or self.model
        if name not in self._infos:
            (metadata,) = yield [Call("ModelMetadata", pb.ModelMetadataRequest(name=name))]
            (config,) = yield [Call("ModelConfig", pb.ModelConfigRequest(name=name))]
            self._infos[name] = tasks.model_info(metadata, config)
        return self._infos[name]


def _inferred(
    requests: Sequence[pb.ModelInferRequest], places: Sequence[Sequence[int]] | None = None
) -> Steps[list[pb.ModelInferResponse]]:
    """Every request's answer, in order (the requests may be sent together).

    places: each request's rows' places among the call's inputs, to name the item a refusal names.
    """
    if places is None:
        return (yield [Call("ModelInfer", request) for request in requests])
    return (yield [Call("ModelInfer", request, where) for request, where in zip(requests, places, strict=True)])
