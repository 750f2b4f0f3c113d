"""TLS, mutual TLS, certificate rotation and API keys on the HTTP port: the gRPC port's settings, one set of files.

Certificates are real (trustme); the clients are the `openai` SDK, tritonclient.http and Python's own ssl.
"""

from __future__ import annotations

import http.client
import json
import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx2
import openai
import pytest
import trustme

from tests.conftest import TINY_MODEL
from tests.pki import Pki
from tests.servers import RunningServer, free_port, metric_samples, metric_value, start_server

KEY = "k-http-0123456789"
CLIENT_TIMEOUT_S = 30
"""Bounds each SDK call: a refusal comes at once, and a server that hangs fails the test as a timeout."""


def tls_server(repository: Path, folder: Path, pki: Pki, *arguments: str) -> RunningServer:
    cert, key = folder / "tls.crt", folder / "tls.key"
    pki.write_server_files(cert, key)
    health_port = free_port()
    return start_server(
        repository,
        folder / "server.log",
        "--tls-cert", str(cert),
        "--tls-key", str(key),
        "--health-port", str(health_port),
        *arguments,
        health_target=f"127.0.0.1:{health_port}",
    )  # fmt: skip


def sdk(server: RunningServer, context: ssl.SSLContext | None = None, api_key: str = "unused") -> openai.OpenAI:
    scheme = "https" if context is not None else "http"
    return openai.OpenAI(
        base_url=f"{scheme}://127.0.0.1:{server.http_port}/v1",
        api_key=api_key,
        max_retries=0,
        timeout=CLIENT_TIMEOUT_S,
        http_client=httpx2.Client(verify=context) if context is not None else None,
    )


def embed(client: openai.OpenAI) -> int:
    """One embedding's width, on a connection closed afterwards (an idle TLS connection would hold the drain)."""
    with client:
        return len(client.embeddings.create(model=TINY_MODEL, input="a secured sentence").data[0].embedding)


def cannot_connect(client: openai.OpenAI) -> openai.APIConnectionError:
    """The SDK's error for an embedding call refused at the connection (a TLS handshake or the protocol).

    APITimeoutError is an APIConnectionError too: a server that never answered must not pass for one that
    refused, so a timeout fails here (the client's timeout is short, so such a failure is quick).
    """
    with pytest.raises(openai.APIConnectionError) as refused:
        embed(client)
    assert not isinstance(refused.value, openai.APITimeoutError), f"timed out instead of refused: {refused.value!r}"
    return refused.value


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path / "pki")


def test_tls_serves_trusting_clients_and_refuses_others(tiny_repository: Path, tmp_path: Path, pki: Pki) -> None:
    with tls_server(tiny_repository, tmp_path, pki) as server:
        assert embed(sdk(server, pki.ssl_context())) == 32
        cannot_connect(sdk(server, ssl.create_default_context(cadata=trustme.CA().cert_pem.bytes().decode())))
        cannot_connect(sdk(server))  # plaintext to a TLS port
        assert " ERROR " not in server.log()


def test_a_rotated_certificate_is_used_for_new_connections(tiny_repository: Path, tmp_path: Path, pki: Pki) -> None:
    with tls_server(tiny_repository, tmp_path, pki) as server:
        kept = http.client.HTTPSConnection("127.0.0.1", server.http_port, context=pki.ssl_context(), timeout=30)
        try:
            kept.request("GET", "/v2/health/ready")
            assert kept.getresponse().read() == b""
            rotated = Pki(tmp_path / "rotated")  # a new CA, as a renewal with a new issuer would be
            rotated.write_server_files(tmp_path / "tls.crt", tmp_path / "tls.key")
            assert embed(sdk(server, rotated.ssl_context())) == 32
            cannot_connect(sdk(server, pki.ssl_context()))  # new handshakes present the new certificate only
            # The connection opened before the rotation keeps what it negotiated.
            kept.request("GET", "/v2/health/ready")
            assert kept.getresponse().status == 200
        finally:
            kept.close()


def test_mutual_tls_needs_a_client_certificate(tiny_repository: Path, tmp_path: Path, pki: Pki) -> None:
    with tls_server(tiny_repository, tmp_path, pki, "--tls-client-ca", str(pki.ca_file)) as server:
        assert embed(sdk(server, pki.ssl_context(with_client_cert=True))) == 32
        cannot_connect(sdk(server, pki.ssl_context()))  # no client certificate


@pytest.fixture(scope="module")
def keyed_server(tiny_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    folder = tmp_path_factory.mktemp("keyed")
    keys = folder / "keys"
    keys.write_text(f"# one key\n{KEY}\n")
    with start_server(tiny_repository, folder / "server.log", "--api-key-file", str(keys)) as server:
        yield server


def test_api_keys_guard_both_apis_and_leave_the_health_endpoints_open(keyed_server: RunningServer) -> None:
    before = metric_value(metric_samples(keyed_server), "encoder_requests_rejected_total", reason="unauthenticated")
    assert embed(sdk(keyed_server, api_key=KEY)) == 32
    with pytest.raises(openai.AuthenticationError, match="missing or unknown API key") as refused:
        embed(sdk(keyed_server, api_key="wrong"))
    assert refused.value.body["type"] == "authentication_error"
    assert refused.value.response.headers["www-authenticate"] == "Bearer"

    def get(path: str, **headers: str) -> tuple[int, bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", keyed_server.http_port, timeout=30)
        try:
            connection.request("GET", path, headers=headers)
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    status, content = get(f"/v2/models/{TINY_MODEL}")
    assert status == 401 and "Authorization: Bearer" in json.loads(content)["error"]
    assert get(f"/v2/models/{TINY_MODEL}", Authorization=f"Bearer {KEY}")[0] == 200
    assert get("/v1/models")[0] == 401
    assert get("/v2/health/live")[0] == 200
    assert get("/v2/health/ready")[0] == 200
    after = metric_value(metric_samples(keyed_server), "encoder_requests_rejected_total", reason="unauthenticated")
    assert after == before + 3
