"""Test certificates (trustme): a CA, a server certificate for 127.0.0.1, a client certificate, as PEM files."""

from __future__ import annotations

import os
import ssl
from pathlib import Path

import grpc
import trustme


class Pki:
    """A CA with a server certificate (127.0.0.1, localhost) and a client certificate; the CA as a PEM file."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.ca = trustme.CA()
        self.ca_file = folder / "ca.pem"
        self.ca.cert_pem.write_to_path(str(self.ca_file))
        self.server_cert = self.ca.issue_cert("127.0.0.1", "localhost")
        self.client_cert = self.ca.issue_cert("client@example.com")

    def write_server_files(self, cert: Path, key: Path) -> None:
        """Write the server's chain and key the way a rotation does: new files moved over the old ones."""
        for target, blob in ((cert, self.server_cert.cert_chain_pems), (key, [self.server_cert.private_key_pem])):
            staging = target.with_suffix(".new")
            staging.write_bytes(b"".join(part.bytes() for part in blob))
            os.replace(staging, target)

    def grpc_credentials(self, with_client_cert: bool = False) -> grpc.ChannelCredentials:
        """gRPC channel credentials trusting this CA (and presenting the client certificate if asked)."""
        if not with_client_cert:
            return grpc.ssl_channel_credentials(self.ca.cert_pem.bytes())
        return grpc.ssl_channel_credentials(
            self.ca.cert_pem.bytes(),
            private_key=self.client_cert.private_key_pem.bytes(),
            certificate_chain=self.client_cert.cert_chain_pems[0].bytes(),
        )

    def ssl_context(self, with_client_cert: bool = False) -> ssl.SSLContext:
        """An HTTPS client context trusting this CA (and presenting the client certificate if asked)."""
        context = ssl.create_default_context(cafile=str(self.ca_file))
        if with_client_cert:
            self.client_cert.configure_cert(context)
        return context
