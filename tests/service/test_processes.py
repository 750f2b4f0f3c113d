"""A server of several processes: roles in `ps`, rows of every front end batched together, one /metrics,
and a process that dies never leaving a half-working server.

What each process did is read as the kernel shows it: its command line (its title) and the
statistics table it has mapped (/proc/PID/maps), never a log.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import tritonclient.grpc as triton
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protocol import grpc_service_pb2 as pb
from protocol import grpc_service_pb2_grpc as pb_grpc
from service.launch.processes import children
from service.ops.statistics import TABLE_SUFFIX, table_snapshot
from tests.conftest import TINY_MODEL
from tests.servers import RunningServer, health_status, metric_samples, metric_value, start_server

FRONTENDS = 2
CONNECTIONS = 16
"""Separate connections, spread over the front ends by the kernel (SO_REUSEPORT): all on one is 2 in 2^16."""
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
"""Channels to one target otherwise share one connection (gRPC's global subchannel pool)."""
EXIT_TIMEOUT_S = 60
"""Bounds the wait for an exit that should come; a server that hangs fails the test instead of blocking it."""


def title(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_text().split("\0")[0]


def roles(server: RunningServer) -> dict[str, int]:
    """Each of the server's processes by the role in its title (`encoder-serve: frontend 1` -> `frontend 1`)."""
    pids = [server.process.pid, *children(server.process.pid)]
    return {title(pid).removeprefix("encoder-serve: "): pid for pid in pids}


def answered_by(pid: int) -> int:
    """Requests a process answered: the success count of the statistics table it has mapped."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        path = line.split()[-1]
        if path.endswith(TABLE_SUFFIX):
            return table_snapshot(Path(path)).success.count
    return 0


def text_request(text: str) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=TINY_MODEL)
    request.inputs.add(name="text", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(struct.pack("<I", len(text.encode())) + text.encode())
    return request


@pytest.fixture(scope="module")
def held_server(tiny_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """Two front ends; a batch waits up to 5 s to fill its 16 rows, so requests sent together meet."""
    flags = ("--frontends", str(FRONTENDS), "--max-queue-delay-us", "5000000", "--max-batch-size", str(CONNECTIONS))
    server = start_server(tiny_repository, tmp_path_factory.mktemp("processes") / "server.log", *flags)
    try:
        yield server
    finally:
        server.stop()


def test_each_process_names_its_role(held_server: RunningServer) -> None:
    assert sorted(roles(held_server)) == ["engine", "frontend 1", "frontend 2", "supervisor"]


def test_rows_sent_to_different_front_ends_end_up_in_one_batch(held_server: RunningServer) -> None:
    by_role = roles(held_server)
    before = {role: answered_by(pid) for role, pid in by_role.items() if role.startswith("frontend")}
    client = triton.InferenceServerClient(held_server.target)
    (statistics,) = client.get_inference_statistics(TINY_MODEL).model_stats
    batches_before = {batch.batch_size: batch.compute_infer.count for batch in statistics.batch_stats}
    channels = [grpc.insecure_channel(held_server.target, OWN_CONNECTION) for _ in range(CONNECTIONS)]
    try:
        stubs = [pb_grpc.GRPCInferenceServiceStub(channel) for channel in channels]
        with concurrent.futures.ThreadPoolExecutor(CONNECTIONS) as pool:
            answers = list(pool.map(lambda stub: stub.ModelInfer(text_request("one row"), timeout=60), stubs))
    finally:
        for channel in channels:
            channel.close()
    assert len(answers) == CONNECTIONS
    after = {role: answered_by(pid) for role, pid in by_role.items() if role.startswith("frontend")}
    served = {role: after[role] - before[role] for role in after}
    assert all(count > 0 for count in served.values()), served  # both front ends took requests
    assert sum(served.values()) == CONNECTIONS
    (statistics,) = client.get_inference_statistics(TINY_MODEL).model_stats
    batches = {batch.batch_size: batch.compute_infer.count for batch in statistics.batch_stats}
    assert batches.get(CONNECTIONS, 0) - batches_before.get(CONNECTIONS, 0) == 1  # every row in one batch
    client.close()


def test_metrics_and_statistics_add_up_over_every_process(held_server: RunningServer) -> None:
    samples = metric_samples(held_server)
    labels = {"model": TINY_MODEL, "version": "1"}
    before = metric_value(samples, "encoder_requests_total", code="OK", **labels)
    channels = [grpc.insecure_channel(held_server.target, OWN_CONNECTION) for _ in range(CONNECTIONS)]
    try:
        with concurrent.futures.ThreadPoolExecutor(CONNECTIONS) as pool:
            list(
                pool.map(
                    lambda channel: pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(text_request("x"), timeout=60),
                    channels,
                )
            )
    finally:
        for channel in channels:
            channel.close()
    samples = metric_samples(held_server)
    assert metric_value(samples, "encoder_requests_total", code="OK", **labels) == before + CONNECTIONS
    client = triton.InferenceServerClient(held_server.target)
    (statistics,) = client.get_inference_statistics(TINY_MODEL).model_stats
    client.close()
    assert statistics.inference_stats.success.count == metric_value(
        samples, "encoder_requests_total", code="OK", **labels
    )
    assert metric_value(samples, "encoder_model_ready", **labels) == 1
    assert metric_value(samples, "encoder_inflight_requests", **labels) == 0


def wait_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    for pid in pids:
        while _running(pid):
            assert time.monotonic() < deadline, f"process {pid} ({title(pid)}) still runs"
            time.sleep(0.05)


def _running(pid: int) -> bool:
    """Whether the process exists and is not a zombie (it may vanish between two reads of /proc)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.parametrize("role", ["engine", "frontend 2"])
def test_a_process_that_dies_stops_the_whole_server_non_zero(tiny_repository: Path, tmp_path: Path, role: str) -> None:
    with (
        start_server(tiny_repository, tmp_path / "server.log", "--frontends", str(FRONTENDS)) as server,
        grpc.insecure_channel(server.target) as channel,
    ):
        by_role = roles(server)
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=EXIT_TIMEOUT_S)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        os.kill(by_role[role], signal.SIGKILL)
        # A front end that outlives its engine (or its sibling) tells its watchers at once, then stops.
        try:
            status = next(watch).status
        except grpc.RpcError as error:  # the watch ran on the front end that was killed
            assert role != "engine" and error.code() == grpc.StatusCode.UNAVAILABLE
        else:
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()
        assert server.process.wait(timeout=EXIT_TIMEOUT_S) == 1
        wait_gone(list(by_role.values()))
        assert health_status(server.target, timeout_s=2) is None  # nothing answers on the port any more
    assert f"{role} exited with status -9: stopping the server" in server.log()


def test_a_rewritten_key_file_reaches_every_front_end(tiny_repository: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("old-key\n")
    flags = ("--frontends", str(FRONTENDS), "--api-key-file", str(keys))
    with start_server(tiny_repository, tmp_path / "server.log", *flags) as server:
        by_role = roles(server)
        staging = keys.with_suffix(".new")
        staging.write_text("new-key\n")
        os.replace(staging, keys)
        before = {role: answered_by(pid) for role, pid in by_role.items() if role.startswith("frontend")}
        channels = [grpc.insecure_channel(server.target, OWN_CONNECTION) for _ in range(CONNECTIONS)]
        try:
            for channel in channels:
                stub = pb_grpc.GRPCInferenceServiceStub(channel)
                accepted_new = refused_old = False
                deadline = time.monotonic() + EXIT_TIMEOUT_S
                while not (accepted_new and refused_old):
                    assert time.monotonic() < deadline, "a front end never took up the new key file"
                    try:
                        stub.ModelInfer(text_request("x"), timeout=10, metadata=(("authorization", "Bearer new-key"),))
                        accepted_new = True
                        stub.ModelInfer(text_request("x"), timeout=10, metadata=(("authorization", "Bearer old-key"),))
                    except grpc.RpcError as error:
                        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
                        refused_old = accepted_new
                        time.sleep(0.05)
        finally:
            for channel in channels:
                channel.close()
        after = {role: answered_by(pid) for role, pid in by_role.items() if role.startswith("frontend")}
        assert all(after[role] > before[role] for role in after), (before, after)  # each front end was asked


def test_children_die_with_the_supervisor(tiny_repository: Path, tmp_path: Path) -> None:
    with start_server(tiny_repository, tmp_path / "server.log", "--frontends", str(FRONTENDS)) as server:
        by_role = roles(server)
        os.kill(by_role["supervisor"], signal.SIGKILL)
        server.process.wait(timeout=EXIT_TIMEOUT_S)
        wait_gone([pid for role, pid in by_role.items() if role != "supervisor"])


def test_only_the_engine_maps_onnx_runtime(held_server: RunningServer) -> None:
    mapped = {role: "onnxruntime" in Path(f"/proc/{pid}/maps").read_text() for role, pid in roles(held_server).items()}
    assert mapped == {"supervisor": False, "engine": True, "frontend 1": False, "frontend 2": False}
