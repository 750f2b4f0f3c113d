"""Our clients over TLS, mutual TLS and API keys, against real servers with real (trustme) certificates.

EmbeddingClient, AsyncEmbeddingClient and the health probe take one ClientSecurity (as the tools do:
tests/tools/test_security.py); tritonclient drives the same servers.
"""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton

from client import AsyncEmbeddingClient, ClientSecurity, EmbeddingClient, EmbeddingError, SecurityError
from client.__main__ import main as client_command
from protocol.channel_security import read_api_key
from service.ops import healthcheck
from tests.conftest import API_KEY, TINY_MODEL, Pki
from tests.servers import RunningServer

TEXTS = ["a sentence sent over TLS", "and another one, a little longer than the first"]


@pytest.fixture(scope="module")
def plaintext_embeddings(tiny_server: RunningServer) -> np.ndarray:
    """The same model's answer over plaintext: what every secured client must get too."""
    with EmbeddingClient(tiny_server.target, model=TINY_MODEL) as client:
        return client.embed(TEXTS)


def embed(server: RunningServer, security: ClientSecurity) -> np.ndarray:
    with EmbeddingClient(server.target, model=TINY_MODEL, timeout_s=10, security=security) as client:
        return client.embed(TEXTS)


def refusal(server: RunningServer, security: ClientSecurity) -> grpc.StatusCode:
    with pytest.raises(EmbeddingError) as caught:
        embed(server, security)
    return caught.value.code


def test_blocking_client_with_ca_and_key(tls_server: RunningServer, pki: Pki, plaintext_embeddings) -> None:
    embeddings = embed(tls_server, pki.security(api_key=True))
    np.testing.assert_allclose(embeddings, plaintext_embeddings, atol=1e-5)


async def test_async_client_with_ca_and_key(tls_server: RunningServer, pki: Pki, plaintext_embeddings) -> None:
    security = pki.security(api_key=True)
    async with AsyncEmbeddingClient(tls_server.target, model=TINY_MODEL, batch_size=1, security=security) as client:
        embeddings = await client.embed(TEXTS)
    np.testing.assert_allclose(embeddings, plaintext_embeddings, atol=1e-5)


def test_without_the_key_or_with_a_wrong_one_is_unauthenticated(tls_server: RunningServer, pki: Pki, tmp_path) -> None:
    assert refusal(tls_server, pki.security()) == grpc.StatusCode.UNAUTHENTICATED
    wrong = tmp_path / "wrong-key"
    wrong.write_text("not-the-key\n")
    security = ClientSecurity.from_files(ca_file=pki.ca, api_key_file=wrong)
    assert refusal(tls_server, security) == grpc.StatusCode.UNAUTHENTICATED


def test_plaintext_or_an_untrusted_server_certificate_cannot_connect(tls_server: RunningServer, pki: Pki) -> None:
    assert refusal(tls_server, ClientSecurity(api_key=API_KEY)) == grpc.StatusCode.UNAVAILABLE
    # TLS against the system's CAs, which never signed the test certificate.
    assert refusal(tls_server, ClientSecurity(tls=True, api_key=API_KEY)) == grpc.StatusCode.UNAVAILABLE


def test_server_name_override_verifies_a_certificate_issued_for_another_name(
    tls_server: RunningServer, pki: Pki, plaintext_embeddings
) -> None:
    # Reach the server by address but check its certificate for "localhost", one of its names.
    security = ClientSecurity.from_files(ca_file=pki.ca, server_name="localhost", api_key_file=pki.api_key_file)
    np.testing.assert_allclose(embed(tls_server, security), plaintext_embeddings, atol=1e-5)
    wrong_name = ClientSecurity.from_files(
        ca_file=pki.ca, server_name="elsewhere.example", api_key_file=pki.api_key_file
    )
    assert refusal(tls_server, wrong_name) == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_accepts_only_a_certificate_from_its_ca(mtls_server: RunningServer, pki: Pki, plaintext_embeddings):
    np.testing.assert_allclose(embed(mtls_server, pki.security(client_cert=True)), plaintext_embeddings, atol=1e-5)
    assert refusal(mtls_server, pki.security()) == grpc.StatusCode.UNAVAILABLE
    stranger = ClientSecurity(ca_file=pki.ca, cert_file=pki.rogue_cert, key_file=pki.rogue_key)
    assert refusal(mtls_server, stranger) == grpc.StatusCode.UNAVAILABLE


