"""Batches of rows, end to end: a request's rows come back in its order, rows of several requests share batches.

What the batcher did is read from the server's own ModelStatistics (batch_stats: executions per
batch size), never from timing; which rows meet in a batch is decided by what is sent (batches that
run when they fill), never by how quickly it arrives.
"""

from __future__ import annotations

import concurrent.futures
import time
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


BATCH_ROWS = 6
"""The held server's rows per batch: the two requests' six rows fill one, so it runs when the second arrives."""
HOLD_US = 600_000_000
"""The held server's batching delay: a batch that does not fill waits this long, i.e. for the rows the test sends."""
WAIT_S = 60.0
"""Bounds the wait for a batch that should run; never what is asserted."""


@pytest.fixture(scope="module")
def held_server(tiny_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> RunningServer:
    """A tiny-model server whose batches run only when they fill (BATCH_ROWS rows): requests meet in the queue.

    What the test sends decides each batch, not how fast it gets there: a batch waits for its rows, not for a
    delay that a slow machine could outlast.
    """
    log_path = tmp_path_factory.mktemp("held-server") / "server.log"
    flags = ("--max-batch-size", str(BATCH_ROWS), "--max-queue-delay-us", str(HOLD_US))
    running = start_server(tiny_repository, log_path, *flags)
    try:
        yield running
    finally:
        running.stop()


def words(count: int) -> str:
    return " ".join(["house"] * count)


def batches_ran(client: triton.InferenceServerClient, before: dict[int, int]) -> dict[int, int]:
    """Executions per batch size since `before`, sizes that ran only."""
    after = batch_sizes(client, TINY_MODEL)
    ran = {size: after.get(size, 0) - before.get(size, 0) for size in after}
    return {size: count for size, count in ran.items() if count}


def test_rows_of_several_requests_share_batches_by_length(held_server: RunningServer) -> None:
    client = triton.InferenceServerClient(held_server.target)
    request = [words(60), words(2), words(3)]  # one long row, two short ones
    later = [words(2), words(3)]  # two more short rows, sent once the long rows have run
    before = batch_sizes(client, TINY_MODEL)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        answers = [pool.submit(embed, client, TINY_MODEL, request) for _ in range(2)]
        # The second request's rows fill a batch (six waiting): it starts from the oldest request's long row
        # and takes the rows nearest its length that may be padded to it, i.e. the other long row only.
        deadline = time.monotonic() + WAIT_S
        while not (ran := batches_ran(client, before)):
            assert time.monotonic() < deadline, "the two requests' rows never ran"
            time.sleep(0.05)
        # Whole requests would have run as one batch of 6 (or of 3), rows in arrival order as 6 too.
        assert ran == {2: 1}, ran
        assert not any(answer.done() for answer in answers)  # their four short rows wait for a full batch
        # Two more short rows fill it: the four waiting ones and these two run together.
        answers.append(pool.submit(embed, client, TINY_MODEL, later))
        results = [answer.result(timeout=WAIT_S) for answer in answers]
    assert batches_ran(client, before) == {2: 1, 6: 1}
    # Each text in a batch of its own: as many copies as fill one, so none waits and none is padded.
    alone = {text: embed(client, TINY_MODEL, [text] * BATCH_ROWS)[:1] for text in request}
    for texts, answer in zip([request, request, later], results, strict=True):
        assert cosines(answer, np.concatenate([alone[text] for text in texts])).min() >= 0.99999
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
