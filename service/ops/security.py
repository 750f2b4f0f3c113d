"""Transport security and access control: TLS credentials that follow files on disk, and API keys.

Both re-read their files when they change (cert-manager and Kubernetes Secrets rotate files in
place, by swapping a symlink), so rotation needs no restart and leaves open connections alone:
a new certificate applies to new handshakes only.
"""

from __future__ import annotations

import hmac
import logging
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from service.ops.tenants import KeyFile, Tenant, parse_key_file

log = logging.getLogger(__name__)

BEARER = "bearer "
KEY_CHECK_INTERVAL_S = 1.0
"""How often, at most, the API key file is checked for changes."""


class SecurityError(ValueError):
    """A certificate, key or key file that cannot be used; the message names the file."""


def _stamp(path: Path) -> tuple[int, int, int]:
    """What changes when a file is replaced or rewritten (stat follows a swapped symlink)."""
    stat = path.stat()
    return (stat.st_mtime_ns, stat.st_ino, stat.st_size)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise SecurityError(f"cannot read {path}: {error.strerror}") from error


def _check_pair(files: TlsFiles) -> None:
    """The certificate and key are PEM that OpenSSL loads, and the key is the certificate's."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(files.cert, files.key)
    except (OSError, ssl.SSLError) as error:
        raise SecurityError(f"{files.cert} and {files.key} cannot be used: {_reason(error)}") from error


def _reason(error: OSError | ssl.SSLError) -> str:
    """OpenSSL's reason in words ("key values mismatch"), else the error as Python gives it."""
    reason = getattr(error, "reason", None)
    return reason.lower().replace("_", " ") if isinstance(reason, str) else str(error)


@dataclass(frozen=True)
class TlsFiles:
    """The PEM files of the server's TLS setup."""

    cert: Path
    key: Path
    client_ca: Path | None = None
    """Mutual TLS: clients must present a certificate signed by this CA."""

    def paths(self) -> tuple[Path, ...]:
        """Every file in use."""
        return (self.cert, self.key) if self.client_ca is None else (self.cert, self.key, self.client_ca)

    def stamps(self) -> tuple[tuple[int, int, int], ...]:
        """What changes when any of the files is replaced or rewritten."""
        try:
            return tuple(_stamp(path) for path in self.paths())
        except OSError as error:
            raise SecurityError(f"cannot read TLS file: {error}") from error


class ReloadingTls:
    """Server credentials whose certificate, key and client CA are re-read when their files change.

    gRPC asks `fetch` before each new TLS handshake (on one of its own threads); it answers None
    while nothing changed, so the cost is a few stat calls per new connection.
    """

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._lock = threading.Lock()
        self._stamps = self.files.stamps()
        self._initial = self._configuration()
        self.reloads = 0

    def _configuration(self) -> grpc.ServerCertificateConfiguration:
        cert, key = _read(self.files.cert), _read(self.files.key)
        if b"-----BEGIN" not in cert or b"-----BEGIN" not in key:
            raise SecurityError(f"{self.files.cert} and {self.files.key} must be PEM files")
        # gRPC takes any pair and fails later, at bind ("Failed to bind") or at every handshake.
        _check_pair(self.files)
        client_ca = _read(self.files.client_ca) if self.files.client_ca is not None else None
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=client_ca)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """A new configuration when a file changed since the last call, else None (keep the current one)."""
        with self._lock:
            try:
                stamps = self.files.stamps()
                if stamps == self._stamps:
                    return None
                configuration = self._configuration()
            except SecurityError as error:
                # Mid-rotation (one file written, the other not yet) or a broken file: keep serving
                # with what works and try again at the next handshake.
                log.warning("TLS files not reloaded: %s", error)
                return None
            self._stamps = stamps
            self.reloads += 1
            log.info("TLS certificate reloaded from %s", self.files.cert)
            return configuration

    def credentials(self) -> grpc.ServerCredentials:
        """Credentials for `add_secure_port`."""
        return grpc.dynamic_ssl_server_credentials(
            self._initial, self.fetch, require_client_authentication=self.files.client_ca is not None
        )


