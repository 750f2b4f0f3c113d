"""Two tenants of one priority, weights 3 and 1, both queued, through a real server: rows 3:1, bulk still runs.

The server holds its queue on purpose: a batch of 8 rows and a batching delay of 600 s, so no
batch starts until 8 rows wait, and batches stop again once fewer than 8 do. The model is a real
ONNX graph with the tiny model's signature and tokenizer that runs a batch led by the token id
SLOW_ID for seconds, any other in microseconds. Each test holds the engine with such a batch (the
holder tenant's 8 rows), queues behind it 33 one-text requests of `heavy` (weight 3) and 12 of
`light` (weight 1) at priority 1, and one of `bulk` at priority 2, then waits for the slow batch
to return: batches run back to back while 8 rows wait, and stop with 5 left.

What runs is exact, so the test asserts it exactly. Within a level the scheduler is start-time
fair queuing on rows: both tenants start at the level's virtual time, heavy's k-th row tagged k/3
later, light's j-th j later; every text is the same, so a batch takes the 8 rows with the
earliest tags: those of the window [2m, 2m + 2), 6 of heavy's and 2 of light's (the rows tagged
2m + 2, one of each, go to the next batch together; the tags' rounding is far below their 1/3
steps). The bulk row is passed over by three batches (--min-lower-priority-share 0.25: one batch
in four) and leads the fourth alone (the express lane may run the next batch of priority 1 beside
it, which changes no batch's rows). Two more batches, and the 5 of priority 1 ran 40 rows, heavy
30 and light 10, while heavy 3 and light 2 are still queued. The test reads this from the
server's counters (encoder_rows_run_total, encoder_queue_rows) and Triton's statistics, never
from a clock, then fills a last batch with 3 more heavy rows so every request is answered.

Over gRPC unary (tritonclient) and ModelStreamInfer streams, each tenant over two connections;
over two front ends in the Makefile's ENCODER_FRONTENDS=2 pass (the engine decides). The one speed assumption: the
test queues its 46 requests while the slow batch runs (seconds); a machine too slow for that
fails the wait for 46 queued requests, and never passes wrongly.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc

from protocol import grpc_service_pb2 as pb
from protocol import grpc_service_pb2_grpc as pb_grpc
from service.core.repository import FIDELITY_FILE
from service.core.rows import Share
from tests.conftest import TINY_MODEL
from tests.onnx_graphs import SLOW_ID, TURNS, slow_on_demand_model
from tests.servers import (
    MetricSamples,
    RunningServer,
    metric_samples,
    metric_value,
    start_server,
    wait_for_queue_depth,
    wait_until,
)
from tests.service.test_batcher import OUTPUTS, FakeRunner, make_batcher, metric, tokens
from tests.service.test_priorities import stream_request
from tests.service.test_queue_wait import rows_request

PROTOCOLS = ("unary", "stream")
TENANTS = "\n".join(
    [
        '[tenants.holder]\nkeys = ["holder-key"]\n',
        '[tenants.bulk]\nkeys = ["bulk-key"]\npriority = 2\n',
        *(f'[tenants.heavy-{name}]\nkeys = ["heavy-{name}-key"]\nweight = 3\n' for name in PROTOCOLS),
        *(f'[tenants.light-{name}]\nkeys = ["light-{name}-key"]\n' for name in PROTOCOLS),
    ]
)
BATCH_ROWS = 8
HEAVY_ROWS, LIGHT_ROWS = 33, 12
TEXT = "a fair share"
"""Every queued text: rows of one length, so a batch takes them in their turns' order."""
CONNECTIONS = 2
"""Connections each tenant sends over, its requests taking turns: the kernel spreads connections over front ends."""
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
"""Channels to one target otherwise share one connection (gRPC's global subchannel pool)."""
ANSWER_TIMEOUT_S = 60
"""Bounds the wait for an answer that should come; never what a test asserts."""


def headers(tenant: str) -> dict[str, str]:
    """The request headers (gRPC metadata) of a tenant of TENANTS."""
    return {"authorization": f"Bearer {tenant}-key"}