def test_tritonclient_with_mutual_tls_and_a_key(mtls_server: RunningServer, tls_server: RunningServer, pki: Pki):
    text = triton.InferInput("text", [1], "BYTES")
    text.set_data_from_numpy(np.array([TEXTS[0].encode()], dtype=object))
    mutual = triton.InferenceServerClient(
        mtls_server.target,
        ssl=True,
        root_certificates=str(pki.ca),
        private_key=str(pki.client_key),
        certificate_chain=str(pki.client_cert),
    )
    keyed = triton.InferenceServerClient(tls_server.target, ssl=True, root_certificates=str(pki.ca))
    try:
        first = mutual.infer(TINY_MODEL, [text]).as_numpy("embedding")
        second = keyed.infer(TINY_MODEL, [text], headers={"authorization": f"Bearer {API_KEY}"}).as_numpy("embedding")
    finally:
        mutual.close()
        keyed.close()
    np.testing.assert_allclose(first, second, atol=1e-6)
    assert first.shape == (1, 32)


def test_healthcheck_over_tls_needs_no_key(tls_server: RunningServer, pki: Pki, capsys) -> None:
    assert healthcheck.main(["--target", tls_server.target, "--tls-ca", str(pki.ca)]) == 0
    assert healthcheck.main(["--target", tls_server.target, "--service", TINY_MODEL, "--tls-ca", str(pki.ca)]) == 0
    assert healthcheck.main(["--target", tls_server.target]) == 1
    assert capsys.readouterr().err.startswith("unreachable:")
    # The plaintext health port, as the kubelet's own gRPC probes use it.
    assert healthcheck.main(["--target", tls_server.health_target]) == 0


def test_healthcheck_with_mutual_tls(mtls_server: RunningServer, pki: Pki, capsys) -> None:
    client_files = ["--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key)]
    assert healthcheck.main(["--target", mtls_server.target, "--tls-ca", str(pki.ca), *client_files]) == 0
    assert healthcheck.main(["--target", mtls_server.target, "--tls-ca", str(pki.ca)]) == 1
    # Refused at the handshake (UNAVAILABLE), which the probe words as unreachable; a timeout would read "timeout:".
    assert capsys.readouterr().err.startswith("unreachable:")


def test_healthcheck_rejects_a_missing_certificate_file(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        healthcheck.main(["--tls-ca", str(tmp_path / "missing.pem")])
    assert exit_info.value.code == 2


def test_security_settings_are_checked_and_the_key_stays_out_of_repr(pki: Pki, tmp_path: Path) -> None:
    security = pki.security(client_cert=True, api_key=True)
    assert read_api_key(pki.api_key_file) == API_KEY  # the comment line is skipped
    assert security.metadata() == (("authorization", f"Bearer {API_KEY}"),)
    assert API_KEY not in repr(security) and API_KEY not in json.dumps(security.describe())
    assert security.uses_tls and security.mutual_tls
    with pytest.raises(SecurityError, match="needs its key"):
        ClientSecurity(ca_file=pki.ca, cert_file=pki.client_cert)
    with pytest.raises(SecurityError, match="not found"):
        ClientSecurity(ca_file=tmp_path / "missing.pem")
    empty = tmp_path / "empty-keys"
    empty.write_text("# no key here\n\n")
    with pytest.raises(SecurityError, match="holds no key"):
        ClientSecurity.from_files(api_key_file=empty)


def test_api_key_argument_and_several_connections_over_tls(
    tls_server: RunningServer, pki: Pki, plaintext_embeddings
) -> None:
    with EmbeddingClient(
        tls_server.target, model=TINY_MODEL, security=pki.security(), api_key=API_KEY, connections=2
    ) as client:
        for _ in range(2):  # each connection
            np.testing.assert_allclose(client.embed(TEXTS), plaintext_embeddings, atol=1e-5)


def test_command_line_ingestion_over_mutual_tls_and_with_a_key(
    mtls_server: RunningServer, tls_server: RunningServer, pki: Pki, plaintext_embeddings, tmp_path: Path
) -> None:
    source = tmp_path / "texts.txt"
    source.write_text("".join(text + "\n" for text in TEXTS))
    mutual = ["--tls-ca", str(pki.ca), "--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key)]
    keyed = ["--tls-ca", str(pki.ca), "--api-key-file", str(pki.api_key_file)]
    for server, flags in ((mtls_server, mutual), (tls_server, keyed)):
        output = tmp_path / "vectors.npy"
        arguments = ["embed", str(source), "--output", str(output), "--target", server.target, "--model", TINY_MODEL]
        assert client_command([*arguments, "--quiet", *flags]) == 0
        np.testing.assert_allclose(np.load(output), plaintext_embeddings, atol=1e-5)
    assert client_command([*arguments, "--quiet", "--tls-ca", str(pki.ca)]) == 1  # no key: UNAUTHENTICATED
