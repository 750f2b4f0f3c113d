"""Python clients for the encoder service (any KServe v2 / Triton gRPC server with a text input).

`EmbeddingClient` (blocking) and `AsyncEmbeddingClient` (asyncio): embed (texts and images), embed_sparse, rerank,
classify, tokenize, models, model_info; typed errors (client.errors) and retries (client.retry). Bulk
ingestion of files and images: `client.ingest.embed_file`, `client.ingest.embed_images` and `python -m client embed`.
"""

from __future__ import annotations

from client.aio import AsyncEmbeddingClient
from client.base import DEFAULT_MODEL
from client.blocking import EmbeddingClient
from client.channels import MAX_MESSAGE_BYTES
from client.errors import (
    DeadlineExceeded,
    EmbeddingError,
    InvalidRequest,
    MessageTooLarge,
    ModelNotFound,
    Overloaded,
    Unauthenticated,
    Unavailable,
)
from client.retry import RetryPolicy
from client.tasks import Classification, ModelInfo, Ranking, SparseEmbeddings, Tokens
from protocol.channel_security import ClientSecurity, SecurityError

__all__ = [
    "DEFAULT_MODEL",
    "MAX_MESSAGE_BYTES",
    "AsyncEmbeddingClient",
    "Classification",
    "ClientSecurity",
    "DeadlineExceeded",
    "EmbeddingClient",
    "EmbeddingError",
    "InvalidRequest",
    "MessageTooLarge",
    "ModelInfo",
    "ModelNotFound",
    "Overloaded",
    "Ranking",
    "RetryPolicy",
    "SecurityError",
    "SparseEmbeddings",
    "Tokens",
    "Unauthenticated",
    "Unavailable",
]
