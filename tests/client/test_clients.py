"""EmbeddingClient and AsyncEmbeddingClient against real servers on loopback."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from client import AsyncEmbeddingClient, EmbeddingClient, EmbeddingError
from tests.conftest import TINY_MODEL
from tests.servers import RunningServer, metric_samples, metric_value, wait_for_metric
from tools.loadtest.corpus import load_corpus

TEXTS = list(load_corpus("short")[:5]) + list(load_corpus("long")[:2])
DIMENSION = 32


def one_by_one(server: RunningServer) -> np.ndarray:
    """Each text's embedding from a request of its own: the reference for order checks."""
    with EmbeddingClient(server.target, model=TINY_MODEL, batch_size=1) as client:
        return np.concatenate([client.embed([text]) for text in TEXTS])


def assert_same_rows_in_order(embeddings: np.ndarray, reference: np.ndarray) -> None:
    assert embeddings.shape == (len(TEXTS), DIMENSION) and embeddings.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, atol=1e-4)
    np.testing.assert_allclose(embeddings, reference, atol=1e-4)
    # The texts differ, so each row must be nearest to its own reference row.
    assert (np.argmax(embeddings @ reference.T, axis=1) == np.arange(len(TEXTS))).all()


@pytest.fixture(scope="module")
def reference(tiny_server: RunningServer) -> np.ndarray:
    return one_by_one(tiny_server)


def test_blocking_client_shapes_norms_and_order_across_requests(
    tiny_server: RunningServer, reference: np.ndarray
) -> None:
    with EmbeddingClient(tiny_server.target, model=TINY_MODEL, batch_size=3) as client:
        embeddings = client.embed(TEXTS)  # 3 requests: 3 + 3 + 1 texts
    assert_same_rows_in_order(embeddings, reference)


async def test_async_client_shapes_norms_and_order_across_concurrent_requests(
    tiny_server: RunningServer, reference: np.ndarray
) -> None:
    async with AsyncEmbeddingClient(tiny_server.target, model=TINY_MODEL, batch_size=2) as client:
        embeddings = await client.embed(TEXTS)  # 4 requests in flight at once
    assert_same_rows_in_order(embeddings, reference)


async def test_dns_target_reaches_the_server(tiny_server: RunningServer, reference: np.ndarray) -> None:
    target = f"dns:///127.0.0.1:{tiny_server.grpc_port}"
    with EmbeddingClient(target, model=TINY_MODEL) as client:
        assert_same_rows_in_order(client.embed(TEXTS), reference)
    async with AsyncEmbeddingClient(target, model=TINY_MODEL) as client:
        assert_same_rows_in_order(await client.embed(TEXTS), reference)


async def test_unknown_model_is_not_found(tiny_server: RunningServer) -> None:
    with EmbeddingClient(tiny_server.target, model="no-such-model") as client, pytest.raises(EmbeddingError) as caught:
        client.embed(["hello"])
    assert caught.value.code == grpc.StatusCode.NOT_FOUND
    async with AsyncEmbeddingClient(tiny_server.target, model="no-such-model") as client:
        with pytest.raises(EmbeddingError) as caught:
            await client.embed(["hello"])
    assert caught.value.code == grpc.StatusCode.NOT_FOUND


def test_deadline_shorter_than_the_batching_delay_is_exceeded(slow_server: RunningServer) -> None:
    labels = {"model": TINY_MODEL, "version": "1"}
    before = metric_samples(slow_server)
    client = EmbeddingClient(slow_server.target, model=TINY_MODEL, timeout_s=0.2)
    with client, pytest.raises(EmbeddingError) as caught:
        client.embed(["a request that waits in the batcher"])
    assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    # The deadline reached the server: it took the request out of its queue before the batch ran
    # (1 s on) and answered it DEADLINE_EXCEEDED, which it can only know from the call's deadline
    # (a client that merely went away is counted CANCELLED).
    exceeded = metric_value(before, "encoder_requests_total", code="DEADLINE_EXCEEDED", **labels)
    wait_for_metric(slow_server, "encoder_requests_total", exceeded + 1, code="DEADLINE_EXCEEDED", **labels)
    after = metric_samples(slow_server)

    def change(name: str, **extra: str) -> float:
        return metric_value(after, name, **labels, **extra) - metric_value(before, name, **labels, **extra)

    assert (
        change("encoder_requests_dropped_total", reason="expired")
        + change("encoder_requests_dropped_total", reason="cancelled")
        == 1
    )
    assert change("encoder_requests_total", code="CANCELLED") == 0
    assert change("encoder_sequences_total") == 0  # the model never ran it
    assert after[("encoder_queue_depth", tuple(sorted(labels.items())))] == 0  # and the queue is empty again


def test_empty_input_is_refused_before_sending(tiny_server: RunningServer) -> None:
    with EmbeddingClient(tiny_server.target, model=TINY_MODEL) as client, pytest.raises(ValueError):
        client.embed([])
