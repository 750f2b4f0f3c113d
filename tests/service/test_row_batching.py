"""Batches of rows, end to end: a request's rows come back in its order, rows of several requests share batches.

What the batcher did is read from the server's own ModelStatistics (batch_stats: executions per
batch size), never from timing.
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton

from service.core.fidelity import cosines
from tests.conftest import DEFAULT_MODEL, TINY_MODEL
from tests.servers import RunningServer, start_server
from tools.loadtest.corpus import load_corpus

MIXED = [*load_corpus("short")[:4], *load_corpus("chunks")[:4]]
"""Sentences and document chunks of 8-240 words: rows of very different lengths in one request."""
SAME_AS_ALONE = {"fp32": 0.99999, "fp16": 0.99999, "int8": 0.998}
"""Cosine between a text's row in a mixed request and the text sent alone. int8's activation ranges are
measured per batch (dynamic quantisation), so its rows depend slightly on their batch: 0.9987 measured."""


def text_input(texts: list[str]) -> triton.InferInput:
    tensor = triton.InferInput("text", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([text.encode() for text in texts], dtype=object))
    return tensor


def embed(client: triton.InferenceServerClient, model: str, texts: list[str]) -> np.ndarray:
    return client.infer(model, [text_input(texts)]).as_numpy("embedding")


def batch_sizes(client: triton.InferenceServerClient, model: str) -> dict[int, int]:
    """Executions per batch size (rows), as the server counted them."""
    (statistics,) = client.get_inference_statistics(model).model_stats
    return {batch.batch_size: batch.compute_infer.count for batch in statistics.batch_stats}


@pytest.mark.parametrize("variant", ["fp32", "fp16", "int8"])
def test_a_requests_rows_come_back_in_order_and_equal_each_text_sent_alone(
    default_repository: Path, tmp_path: Path, variant: str
) -> None:
    flags = ("--variant", variant, "--device", "cpu")
    with start_server(default_repository, tmp_path / "server.log", *flags) as server:
        client = triton.InferenceServerClient(server.target)
        together = embed(client, DEFAULT_MODEL, MIXED)
        alone = np.concatenate([embed(client, DEFAULT_MODEL, [text]) for text in MIXED])
        client.close()
    similarity = cosines(together, alone)
    assert similarity.min() >= SAME_AS_ALONE[variant], similarity


@pytest.fixture(scope="module")
def held_server(tiny_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> RunningServer:
    """A tiny-model server that holds a batch for 2 s unless it fills: requests sent together meet in the queue."""
    log_path = tmp_path_factory.mktemp("held-server") / "server.log"
    running = start_server(tiny_repository, log_path, "--max-queue-delay-us", "2000000")
    try:
        yield running
    finally:
        running.stop()


def words(count: int) -> str:
    return " ".join(["house"] * count)


def test_rows_of_several_requests_share_batches_by_length(held_server: RunningServer) -> None:
    client = triton.InferenceServerClient(held_server.target)
    request = [words(60), words(2), words(3)]  # one long row, two short ones
    before = batch_sizes(client, TINY_MODEL)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda _: embed(client, TINY_MODEL, request), range(2)))
    after = batch_sizes(client, TINY_MODEL)
    ran = {size: after.get(size, 0) - before.get(size, 0) for size in after}
    # Both requests' long rows in one batch, their four short rows in another: whole requests would run
    # as batches of 3 or 6.
    assert {size: count for size, count in ran.items() if count} == {2: 1, 4: 1}
    alone = np.concatenate([embed(client, TINY_MODEL, [text]) for text in request])
    for answer in answers:
        assert cosines(answer, alone).min() >= 0.99999
    client.close()


def test_a_request_over_the_token_budget_is_spread_over_batches_by_length(
    tiny_repository: Path, tmp_path: Path
) -> None:
    with start_server(tiny_repository, tmp_path / "server.log", "--max-batch-tokens", "200") as server:
        client = triton.InferenceServerClient(server.target)
        texts = [words(88), words(8), words(78), words(10), words(68), words(6)]  # 90, 10, 80, 12, 70, 8 tokens
        answer = embed(client, TINY_MODEL, texts)
        # Longest first, within 200 padded tokens and no row padded far past its length: (90, 80), (70),
        # then the three short rows together.
        assert batch_sizes(client, TINY_MODEL) == {2: 1, 1: 1, 3: 1}
        alone = np.concatenate([embed(client, TINY_MODEL, [text]) for text in texts])
        assert cosines(answer, alone).min() >= 0.99999
        client.close()