class ReloadingSslContext:
    """An `ssl.SSLContext` for the HTTP port whose certificate, key and client CA follow their files.

    Python's TLS servers take one context for good, so `context` asks, at each new handshake
    (its SNI callback, which OpenSSL calls with or without a server name), whether a file changed,
    and hands the handshake a freshly loaded context if so: the same few stat calls per new
    connection as `ReloadingTls`, and open connections keep what they negotiated.
    """

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._lock = threading.Lock()
        self._stamps = self.files.stamps()
        self._current = self._load()
        self.context = self._current
        self.context.sni_callback = self._select
        self.reloads = 0

    def _load(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(self.files.cert, self.files.key)
            if self.files.client_ca is not None:
                context.load_verify_locations(cafile=self.files.client_ca)
                context.verify_mode = ssl.CERT_REQUIRED
        except (OSError, ssl.SSLError) as error:
            raise SecurityError(f"{self.files.cert} and {self.files.key} cannot be used: {_reason(error)}") from error
        return context

    def current(self) -> ssl.SSLContext:
        """The context for a new handshake: reloaded when a file changed, else the one in use."""
        with self._lock:
            try:
                stamps = self.files.stamps()
                if stamps != self._stamps:
                    self._current = self._load()
                    self._stamps = stamps
                    self.reloads += 1
                    log.info("TLS certificate reloaded from %s for HTTP", self.files.cert)
            except SecurityError as error:
                # As for gRPC: mid-rotation or broken files keep the working context.
                log.warning("TLS files not reloaded for HTTP: %s", error)
            return self._current

    def _select(self, connection: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext) -> None:
        latest = self.current()
        if latest is not context:
            connection.context = latest


def read_key_file(path: Path) -> tuple[KeyFile, tuple[int, int, int]]:
    """What an API key file says, and its stamp; SecurityError if it cannot be used (the message quotes no key)."""
    try:
        stamp = _stamp(path)
    except OSError as error:
        raise SecurityError(f"cannot read API key file {path}: {error.strerror}") from error
    text = _read(path).decode("utf-8", errors="replace")
    try:
        return parse_key_file(path.name, text), stamp
    except ValueError as error:
        raise SecurityError(f"API key file {path} {error}") from error


class ApiKeys:
    """The accepted API keys and their tenants, from a file re-read (at most once a second) when it changes.

    The file is one key per line (blank lines and lines starting with # ignored; every key is the
    tenant `default`'s, unlimited) or a TOML file of tenants with their keys and limits (service.ops.tenants,
    docs/tenants.md). Keys are compared in constant time and never logged. A file that cannot be used
    is an error at start; on reload it is logged and the previous keys stay. `share`: the part of each
    tenant's limits this process enforces (1/--frontends). A tenant whose limits a reload leaves as they
    were keeps its buckets; one whose limits changed starts afresh (full) under the new ones.
    """

    def __init__(self, path: Path, share: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.share = share
        self._clock = clock
        self._lock = threading.Lock()
        self._keys: tuple[tuple[bytes, Tenant], ...] = ()
        self._tenants: dict[str, Tenant] = {}
        self._stamp = self._load()
        self._checked_at = clock()

    def _load(self) -> tuple[int, int, int]:
        """Read the file and take its keys and tenants; its stamp. SecurityError (nothing taken) if unusable."""
        described, stamp = read_key_file(self.path)
        tenants = {}
        for name, limits in described.tenants.items():
            kept = self._tenants.get(name)
            tenants[name] = kept if kept is not None and kept.limits == limits else Tenant(name, limits, self.share)
        self._tenants = tenants
        self._keys = tuple((key, tenants[name]) for key, name in described.keys)
        return stamp

    def _refresh(self) -> None:
        now = self._clock()
        if now - self._checked_at < KEY_CHECK_INTERVAL_S:
            return
        with self._lock:
            self._checked_at = now
            try:
                if _stamp(self.path) == self._stamp:
                    return
                self._stamp = self._load()
            except (OSError, SecurityError) as error:
                log.error("API keys not reloaded, keeping the previous ones: %s", error)
                return
            log.info("API keys reloaded from %s (%d keys, %d tenants)", self.path, len(self._keys), len(self._tenants))

    def tenant(self, authorization: str | None) -> Tenant | None:
        """The tenant whose key an `authorization` header value carries as `Bearer <key>`; None: not accepted."""
        self._refresh()
        if authorization is None or authorization[: len(BEARER)].lower() != BEARER:
            return None
        offered = authorization[len(BEARER) :].strip().encode()
        # Compare with every key, so the time taken does not tell which one (or whether any) matched.
        found = None
        for key, tenant in self._keys:
            if hmac.compare_digest(offered, key):
                found = tenant
        return found

    def accepts(self, authorization: str | None) -> bool:
        """Whether an `authorization` header value carries an accepted `Bearer` key."""
        return self.tenant(authorization) is not None


def tls_files(cert: str, key: str, client_ca: str) -> TlsFiles | None:
    """The TLS files from settings (empty strings mean no TLS)."""
    if not cert:
        return None
    return TlsFiles(Path(cert), Path(key), Path(client_ca) if client_ca else None)


def api_keys(path: str, share: float = 1.0) -> ApiKeys | None:
    """The API keys from settings (an empty path means no keys needed); `share` of each tenant's limits."""
    return ApiKeys(Path(path), share) if path else None


def check_files(cert: str, key: str, client_ca: str, api_key_file: str) -> None:
    """Load every security file named in settings once, raising SecurityError if one cannot be used.

    A supervisor checks before it starts its front ends, so a bad file is one error, not one per process.
    """
    files = tls_files(cert, key, client_ca)
    if files is not None:
        ReloadingTls(files)
        ReloadingSslContext(files)
    if api_key_file:
        read_key_file(Path(api_key_file))
