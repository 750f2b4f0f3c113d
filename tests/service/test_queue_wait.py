"""The queue bound by expected wait (--max-queue-wait-ms): the model's measured rate, and refusals past the bound.

The unit tests give a batcher a measured rate and read its decisions. The server test measures a
real one: the model is a real ONNX graph that takes a fraction of a second for a batch led by the
token id SLOW_ID and microseconds for others, so after one slow batch the engine's measured rate is
a few rows a second, and one row queued ahead is an expected wait far past a bound of 1 ms. The
queue holds rows on purpose (a batching delay of 600 s and a batch of 2 rows: no batch runs until 2
rows wait); the test learns what the server did from /metrics and Triton's statistics. The one speed
assumption: SLOW_TURNS take over 10 ms (a CPU would have to be about 40 times faster to break it).
"""

from __future__ import annotations

import asyncio
import struct
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc

from protocol import grpc_service_pb2 as pb
from protocol import grpc_service_pb2_grpc as pb_grpc
from protocol.retry_hint import RETRY_AFTER_METADATA
from service.core.batcher import Batcher
from service.core.repository import FIDELITY_FILE
from service.core.rows import Share
from service.core.throughput import Throughput
from service.errors import Overloaded
from service.ops.metrics import ModelLabels
from tests.conftest import TINY_MODEL
from tests.onnx_graphs import SLOW_ID, slow_on_demand_model
from tests.servers import start_server, wait_for_queue_depth
from tests.service.test_batcher import OUTPUTS, FakeRunner, policy, queued, tokens
from tests.service.test_scheduling import held_batcher, run_all, send

SLOW_TURNS = 500_000
"""Loop turns of the slow batch: 0.35-0.45 s on this project's 2-core machines (0.7-0.9 us a turn)."""
ANSWER_TIMEOUT_S = 60
"""Bounds the wait for an answer that should come; never what a test asserts."""


def test_the_first_batch_sets_the_rates_and_later_ones_weigh_by_their_time() -> None:
    throughput = Throughput()
    assert (throughput.rows_per_s, throughput.tokens_per_s) == (0.0, 0.0)
    throughput.record(4, 40, 0.0)  # no time measured: nothing learnt
    assert throughput.rows_per_s == 0.0
    throughput.record(4, 40, 0.1)
    assert (throughput.rows_per_s, throughput.tokens_per_s) == pytest.approx((40.0, 400.0))
    throughput.record(4, 40, 1.0)  # a slow batch: averages 0.8 x 4 + 0.2 x 4 rows over 0.8 x 0.1 + 0.2 x 1.0 s
    assert throughput.rows_per_s == pytest.approx(4 / 0.28)


async def test_a_request_whose_expected_wait_passes_the_bound_is_refused_at_its_priority_only() -> None:
    batcher, runner, first = await held_batcher("wait-bound", max_queue_wait_ms=1000)
    batcher._throughput.record(2, 20, 1.0)  # the model's rate: 2 rows, 20 tokens a second
    bulk = [send(batcher, 10 * i, Share(2), rows=2) for i in range(1, 3)]  # 4 rows: 2 s at 2 rows/s
    await queued("wait-bound", 2)
    with pytest.raises(Overloaded) as refused:
        await batcher.submit(tokens([[77]]), OUTPUTS, None, share=Share(2))
    assert "4 rows waiting at priority 2 or higher, an expected wait of 2000 ms at 2 rows/s" in str(refused.value)
    assert "(--max-queue-wait-ms 1000); retry in 1 s" in str(refused.value)  # 4 tokens at 20 a second
    assert (refused.value.reason, refused.value.retry_after_s) == ("queue_full", 1)
    query = send(batcher, 5, Share(1))  # nothing queued at its priority: no wait, admitted
    batches = await run_all(runner, first, [*bulk, query])
    assert batches[0] == [5]


async def test_a_wait_within_the_bound_is_admitted_and_instances_in_service_multiply_the_rate() -> None:
    runners = [FakeRunner(), FakeRunner()]
    for runner in runners:
        runner.release.clear()
    changes = {"max_queue_delay_s": 0, "priority_levels": 2, "max_queue_wait_ms": 1000}
    batcher = Batcher(runners, policy(**changes), ModelLabels("wait-instances", "1"), OUTPUTS)
    batcher.start()
    held = []
    for runner in runners:  # one batch on each instance
        held.append(send(batcher, len(held) + 1, Share(1)))
        await runner.started()
    batcher._throughput.record(2, 2, 1.0)  # 2 rows a second an instance: 4 rows a second with both
    waiting = [send(batcher, 10 * i, Share(1), rows=2) for i in range(1, 3)]
    await queued("wait-instances", 2)
    admitted = send(batcher, 99, Share(1))  # 4 rows ahead at 4 rows/s: 1000 ms, not past the bound
    await queued("wait-instances", 3)
    with pytest.raises(Overloaded, match=r"5 rows waiting at priority 1 or higher, an expected wait of 1250 ms"):
        await batcher.submit(tokens([[77]]), OUTPUTS, None, share=Share(1))
    for runner in runners:
        runner.release.set()
    await asyncio.gather(*held, *waiting, admitted)


