"""Fixtures of the client tests: a deliberately slow server, and servers behind TLS, mutual TLS and API keys."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme
from prometheus_client.parser import text_string_to_metric_families

from client.protocol import ClientSecurity
from tests.servers import RunningServer, free_port, start_server

API_KEY = "client-test-key-5f2c"


@pytest.fixture(scope="session")
def slow_server(tiny_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> RunningServer:
    """The tiny model behind a queue of one request that waits 1 s for a fuller batch.

    A lone request answers after about 1 s (so a short deadline expires); a second one arriving
    meanwhile is rejected with RESOURCE_EXHAUSTED.
    """
    log_path = tmp_path_factory.mktemp("slow-server") / "server.log"
    server = start_server(tiny_repository, log_path, "--max-queue-size", "1", "--max-queue-delay-us", "1000000")
    yield server
    server.stop()


def requests_answered(server: RunningServer) -> float:
    """encoder_requests_total summed over every label: inference requests the server answered."""
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "encoder_requests_total"
    )


@dataclass(frozen=True)
class Pki:
    """PEM files: a CA, a server certificate for 127.0.0.1 and localhost, a client certificate, and an
    unrelated CA's client certificate (which a mutual-TLS server must refuse)."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path
    rogue_key: Path
    api_key_file: Path

    def security(self, *, client_cert: bool = False, api_key: bool = False) -> ClientSecurity:
        """Client settings trusting this CA, with the client certificate and the API key if asked."""
        return ClientSecurity.from_files(
            ca_file=self.ca,
            cert_file=self.client_cert if client_cert else None,
            key_file=self.client_key if client_cert else None,
            api_key_file=self.api_key_file if api_key else None,
        )


def _write(path: Path, blobs: list[trustme.Blob]) -> Path:
    path.write_bytes(b"".join(blob.bytes() for blob in blobs))
    return path


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    folder = tmp_path_factory.mktemp("client-pki")
    ca, rogue = trustme.CA(), trustme.CA()
    server, client = ca.issue_cert("127.0.0.1", "localhost"), ca.issue_cert("client@example.com")
    stranger = rogue.issue_cert("client@example.com")
    key_file = folder / "api-keys"
    key_file.write_text(f"# the first key is the client's\n{API_KEY}\nsome-other-key\n")
    return Pki(
        ca=_write(folder / "ca.pem", [ca.cert_pem]),
        server_cert=_write(folder / "server.pem", server.cert_chain_pems),
        server_key=_write(folder / "server.key", [server.private_key_pem]),
        client_cert=_write(folder / "client.pem", client.cert_chain_pems),
        client_key=_write(folder / "client.key", [client.private_key_pem]),
        rogue_cert=_write(folder / "rogue.pem", stranger.cert_chain_pems),
        rogue_key=_write(folder / "rogue.key", [stranger.private_key_pem]),
        api_key_file=key_file,
    )


def _secure_server(tiny_repository: Path, pki: Pki, log_path: Path, *arguments: str) -> RunningServer:
    health_port = free_port()
    return start_server(
        tiny_repository,
        log_path,
        *("--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)),
        *("--health-port", str(health_port)),
        *arguments,
        health_target=f"127.0.0.1:{health_port}",
    )


@pytest.fixture(scope="session")
def tls_server(tiny_repository: Path, pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """The tiny model over TLS, answering only calls with the API key (health on a plaintext port)."""
    log_path = tmp_path_factory.mktemp("tls-server") / "server.log"
    server = _secure_server(tiny_repository, pki, log_path, "--api-key-file", str(pki.api_key_file))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def mtls_server(tiny_repository: Path, pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """The tiny model over mutual TLS: clients must present a certificate signed by the test CA."""
    log_path = tmp_path_factory.mktemp("mtls-server") / "server.log"
    server = _secure_server(tiny_repository, pki, log_path, "--tls-client-ca", str(pki.ca))
    try:
        yield server
    finally:
        server.stop()
