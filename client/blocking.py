"""The blocking client: the tasks of client.base, their calls sent one after another, with retries."""

from __future__ import annotations

import time

import grpc
from google.protobuf.message import Message

from client.base import BaseClient, Call, Result, Steps
from client.channels import blocking_connections
from client.errors import rpc_error


class EmbeddingClient(BaseClient):
    """Blocking client: `EmbeddingClient("localhost:8001").embed(["a text"])` -> float32 [n, d].

    Every task the server has: `embed` (dense, or int8/uint8/binary/ubinary), `embed_sparse`,
    `rerank`, `classify`, `tokenize`; `models` and `model_info` tell what is served. Each method takes `model=`
    to use another model than the client's. Targets, security, connections and retries: BaseClient.
    """

    _connect = staticmethod(blocking_connections)

    def _run(self, steps: Steps[Result]) -> Result:
        """A task's result, its calls sent one after another."""
        try:
            calls = next(steps)
            while True:
                calls = steps.send([self._call(call) for call in calls])
        except StopIteration as finished:
            return finished.value

    def _call(self, call: Call) -> Message:
        attempt = 0
        while True:
            attempt += 1
            try:
                return self._sent_call(call)
            except grpc.RpcError as failure:
                error = rpc_error(failure)
            time.sleep(self._retry_delay_s(call, error, attempt))

    def close(self) -> None:
        """Close the connections."""
        for channel in self.connections.channels:
            channel.close()

    def __enter__(self) -> EmbeddingClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