async def test_no_rate_measured_no_wait_bound() -> None:
    batcher, runner, first = await held_batcher("wait-unmeasured", max_queue_wait_ms=1)
    waiting = [send(batcher, 10 * i, Share(2), rows=4) for i in range(1, 4)]  # the first batch has not returned
    await queued("wait-unmeasured", 3)
    await run_all(runner, first, waiting)


def rows_request(rows: list[list[int]], priority: int) -> pb.ModelInferRequest:
    """A ModelInfer of rows of token ids of one length (all attended) at `priority`, asking for the embedding."""
    request = pb.ModelInferRequest(model_name=TINY_MODEL)
    values = [value for row in rows for value in row]
    for name, data in (("input_ids", values), ("attention_mask", [1] * len(values))):
        request.inputs.add(name=name, datatype="INT64", shape=[len(rows), len(rows[0])])
        request.raw_input_contents.append(struct.pack(f"<{len(data)}q", *data))
    request.outputs.add(name="embedding")
    request.parameters["priority"].int64_param = priority
    return request


def row_sums(response: pb.ModelInferResponse) -> list[float]:
    """The graph's answer for each row: the sum of its ids."""
    return np.frombuffer(response.raw_output_contents[0], "<f4").reshape(response.outputs[0].shape)[:, 0].tolist()


def post_with_headers(url: str, body: bytes) -> tuple[int, dict[str, str], str]:
    request = urllib.request.Request(url, data=body, headers={"content-type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=ANSWER_TIMEOUT_S) as answer:
            return answer.status, dict(answer.headers.items()), answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, {name.lower(): value for name, value in error.headers.items()}, error.read().decode()


@pytest.mark.parametrize("frontends", [1, 2])
def test_past_the_expected_wait_bulk_is_refused_with_retry_after_and_a_query_still_runs(
    repository_copy: Path, tmp_path: Path, frontends: int
) -> None:
    slow_on_demand_model(repository_copy / TINY_MODEL / "1" / "model.onnx", SLOW_TURNS)
    (repository_copy / TINY_MODEL / FIDELITY_FILE).unlink(missing_ok=True)  # references of the real model
    flags = ("--no-warmup", "--device", "cpu", "--frontends", str(frontends), "--max-queue-wait-ms", "1")
    flags += ("--max-batch-size", "2", "--max-queue-delay-us", "600000000")
    with (
        start_server(repository_copy, tmp_path / "server.log", *flags) as server,
        grpc.insecure_channel(server.target) as channel,
    ):
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        # Nothing measured yet, so no wait bound: two rows fill a batch led by the slow row, and the engine
        # measures a rate of a few rows a second.
        slow = stub.ModelInfer(rows_request([[SLOW_ID, 5], [101, 6]], priority=1), timeout=ANSWER_TIMEOUT_S)
        assert row_sums(slow) == [SLOW_ID + 5, 101 + 6]
        held = stub.ModelInfer.future(rows_request([[101, 7]], priority=2), timeout=ANSWER_TIMEOUT_S)
        wait_for_queue_depth(server, 1, TINY_MODEL)

        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelInfer(rows_request([[101, 8]], priority=2), timeout=ANSWER_TIMEOUT_S)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue full: 1 rows waiting at priority 2 or higher, an expected wait of" in refused.value.details()
        assert "(--max-queue-wait-ms 1); retry in" in refused.value.details()
        retry_after = dict(refused.value.trailing_metadata())[RETRY_AFTER_METADATA]
        assert int(retry_after) >= 1

        status, headers, answer = post_with_headers(f"{server.http_url}/embed", b'{"inputs": "bulk", "priority": 2}')
        assert (status, int(headers["retry-after"]) >= 1) == (429, True), answer
        assert "--max-queue-wait-ms 1" in answer

        # A query has nothing ahead of it at its priority: admitted, and its row fills the batch alone.
        query = stub.ModelInfer(rows_request([[101, 9]], priority=1), timeout=ANSWER_TIMEOUT_S)
        assert row_sums(query) == [101 + 9]
        wait_for_queue_depth(server, 1, TINY_MODEL)  # the bulk row still waits; the refused ones never queued
        statistics = triton_grpc.InferenceServerClient(server.target)
        try:
            figures = statistics.get_inference_statistics(TINY_MODEL, as_json=True)["model_stats"][0]
        finally:
            statistics.close()
        assert (int(figures["execution_count"]), int(figures["inference_count"])) == (2, 3)
        held.cancel()
