"""How a gRPC caller reaches the server: plaintext, TLS, mutual TLS, and an API key.

The settings, their command-line flags and their ENCODER_CLIENT_* variables, in one place for every
caller here: the SDK (`client`), the tools that measure the server (`tools`) and the runtime's own
health probe (`service.ops.healthcheck`). grpc alone, so it belongs to the base install, and neither
the runtime nor the SDK depends on the other for it.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

AUTHORIZATION_HEADER = "authorization"
CLIENT_ENV_PREFIX = "ENCODER_CLIENT_"
"""Environment variables a client's security flags fall back to (`--tls-ca` -> `ENCODER_CLIENT_TLS_CA`).

Not the server's `ENCODER_TLS_*`: a probe running inside the server's container must not take the
server's own certificate settings for its client ones.
"""


class SecurityError(ValueError):
    """Client security settings that cannot be used (a missing file, a certificate without its key)."""


@dataclass(frozen=True)
class ClientSecurity:
    """How a client reaches a server: plaintext by default, or TLS, mutual TLS, and an API key.

    TLS is on when `tls` is set or any certificate file is given; without `ca_file` the server's
    certificate is verified against the system's roots. The API key travels as
    `authorization: Bearer <key>` metadata on each call (see `metadata()`); it is never part of
    repr(), logs or reports. Certificate files are read each time a channel is opened, so a client
    that opens new channels picks up certificates rotated on disk.
    """

    tls: bool = False
    ca_file: Path | None = None
    """PEM bundle of the CAs that may sign the server's certificate."""
    cert_file: Path | None = None
    """PEM client certificate (chain) for mutual TLS; needs `key_file`."""
    key_file: Path | None = None
    """PEM private key of `cert_file`."""
    server_name: str | None = None
    """Name the server's certificate is checked against, when it is not the target's host."""
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise SecurityError("a client certificate needs its key: give both --tls-cert and --tls-key")
        for path in (self.ca_file, self.cert_file, self.key_file):
            if path is not None and not Path(path).is_file():
                raise SecurityError(f"TLS file not found: {path}")
        if self.api_key is not None and (not self.api_key or any(c.isspace() for c in self.api_key)):
            raise SecurityError("an API key must be one non-empty word")

    @property
    def uses_tls(self) -> bool:
        """Whether channels are encrypted."""
        return self.tls or self.ca_file is not None or self.cert_file is not None

    @property
    def mutual_tls(self) -> bool:
        """Whether the client presents a certificate."""
        return self.cert_file is not None

    @classmethod
    def from_files(
        cls,
        *,
        tls: bool = False,
        ca_file: Path | None = None,
        cert_file: Path | None = None,
        key_file: Path | None = None,
        server_name: str | None = None,
        api_key_file: Path | None = None,
    ) -> ClientSecurity:
        """Settings from file names; the API key is the first non-blank line of `api_key_file`."""
        return cls(
            tls=tls,
            ca_file=ca_file,
            cert_file=cert_file,
            key_file=key_file,
            server_name=server_name or None,
            api_key=None if api_key_file is None else read_api_key(api_key_file),
        )

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata: the API key as a bearer token, or nothing."""
        return () if self.api_key is None else ((AUTHORIZATION_HEADER, f"Bearer {self.api_key}"),)

    def credentials(self) -> grpc.ChannelCredentials:
        """TLS channel credentials from the certificate files, read now."""
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file),
            private_key=_read(self.key_file),
            certificate_chain=_read(self.cert_file),
        )

    def _options(self, options: Sequence[tuple[str, object]]) -> list[tuple[str, object]]:
        if self.uses_tls and self.server_name:
            return [*options, ("grpc.ssl_target_name_override", self.server_name)]
        return list(options)

    def channel(self, target: str, options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
        """A blocking channel to target, encrypted when TLS is on."""
        if self.uses_tls:
            return grpc.secure_channel(target, self.credentials(), options=self._options(options))
        return grpc.insecure_channel(target, options=self._options(options))

    def aio_channel(self, target: str, options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
        """An asyncio channel to target, encrypted when TLS is on."""
        if self.uses_tls:
            return grpc.aio.secure_channel(target, self.credentials(), options=self._options(options))
        return grpc.aio.insecure_channel(target, options=self._options(options))

    def describe(self) -> dict[str, object]:
        """What is in use, for reports: file names and flags, never the key or certificate contents."""
        return {
            "tls": self.uses_tls,
            "ca_file": None if self.ca_file is None else str(self.ca_file),
            "mutual_tls": self.mutual_tls,
            "server_name": self.server_name,
            "api_key": self.api_key is not None,
        }


def _read(path: Path | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


def read_api_key(path: Path) -> str:
    """The first key of a key file, in the server's format: one key per line; blank and # lines ignored."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise SecurityError(f"cannot read API key file {path}: {error}") from None
    for line in lines:
        key = line.strip()
        if key and not key.startswith("#"):
            return key
    raise SecurityError(f"API key file {path} holds no key")


def add_security_arguments(parser: argparse.ArgumentParser, *, api_key: bool = True) -> None:
    """TLS flags (and `--api-key-file` when `api_key`), each defaulting to its ENCODER_CLIENT_* variable."""
    environ = os.environ
    group = parser.add_argument_group("transport security (each flag also as ENCODER_CLIENT_<FLAG>)")
    group.add_argument(
        "--tls",
        action="store_true",
        default=_env_flag(environ, "TLS"),
        help="use TLS, verifying the server against the system's CAs (implied by the options below)",
    )
    group.add_argument(
        "--tls-ca", type=Path, default=_env_path(environ, "TLS_CA"), metavar="FILE", help="PEM CA bundle"
    )
    group.add_argument(
        "--tls-cert",
        type=Path,
        default=_env_path(environ, "TLS_CERT"),
        metavar="FILE",
        help="PEM client certificate for mutual TLS (with --tls-key)",
    )
    group.add_argument(
        "--tls-key", type=Path, default=_env_path(environ, "TLS_KEY"), metavar="FILE", help="PEM client key"
    )
    group.add_argument(
        "--tls-server-name",
        default=environ.get(f"{CLIENT_ENV_PREFIX}TLS_SERVER_NAME"),
        metavar="NAME",
        help="name the server certificate must carry, when it is not the target's host",
    )
    if api_key:
        group.add_argument(
            "--api-key-file",
            type=Path,
            default=_env_path(environ, "API_KEY_FILE"),
            metavar="FILE",
            help="file whose first line is the API key, sent as 'authorization: Bearer <key>'",
        )


def security_from_args(args: argparse.Namespace) -> ClientSecurity:
    """ClientSecurity from the flags of add_security_arguments; raises SecurityError."""
    return ClientSecurity.from_files(
        tls=args.tls,
        ca_file=args.tls_ca,
        cert_file=args.tls_cert,
        key_file=args.tls_key,
        server_name=args.tls_server_name,
        api_key_file=getattr(args, "api_key_file", None),
    )


def security_from_env() -> ClientSecurity:
    """ClientSecurity from the ENCODER_CLIENT_* variables alone, for tools whose flags we do not own (Locust)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_security_arguments(parser)
    return security_from_args(parser.parse_args([]))


def _env_path(environ: Mapping[str, str], name: str) -> Path | None:
    value = environ.get(f"{CLIENT_ENV_PREFIX}{name}")
    return Path(value) if value else None


def _env_flag(environ: Mapping[str, str], name: str) -> bool:
    return environ.get(f"{CLIENT_ENV_PREFIX}{name}", "").strip().lower() in {"1", "true", "yes", "on"}
