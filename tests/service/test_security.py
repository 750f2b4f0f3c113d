"""TLS, mutual TLS, certificate rotation, API keys and the plaintext health port, on real servers.

Certificates are real (trustme); clients are grpc's own channels and tritonclient.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
import trustme
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from tritonclient.utils import InferenceServerException

from protocol import grpc_service_pb2 as pb
from protocol import grpc_service_pb2_grpc as pb_grpc
from service.ops.security import KEY_CHECK_INTERVAL_S
from service.ops.settings import SettingsError, load_settings
from tests.conftest import TINY_MODEL
from tests.pki import Pki
from tests.servers import (
    GRPC_TRANSPORT,
    RunningServer,
    failed_start,
    free_port,
    metric_samples,
    metric_value,
    start_server,
)

KEY = "k-0123456789abcdef"
RELOAD_S = 10
"""How long a replaced certificate may take to reach new handshakes."""


def text_request(text: str = "a secured sentence") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=TINY_MODEL)
    request.inputs.add(name="text", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(struct.pack("<I", len(text)) + text.encode())
    request.outputs.add(name="embedding")
    return request


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


def secure_server(tiny_repository: Path, folder: Path, pki: Pki, *arguments: str) -> tuple[RunningServer, Path, Path]:
    cert, key = folder / "tls.crt", folder / "tls.key"
    pki.write_server_files(cert, key)
    health_port = free_port()
    server = start_server(
        tiny_repository,
        folder / "server.log",
        "--tls-cert",
        str(cert),
        "--tls-key",
        str(key),
        "--health-port",
        str(health_port),
        *arguments,
        health_target=f"127.0.0.1:{health_port}",
    )
    return server, cert, key


@pytest.fixture
def tls_server(tiny_repository: Path, tmp_path: Path, pki: Pki) -> Iterator[tuple[RunningServer, Path, Path]]:
    started = secure_server(tiny_repository, tmp_path, pki)
    try:
        yield started
    finally:
        started[0].stop()


def infer(target: str, credentials: grpc.ChannelCredentials, metadata: tuple = ()) -> pb.ModelInferResponse:
    with grpc.secure_channel(target, credentials) as channel:
        return pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(text_request(), timeout=10, metadata=metadata)


def infer_once_reloaded(target: str, credentials: grpc.ChannelCredentials) -> pb.ModelInferResponse:
    """infer() once the server presents the certificate these credentials trust (within RELOAD_S).

    grpcio reads the files at the next handshake; Envoy re-reads them when they change, a moment later.
    """
    deadline = time.monotonic() + RELOAD_S
    while True:
        try:
            return infer(target, credentials)
        except grpc.RpcError as error:  # a handshake with the old certificate
            assert error.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, error
            time.sleep(0.05)


def test_tls_serves_trusting_clients_and_refuses_plaintext(tls_server, pki: Pki) -> None:
    server, _, _ = tls_server
    assert len(infer(server.target, pki.grpc_credentials()).raw_output_contents[0]) == 4 * 32
    with grpc.insecure_channel(server.target) as channel, pytest.raises(grpc.RpcError) as refused:
        pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(text_request(), timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    stranger = trustme.CA()  # a client that does not trust the server's CA
    with pytest.raises(grpc.RpcError) as untrusted:
        infer(server.target, grpc.ssl_channel_credentials(stranger.cert_pem.bytes()))
    assert untrusted.value.code() == grpc.StatusCode.UNAVAILABLE


def test_tritonclient_over_tls(tls_server, pki: Pki) -> None:
    server, _, _ = tls_server
    client = triton.InferenceServerClient(server.target, ssl=True, root_certificates=str(pki.ca_file))
    try:
        assert client.is_server_ready()
        text = triton.InferInput("text", [2], "BYTES")
        text.set_data_from_numpy(np.array([b"first", b"second"], dtype=object))
        result = client.infer(TINY_MODEL, [text], outputs=[triton.InferRequestedOutput("embedding")])
        assert result.as_numpy("embedding").shape == (2, 32)
    finally:
        client.close()


def test_the_health_port_is_plaintext_and_serves_only_health(tls_server) -> None:
    server, _, _ = tls_server
    with grpc.insecure_channel(server.health_target) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as other:
            pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(text_request(), timeout=5)
    assert other.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_a_rotated_certificate_is_used_for_new_connections_and_open_ones_keep_working(
    tls_server, pki, tmp_path
) -> None:
    server, cert, key = tls_server
    old_channel = grpc.secure_channel(server.target, pki.grpc_credentials())
    try:
        old_stub = pb_grpc.GRPCInferenceServiceStub(old_channel)
        old_stub.ModelInfer(text_request(), timeout=10)
        rotated = Pki(tmp_path / "rotated")  # a new CA, as a renewal with a new issuer would be
        rotated.write_server_files(cert, key)
        assert len(infer_once_reloaded(server.target, rotated.grpc_credentials()).raw_output_contents) == 1
        with pytest.raises(grpc.RpcError) as refused:  # new handshakes present the new certificate only
            infer(server.target, pki.grpc_credentials())
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # a failed handshake, not a timeout
        old_stub.ModelInfer(text_request(), timeout=10)  # the connection made before still works
    finally:
        old_channel.close()
    if GRPC_TRANSPORT == "grpcio":  # Envoy re-reads the files itself (service.launch.envoy), saying nothing
        assert "TLS certificate reloaded" in server.log()


def test_mutual_tls_requires_a_client_certificate_from_the_ca(tiny_repository: Path, tmp_path: Path, pki) -> None:
    server, _, _ = secure_server(tiny_repository, tmp_path, pki, "--tls-client-ca", str(pki.ca_file))
    try:
        assert len(infer(server.target, pki.grpc_credentials(with_client_cert=True)).raw_output_contents) == 1
        with pytest.raises(grpc.RpcError) as refused:
            infer(server.target, pki.grpc_credentials(with_client_cert=False))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        foreign = trustme.CA().issue_cert("intruder@example.com")  # signed by another CA
        credentials = grpc.ssl_channel_credentials(
            pki.ca.cert_pem.bytes(),
            private_key=foreign.private_key_pem.bytes(),
            certificate_chain=foreign.cert_chain_pems[0].bytes(),
        )
        with pytest.raises(grpc.RpcError) as foreign_refused:
            infer(server.target, credentials)
        assert foreign_refused.value.code() == grpc.StatusCode.UNAVAILABLE  # a failed handshake, not a timeout
    finally:
        server.stop()


@pytest.fixture
def keyed_server(tiny_repository: Path, tmp_path: Path) -> Iterator[tuple[RunningServer, Path]]:
    keys = tmp_path / "keys"
    keys.write_text(f"# rotated weekly\n{KEY}\n\nsecond-key\n")
    server = start_server(tiny_repository, tmp_path / "server.log", "--api-key-file", str(keys))
    try:
        yield server, keys
    finally:
        server.stop()


def call(server: RunningServer, method: str, request, metadata: tuple = ()):
    with grpc.insecure_channel(server.target) as channel:
        return getattr(pb_grpc.GRPCInferenceServiceStub(channel), method)(request, timeout=5, metadata=metadata)


@pytest.mark.parametrize(
    ("method", "request_message"),
    [
        ("ModelInfer", text_request()),
        ("ModelMetadata", pb.ModelMetadataRequest(name=TINY_MODEL)),
        ("ModelConfig", pb.ModelConfigRequest(name=TINY_MODEL)),
        ("RepositoryIndex", pb.RepositoryIndexRequest()),
        ("ServerMetadata", pb.ServerMetadataRequest()),
    ],
)
def test_api_keys_guard_every_inference_service_method(keyed_server, method: str, request_message) -> None:
    server, _ = keyed_server
    for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", KEY),)):
        with pytest.raises(grpc.RpcError) as refused:
            call(server, method, request_message, metadata)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "authorization: Bearer <key>" in refused.value.details()
        assert KEY not in refused.value.details()
    for key in (KEY, "second-key"):
        call(server, method, request_message, (("authorization", f"Bearer {key}"),))
    assert KEY not in server.log()


def test_health_and_reflection_stay_open_with_api_keys(keyed_server) -> None:
    server, _ = keyed_server
    with grpc.insecure_channel(server.target) as channel:  # no key on this channel
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        # Reflection lists the services and describes them (grpcurl's `list` and `describe`).
        database = ProtoReflectionDescriptorDatabase(channel)
        assert {"inference.GRPCInferenceService", "grpc.health.v1.Health"} <= set(database.get_services())
        described = descriptor_pool.DescriptorPool(database).FindServiceByName("inference.GRPCInferenceService")
        assert described.FindMethodByName("ModelInfer").input_type.full_name == "inference.ModelInferRequest"
        # On the same channel, the inference service itself still wants the key.
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(text_request(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_tritonclient_sends_the_key_as_a_header(keyed_server) -> None:
    server, _ = keyed_server
    client = triton.InferenceServerClient(server.target)
    try:
        with pytest.raises(InferenceServerException, match=r"UNAUTHENTICATED|API key"):
            client.is_server_ready()
        assert client.is_server_ready(headers={"authorization": f"Bearer {KEY}"})
    finally:
        client.close()


def test_a_rewritten_key_file_takes_effect_without_a_restart(keyed_server) -> None:
    server, keys = keyed_server
    staging = keys.with_suffix(".new")
    staging.write_text("fresh-key\n")
    os.replace(staging, keys)  # as a Kubernetes Secret update swaps the file
    fresh = (("authorization", "Bearer fresh-key"),)
    deadline = time.monotonic() + 10
    while True:
        try:
            call(server, "ServerMetadata", pb.ServerMetadataRequest(), fresh)
            break
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
            assert time.monotonic() < deadline, "the new key was never accepted"
            time.sleep(0.1)
    # Every process re-reads the file on its own (at most once per KEY_CHECK_INTERVAL_S): once that
    # has passed, each new connection, whichever front end the kernel hands it to, has the new key only.
    time.sleep(KEY_CHECK_INTERVAL_S + 0.5)
    for _ in range(6):
        assert call(server, "ServerMetadata", pb.ServerMetadataRequest(), fresh).name
        with pytest.raises(grpc.RpcError) as old:
            call(server, "ServerMetadata", pb.ServerMetadataRequest(), (("authorization", f"Bearer {KEY}"),))
        assert old.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_unauthenticated_calls_are_counted(keyed_server) -> None:
    server, _ = keyed_server
    before = metric_value(metric_samples(server), "encoder_requests_rejected_total", reason="unauthenticated")
    for metadata in ((), (("authorization", "Bearer wrong"),)):
        with pytest.raises(grpc.RpcError) as refused:
            call(server, "ModelInfer", text_request(), metadata)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    after = metric_value(metric_samples(server), "encoder_requests_rejected_total", reason="unauthenticated")
    assert after - before == 2


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--tls-cert", "{cert}"], "tls_cert and tls_key must be given together"),
        (["--tls-client-ca", "{cert}"], "tls_client_ca (mutual TLS) needs tls_cert and tls_key"),
        (["--api-key-file", "/nonexistent/keys"], "api_key_file: /nonexistent/keys is not a readable file"),
    ],
)
def test_incomplete_security_settings_are_refused(tmp_path: Path, arguments: list[str], message: str) -> None:
    cert = tmp_path / "cert.pem"
    cert.write_text("-----BEGIN CERTIFICATE-----\n")
    with pytest.raises(SettingsError) as refused:
        load_settings([argument.format(cert=cert) for argument in arguments], environ={})
    assert str(refused.value) == message


def test_security_settings_come_from_the_environment(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("k\n")
    settings = load_settings([], environ={"ENCODER_API_KEY_FILE": str(keys), "ENCODER_HEALTH_PORT": "8003"})
    assert settings.api_key_file == str(keys)
    assert settings.health_port == 8003


def _unusable_files(folder: Path, pki: Pki, kind: str) -> list[str]:
    """Arguments naming security files the server cannot use, written into folder."""
    cert, key = folder / "tls.crt", folder / "tls.key"
    pki.write_server_files(cert, key)
    if kind == "key of another certificate":
        pki.client_cert.private_key_pem.write_to_path(str(key))
    elif kind == "certificate not PEM":
        cert.write_bytes(b"not a certificate")
    else:
        keys = folder / "keys"
        keys.write_text("# every key was revoked\n\n")
        return ["--api-key-file", str(keys)]
    return ["--tls-cert", str(cert), "--tls-key", str(key)]


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("key of another certificate", "cannot be used: key values mismatch"),
        ("certificate not PEM", "must be PEM files"),
        ("key file of comments only", "holds no key"),
    ],
)
def test_unusable_security_files_stop_the_server_with_one_line_and_exit_2(
    tiny_repository: Path, tmp_path: Path, pki: Pki, kind: str, message: str
) -> None:
    finished = failed_start(tiny_repository, *_unusable_files(tmp_path, pki, kind))
    assert finished.returncode == 2, finished.stderr
    assert "Traceback" not in finished.stderr, finished.stderr
    errors = [line for line in finished.stderr.splitlines() if line.startswith("service: error:")]
    assert len(errors) == 1 and message in errors[0], finished.stderr
