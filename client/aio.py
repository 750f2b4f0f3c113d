"""The asyncio client: every task of the server over gRPC, batches sent concurrently, with retries."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc
import numpy as np

from client import tasks
from client.base import ClientSettings
from client.channels import asyncio_connections
from client.errors import rpc_error
from protocol import grpc_service_pb2 as pb

MAX_IN_FLIGHT_PER_CONNECTION = 8
"""Requests of one call the client keeps unanswered per connection."""


class AsyncEmbeddingClient(ClientSettings):
    """asyncio client: `await AsyncEmbeddingClient(target).embed(texts)`; a call's batches are sent concurrently.

    The same methods and settings as EmbeddingClient (ClientSettings); create it inside the event loop.
    """

    _connect = staticmethod(asyncio_connections)

    async def embed(
        self,
        texts: Sequence[str],
        *,
        model: str | None = None,
        prompt_name: str | None = None,
        dimensions: int | None = None,
        truncate: bool | None = None,
        embedding_type: str = "float",
        task: str | None = None,
        priority: int | None = None,
    ) -> np.ndarray:
        """Embeddings of the texts, in order: float32 [n, d], or the int8/uint8/binary/ubinary form asked.

        task: one of the model's task adapters (`model_info(...).tasks`), with its prompt of that name.
        priority: where the texts wait in the server's queue, 1 the highest (bulk work: the lowest,
        `model_info(...).priority_levels`); None: the server's default for the caller.
        """
        options = tasks.EmbedOptions(prompt_name, dimensions, truncate, task=task, priority=priority)
        requests = self._embed_requests(texts, model, embedding_type, options)
        return self._embeddings(await self._infer_all(requests), embedding_type)

    async def embed_sparse(
        self,
        texts: Sequence[str],
        *,
        model: str | None = None,
        prompt_name: str | None = None,
        truncate: bool | None = None,
        top_k: int | None = None,
    ) -> tasks.SparseEmbeddings:
        """Sparse (SPLADE, bge-m3 lexical) embeddings of the texts, each its top_k largest terms (all by default)."""
        requests = self._sparse_requests(texts, model, tasks.EmbedOptions(prompt_name, None, truncate, top_k))
        return tasks.sparse(await self._infer_all(requests))

    async def tokenize(
        self,
        texts: Sequence[str],
        *,
        model: str | None = None,
        prompt_name: str | None = None,
        truncate: bool | None = None,
        add_special_tokens: bool | None = None,
    ) -> list[tasks.Tokens]:
        """Each text's tokens as the model reads it (ids and character offsets); the model does not run.

        The model's prompt (prompt_name, else its default) is put before each text, as `embed` does;
        truncate False: every token of a text longer than the model's maximum.
        """
        options = tasks.EmbedOptions(prompt_name, None, truncate)
        requests = tasks.tokenize_requests(model or self.model, texts, options, add_special_tokens, self.batch_size)
        return tasks.tokens(await self._infer_all(requests))

    async def rerank(
        self,
        query: str,
        documents: Sequence[str],
        *,
        model: str | None = None,
        top_n: int | None = None,
        truncate: bool | None = None,
        raw_scores: bool = False,
        instruction: str | None = None,
    ) -> tasks.Ranking:
        """The documents ranked for the query by a reranker (or a multi-vector model): best first, top_n of them.

        instruction: a reranker with a pair template's instruction (Qwen3-Reranker's), in place of its default.
        """
        info = await self.model_info(model)
        requests = tasks.rerank_requests(info, query, documents, truncate, self.batch_size, instruction=instruction)
        return tasks.ranking(info, await self._infer_all(requests), top_n, raw_scores)

    async def classify(
        self,
        texts: Sequence[str],
        *,
        model: str | None = None,
        pairs_with: Sequence[str] | None = None,
        truncate: bool | None = None,
        raw_scores: bool = False,
    ) -> tasks.Classification:
        """Scores over a classifier's labels per text; with `pairs_with`, row i is (pairs_with[i], texts[i])."""
        info = await self.model_info(model)
        requests = tasks.classify_requests(info, texts, pairs_with, truncate, self.batch_size)
        return tasks.classification(info, await self._infer_all(requests), raw_scores)

    async def models(self) -> list[str]:
        """The names of the models the server has ready."""
        index = await self._call("RepositoryIndex", pb.RepositoryIndexRequest(ready=True))
        return sorted({model.name for model in index.models})

    async def model_info(self, model: str | None = None) -> tasks.ModelInfo:
        """What a model is (task, outputs, width, prompts, labels); asked once per model."""
        name = model or self.model
        if name not in self._infos:
            metadata = await self._call("ModelMetadata", pb.ModelMetadataRequest(name=name))
            config = await self._call("ModelConfig", pb.ModelConfigRequest(name=name))
            self._infos[name] = tasks.model_info(metadata, config)
        return self._infos[name]

    async def infer(self, request: pb.ModelInferRequest) -> pb.ModelInferResponse:
        """One ModelInfer call, retried as the client's retry policy says; EmbeddingError (typed) on failure."""
        return await self._call("ModelInfer", request)

    async def _infer_all(self, requests: Sequence[pb.ModelInferRequest]) -> list[pb.ModelInferResponse]:
        """Every request's answer, in order, a bounded number in flight."""
        slots = asyncio.Semaphore(MAX_IN_FLIGHT_PER_CONNECTION * self.connection_count)

        async def bounded(request: pb.ModelInferRequest) -> pb.ModelInferResponse:
            async with slots:
                return await self.infer(request)

        return list(await asyncio.gather(*(bounded(request) for request in requests)))

    async def _call(self, method: str, request: object) -> object:
        attempt = 0
        while True:
            attempt += 1
            stub = self.connections.next_stub()
            try:
                return await getattr(stub, method)(request, timeout=self.timeout_s, metadata=self.call_metadata)
            except grpc.aio.AioRpcError as failure:
                error = rpc_error(failure)
            delay_s = self.retry.delay_s(error, attempt)
            if delay_s is None:
                raise error
            self.retries += 1
            await asyncio.sleep(delay_s)

    async def close(self) -> None:
        """Close the connections."""
        for channel in self.connections.channels:
            await channel.close()

    async def __aenter__(self) -> AsyncEmbeddingClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