@pytest.fixture(scope="module")
def server(tiny_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    folder = tmp_path_factory.mktemp("fair-share")
    repository = folder / "repository"
    shutil.copytree(tiny_repository, repository)
    model = repository / TINY_MODEL
    slow_on_demand_model(model / "1" / "model.onnx", TURNS)
    (model / FIDELITY_FILE).unlink(missing_ok=True)  # references of the real model
    (folder / "tenants.toml").write_text(TENANTS)
    arguments = ("--no-warmup", "--device", "cpu", "--api-key-file", str(folder / "tenants.toml"))
    arguments += ("--max-batch-size", str(BATCH_ROWS), "--max-queue-delay-us", "600000000")
    arguments += ("--min-lower-priority-share", "0.25")
    running = start_server(repository, folder / "server.log", *arguments)
    try:
        yield running
    finally:
        running.stop()


def executions(server: RunningServer) -> int:
    """Triton's execution_count of the model: the batches it ran (tritonclient's ModelStatistics)."""
    client = triton_grpc.InferenceServerClient(server.target)
    try:
        figures = client.get_inference_statistics(TINY_MODEL, headers=headers("holder"), as_json=True)
    finally:
        client.close()
    return int(figures["model_stats"][0].get("execution_count", 0))


def rows_run(samples: MetricSamples, priority: int, tenant: str) -> float:
    labels = {"model": TINY_MODEL, "version": "1", "priority": str(priority), "tenant": tenant}
    return metric_value(samples, "encoder_rows_run_total", **labels)


def queued_rows(samples: MetricSamples, tenant: str) -> float:
    labels = {"model": TINY_MODEL, "version": "1", "priority": "1", "tenant": tenant}
    return metric_value(samples, "encoder_queue_rows", **labels)


def hold_engine(server: RunningServer, stub: pb_grpc.GRPCInferenceServiceStub) -> list[grpc.Future]:
    """Start the holder's slow batch (8 rows led by SLOW_ID) and return once it runs."""
    slow = [[SLOW_ID, 5], *([101, 6 + row] for row in range(BATCH_ROWS - 2))]
    metadata = tuple(headers("holder").items())
    held = [stub.ModelInfer.future(rows_request(slow, priority=1), metadata=metadata, timeout=ANSWER_TIMEOUT_S)]
    wait_for_queue_depth(server, 1, TINY_MODEL)  # 7 rows: held by the batching delay
    last = rows_request([[101, 99]], priority=1)  # the 8th row: the batch, led by the slow row, starts
    held.append(stub.ModelInfer.future(last, metadata=metadata, timeout=ANSWER_TIMEOUT_S))
    wait_for_queue_depth(server, 0, TINY_MODEL)
    return held


def assert_the_engine_was_shared_3_to_1(
    server: RunningServer, protocol: str, before: MetricSamples, batches_before: int
) -> None:
    """Once the slow batch returned and the batches stopped: what ran and what is left (see the module's docstring).

    Triton's execution_count is the last figure a batch records: once it counts the 7 batches
    (the slow one, 5 of priority 1, the bulk row's), their rows are in every other figure.
    """
    wait_until(lambda: executions(server) == batches_before + 7, "7 batches run")
    after = metric_samples(server)
    heavy, light = f"heavy-{protocol}", f"light-{protocol}"
    ran = {tenant: rows_run(after, 1, tenant) - rows_run(before, 1, tenant) for tenant in (heavy, light, "holder")}
    assert ran == {heavy: 30, light: 10, "holder": BATCH_ROWS}
    assert (queued_rows(after, heavy), queued_rows(after, light)) == (3, 2)  # both were queued throughout
    assert metric_value(after, "encoder_queue_depth", model=TINY_MODEL, version="1") == 5
    assert rows_run(after, 2, "bulk") - rows_run(before, 2, "bulk") == 1  # the lower priority ran meanwhile


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_two_tenants_weighted_3_to_1_get_rows_3_to_1_and_a_lower_priority_still_runs(
    server: RunningServer, protocol: str
) -> None:
    heavy, light = f"heavy-{protocol}", f"light-{protocol}"
    before = metric_samples(server)
    batches_before = executions(server)
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        held = hold_engine(server, stub)
        bulk_metadata = tuple(headers("bulk").items())
        bulk = stub.ModelInfer.future(stream_request(TEXT), metadata=bulk_metadata, timeout=ANSWER_TIMEOUT_S)
        send, answered = (send_unary if protocol == "unary" else send_streamed)(server, (heavy, light))
        for row in range(HEAVY_ROWS):
            send(heavy)
            if row < LIGHT_ROWS:
                send(light)
        wait_for_queue_depth(server, HEAVY_ROWS + LIGHT_ROWS + 1, TINY_MODEL)  # queued while the slow batch ran

        assert_the_engine_was_shared_3_to_1(server, protocol, before, batches_before)
        assert bulk.result(timeout=ANSWER_TIMEOUT_S).model_name == TINY_MODEL  # answered while queries still wait

        for _ in range(BATCH_ROWS - 5):  # fill the last batch: every request is answered
            send(heavy)
        assert sorted(answered()) == sorted([heavy] * (HEAVY_ROWS + 3) + [light] * LIGHT_ROWS)
        for future in held:
            assert future.result(timeout=ANSWER_TIMEOUT_S).model_name == TINY_MODEL
    wait_for_queue_depth(server, 0, TINY_MODEL)


Sender = Callable[[str], None]
Collector = Callable[[], list[str]]


def text_input() -> list[triton_grpc.InferInput]:
    tensor = triton_grpc.InferInput("text", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([TEXT.encode()], dtype=object))
    return [tensor]


def send_unary(server: RunningServer, tenants: tuple[str, ...]) -> tuple[Sender, Collector]:
    """One-text requests from tritonclient's async_infer; the tenants whose answers came, once all came."""
    clients = {
        tenant: [
            triton_grpc.InferenceServerClient(server.target, channel_args=OWN_CONNECTION) for _ in range(CONNECTIONS)
        ]
        for tenant in tenants
    }
    turns = {tenant: itertools.cycle(connections) for tenant, connections in clients.items()}
    done: queue.Queue[tuple[str, object]] = queue.Queue()
    sent = []

    def send(tenant: str) -> None:
        sent.append(tenant)
        next(turns[tenant]).async_infer(
            TINY_MODEL, text_input(), lambda result, error: done.put((tenant, error)), headers=headers(tenant)
        )

    def answered() -> list[str]:
        try:
            answers = [done.get(timeout=ANSWER_TIMEOUT_S) for _ in sent]
        finally:
            for client in itertools.chain(*clients.values()):
                client.close()
        assert [error for _, error in answers if error is not None] == []
        return [tenant for tenant, _ in answers]

    return send, answered


@dataclass
class Stream:
    """A tenant's ModelStreamInfer stream, on a connection of its own."""

    tenant: str
    channel: grpc.Channel
    outgoing: queue.Queue[pb.ModelInferRequest | None]
    answers: Iterator[pb.ModelStreamInferResponse]
    sent: int = 0


def send_streamed(server: RunningServer, tenants: tuple[str, ...]) -> tuple[Sender, Collector]:
    """One-text requests over ModelStreamInfer streams; the tenants whose answers came, once all came."""
    streams = []
    for tenant in tenants:
        for _ in range(CONNECTIONS):
            channel = grpc.insecure_channel(server.target, OWN_CONNECTION)
            outgoing: queue.Queue[pb.ModelInferRequest | None] = queue.Queue()
            metadata = tuple(headers(tenant).items())
            answers = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
                iter(outgoing.get, None), metadata=metadata
            )
            streams.append(Stream(tenant, channel, outgoing, answers))
    turns = {tenant: itertools.cycle([stream for stream in streams if stream.tenant == tenant]) for tenant in tenants}

    def send(tenant: str) -> None:
        stream = next(turns[tenant])
        stream.outgoing.put(stream_request(TEXT, request_id=str(stream.sent)))
        stream.sent += 1

    def answered() -> list[str]:
        tenants_answered = []
        try:
            for stream in streams:
                answers = [next(stream.answers) for _ in range(stream.sent)]
                assert [answer.error_message for answer in answers if answer.error_message] == []
                assert sorted(int(answer.infer_response.id) for answer in answers) == list(range(stream.sent))
                tenants_answered += [stream.tenant] * len(answers)
                stream.outgoing.put(None)
        finally:
            for stream in streams:
                stream.channel.close()
        return tenants_answered

    return send, answered


async def test_rows_run_are_counted_by_priority_and_tenant_and_sum_to_the_sequences() -> None:
    batcher = await make_batcher("rows-run", [FakeRunner()], priority_levels=2)
    await asyncio.gather(
        batcher.submit(tokens([[1], [2], [3]]), OUTPUTS, None, share=Share(1, "a", 3.0)),
        batcher.submit(tokens([[4, 4]]), OUTPUTS, None, share=Share(2, "b")),
        batcher.submit(tokens([[5]]), OUTPUTS, None),
    )
    counted = {
        (priority, tenant): metric("encoder_rows_run_total", "rows-run", priority=priority, tenant=tenant)
        for priority, tenant in (("1", "a"), ("2", "b"), ("1", ""))
    }
    assert counted == {("1", "a"): 3, ("2", "b"): 1, ("1", ""): 1}
    assert metric("encoder_sequences_total", "rows-run") == 5
