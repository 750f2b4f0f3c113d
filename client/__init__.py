"""Python clients for the encoder service (any KServe v2 / Triton gRPC server with a text input)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc
import numpy as np

from client.protocol import EmbeddingError, batches, channel_options, output_array, text_request
from protocol import grpc_service_pb2_grpc as pb_grpc
from protocol.channel_security import ClientSecurity, SecurityError

__all__ = ["AsyncEmbeddingClient", "ClientSecurity", "EmbeddingClient", "EmbeddingError", "SecurityError"]

DEFAULT_MODEL = "all-MiniLM-L6-v2"
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class _Client:
    """What both clients hold: the model, the limits, the channel and stub, the call metadata."""

    _asynchronous = False

    def __init__(
        self,
        target: str,
        model: str = DEFAULT_MODEL,
        timeout_s: float = 30.0,
        batch_size: int = 32,
        security: ClientSecurity | None = None,
    ) -> None:
        self.model = model
        self.timeout_s = timeout_s
        self.batch_size = batch_size
        security = security or ClientSecurity()
        self._metadata = security.metadata()
        open_channel = security.aio_channel if self._asynchronous else security.channel
        self._channel = open_channel(target, channel_options(target, MAX_MESSAGE_BYTES))
        self._stub = pb_grpc.GRPCInferenceServiceStub(self._channel)


class EmbeddingClient(_Client):
    """Blocking client: `EmbeddingClient("localhost:8001").embed(["a text"])` -> float32 [n, d].

    `target` may be `host:port`, or `dns:///name:port` to balance round-robin over every address
    the name resolves to (a headless Kubernetes Service). `security` turns on TLS, mutual TLS and
    an API key (`ClientSecurity.from_files(ca_file=..., api_key_file=...)`); plaintext by default.
    """

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Embeddings of the texts, in order; requests of at most batch_size texts each."""
        if not texts:
            raise ValueError("no texts to embed")
        parts = []
        for chunk in batches(texts, self.batch_size):
            try:
                response = self._stub.ModelInfer(
                    text_request(self.model, chunk), timeout=self.timeout_s, metadata=self._metadata
                )
            except grpc.RpcError as error:
                raise EmbeddingError(error.code(), error.details()) from error
            parts.append(output_array(response, "embedding"))
        return np.concatenate(parts)

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()

    def __enter__(self) -> EmbeddingClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncEmbeddingClient(_Client):
    """asyncio client: `await AsyncEmbeddingClient(target).embed(texts)`; batches are sent concurrently.

    Targets and `security` as for EmbeddingClient.
    """

    _asynchronous = True

    async def _embed_one(self, chunk: Sequence[str]) -> np.ndarray:
        try:
            response = await self._stub.ModelInfer(
                text_request(self.model, chunk), timeout=self.timeout_s, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as error:
            raise EmbeddingError(error.code(), error.details()) from error
        return output_array(response, "embedding")

    async def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Embeddings of the texts, in order."""
        if not texts:
            raise ValueError("no texts to embed")
        parts = await asyncio.gather(*(self._embed_one(chunk) for chunk in batches(texts, self.batch_size)))
        return np.concatenate(parts)

    async def close(self) -> None:
        """Close the channel."""
        await self._channel.close()

    async def __aenter__(self) -> AsyncEmbeddingClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
