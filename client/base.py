"""What the blocking and the asyncio client share: their settings, and each task's requests and results."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from client import tasks
from client.channels import Connections
from client.retry import RetryPolicy
from protocol import grpc_service_pb2 as pb
from protocol.channel_security import ClientSecurity

DEFAULT_MODEL = "all-MiniLM-L6-v2"


class ClientSettings:
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

    def _embed_requests(
        self,
        texts: Sequence[str],
        model: str | None,
        embedding_type: str,
        options: tasks.EmbedOptions,
    ) -> list[pb.ModelInferRequest]:
        output = tasks.embedding_output(embedding_type)
        return tasks.embed_requests(model or self.model, texts, [output], options, self.batch_size)

    def _sparse_requests(
        self, texts: Sequence[str], model: str | None, options: tasks.EmbedOptions
    ) -> list[pb.ModelInferRequest]:
        return tasks.embed_requests(model or self.model, texts, tasks.SPARSE_OUTPUTS, options, self.batch_size)

    @staticmethod
    def _embeddings(responses: Sequence[pb.ModelInferResponse], embedding_type: str) -> np.ndarray:
        return tasks.stacked(responses, tasks.embedding_output(embedding_type))
