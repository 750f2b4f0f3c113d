"""Tenants: whose an API key is, the limits it is held to, and what it used (docs/tenants.md).

The API key file (--api-key-file) is either today's one key per line, whose keys all belong to one
unlimited tenant named `default`, or a TOML file naming each tenant, its keys and its limits:

    [tenants.search]
    keys = ["key-a", "key-b"]
    requests_per_second = 50       # optional; requests_burst defaults to one second's worth
    requests_burst = 100
    tokens_per_minute = 200000     # optional; tokens_burst defaults to one minute's worth
    tokens_burst = 50000
    weight = 3                     # optional (default 1): its share of a full engine against others of its priority
    priority = 1                   # optional: the priority its requests wait at when they name none
    highest_priority = 1           # optional: the highest priority its requests may ask for

Limits are token buckets, one per tenant and limit, in each front-end process (each takes its share,
1/--frontends, of every rate and burst). A request is refused at the engine's door when its tenant's
requests bucket has no request left, or its tokens bucket is empty; its prompt tokens (counted by the
model's tokenizer) are charged once it is answered, so the tokens bucket may go into debt, and the
tenant is refused until it has refilled past zero.
"""

from __future__ import annotations

import math
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, fields

from service.errors import OverLimit
from service.ops import metrics

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the image and CI run 3.11
    import tomli as tomllib

DEFAULT_TENANT = "default"
"""The tenant of every key of a one-key-per-line file."""
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
"""What a tenant may be named: it becomes a metric label value."""
REQUESTS_REASON = "tenant_requests"
TOKENS_REASON = "tenant_tokens"
SECONDS_PER_MINUTE = 60.0

Clock = Callable[[], float]


class TokenBucket:
    """A token bucket: holds up to `burst`, refilled at `rate_per_s`; a charge may take it below zero (debt)."""

    __slots__ = ("_clock", "_level", "_updated", "burst", "rate_per_s")

    def __init__(self, rate_per_s: float, burst: float, clock: Clock = time.monotonic) -> None:
        if rate_per_s <= 0 or burst <= 0:
            raise ValueError("a token bucket needs a positive rate and burst")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._clock = clock
        self._level = burst
        self._updated = clock()

    def level(self) -> float:
        """What the bucket holds now (negative: in debt)."""
        now = self._clock()
        self._level = min(self.burst, self._level + (now - self._updated) * self.rate_per_s)
        self._updated = now
        return self._level

    def take(self, amount: float) -> bool:
        """Take `amount` if the bucket holds it (True); else take nothing (False)."""
        if self.level() < amount:
            return False
        self._level -= amount
        return True

    def charge(self, amount: float) -> None:
        """Take `amount` whatever the bucket holds: what was used is owed."""
        self.level()
        self._level -= amount

    def seconds_until(self, amount: float) -> float:
        """Seconds until the bucket holds `amount` (0 if it does now); never, for more than its burst."""
        missing = amount - self.level()
        if missing <= 0:
            return 0.0
        return math.inf if amount > self.burst else missing / self.rate_per_s


@dataclass(frozen=True)
class TenantLimits:
    """A tenant's limits as the key file states them (None: no such limit)."""

    requests_per_second: float | None = None
    requests_burst: float | None = None
    """Requests admitted at once after a quiet spell; default one second's worth (at least 1)."""
    tokens_per_minute: float | None = None
    tokens_burst: float | None = None
    """Prompt tokens that may be used at once after a quiet spell; default one minute's worth."""
    weight: float | None = None
    """Its share of a full engine against the other tenants queued at the same priority; default 1."""
    priority: float | None = None
    """The priority (1 the highest) its requests wait at when they name none; default the model's."""
    highest_priority: float | None = None
    """The highest priority (1 the highest) its requests may ask for or wait at; default 1 (any)."""


def _retry_after_s(seconds: float) -> int:
    """Whole seconds to wait (at least 1), as HTTP's Retry-After takes them."""
    return max(1, math.ceil(seconds)) if math.isfinite(seconds) else 1


class Tenant:
    """One tenant in one process: its name, its limits (this process's share) and its metric children."""

    def __init__(self, name: str, limits: TenantLimits, share: float = 1.0, clock: Clock = time.monotonic) -> None:
        self.name = name
        self.limits = limits
        self.metrics = metrics.of_tenant(name)
        self.priority = int(limits.priority or 0)
        """The priority its requests wait at when they name none (0: the model's default)."""
        self.highest_priority = int(limits.highest_priority or 1)
        """The highest priority its requests may ask for or wait at (1: any)."""
        self.weight = limits.weight or 1.0
        """Its share of a full engine against the other tenants queued at the same priority."""
        self._requests: TokenBucket | None = None
        self._tokens: TokenBucket | None = None
        if limits.requests_per_second is not None:
            burst = limits.requests_burst or max(1.0, limits.requests_per_second)
            # A request takes a whole one from the bucket: a share below one could never admit any.
            self._requests = TokenBucket(limits.requests_per_second * share, max(1.0, burst * share), clock)
        if limits.tokens_per_minute is not None:
            burst = limits.tokens_burst or limits.tokens_per_minute
            self._tokens = TokenBucket(limits.tokens_per_minute / SECONDS_PER_MINUTE * share, burst * share, clock)

    def admit(self) -> None:
        """Count a request against the requests/s limit, or refuse it (OverLimit) if over either limit."""
        if self._tokens is not None and self._tokens.level() <= 0:
            self.metrics.rejected("tokens_per_minute")
            wait_s = self._tokens.seconds_until(0) or 1 / self._tokens.rate_per_s
            raise OverLimit(
                f"tenant {self.name!r} is over its {self.limits.tokens_per_minute:g} tokens/minute limit;"
                f" retry in {_retry_after_s(wait_s)} s",
                TOKENS_REASON,
                _retry_after_s(wait_s),
            )
        if self._requests is not None and not self._requests.take(1):
            self.metrics.rejected("requests_per_second")
            wait_s = self._requests.seconds_until(1)
            raise OverLimit(
                f"tenant {self.name!r} is over its {self.limits.requests_per_second:g} requests/s limit;"
                f" retry in {_retry_after_s(wait_s)} s",
                REQUESTS_REASON,
                _retry_after_s(wait_s),
            )

    def charge(self, prompt_tokens: int) -> None:
        """An answered request's prompt tokens: counted, and owed to the tokens/minute limit."""
        self.metrics.prompt_tokens.inc(prompt_tokens)
        if self._tokens is not None:
            self._tokens.charge(prompt_tokens)


@dataclass(frozen=True)
class KeyFile:
    """What an API key file says: each key with its tenant's name, and each tenant's limits."""

    keys: tuple[tuple[bytes, str], ...]
    tenants: dict[str, TenantLimits]


_LIMIT_FIELDS = tuple(field.name for field in fields(TenantLimits))
_TENANT_FIELDS = frozenset({"keys", *_LIMIT_FIELDS})


def is_tenants_file(name: str, text: str) -> bool:
    """Whether a key file is TOML: named *.toml, or its first line that says anything is a [table] header."""
    if name.endswith(".toml"):
        return True
    for line in text.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            return stripped.startswith("[")
    return False


def parse_key_file(name: str, text: str) -> KeyFile:
    """Read a key file of either form; ValueError says what is wrong (never quoting a key)."""
    if not is_tenants_file(name, text):
        keys = tuple(
            (line.strip().encode(), DEFAULT_TENANT)
            for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")
        )
        if not keys:
            raise ValueError("holds no key")
        return KeyFile(keys, {DEFAULT_TENANT: TenantLimits()})
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"is not valid TOML: {error}") from error
    unknown = set(document) - {"tenants"}
    if unknown:
        raise ValueError(f"has {', '.join(sorted(unknown))} at its top level: only [tenants.<name>] tables")
    tenants = document.get("tenants")
    if not isinstance(tenants, dict) or not tenants:
        raise ValueError("names no tenant: write a [tenants.<name>] table with keys = [...]")
    keys: list[tuple[bytes, str]] = []
    limits: dict[str, TenantLimits] = {}
    for tenant, table in tenants.items():
        limits[tenant] = _tenant_limits(tenant, table)
        keys += [(key, tenant) for key in _tenant_keys(tenant, table)]
    if len({key for key, _ in keys}) != len(keys):
        raise ValueError("gives one key to two tenants (or twice to one)")
    return KeyFile(tuple(keys), limits)


def _tenant_keys(tenant: str, table: dict[str, object]) -> list[bytes]:
    keys = table.get("keys")
    if not isinstance(keys, list) or not keys:
        raise ValueError(f"tenant {tenant!r} has no keys = [...]")
    for number, key in enumerate(keys, 1):
        if not isinstance(key, str) or not key or key != key.strip() or any(c.isspace() for c in key):
            raise ValueError(f"tenant {tenant!r}: key {number} is not a string without spaces")
    return [key.encode() for key in keys]


def _tenant_limits(tenant: str, table: object) -> TenantLimits:
    if not TENANT_NAME.fullmatch(tenant):
        raise ValueError(f"tenant name {tenant!r}: use letters, digits, '_', '.' and '-' (at most 63)")
    if not isinstance(table, dict):
        raise ValueError(f"tenant {tenant!r} is not a table")
    unknown = set(table) - _TENANT_FIELDS
    if unknown:
        raise ValueError(f"tenant {tenant!r}: unknown {', '.join(sorted(unknown))} (known: {', '.join(_LIMIT_FIELDS)})")
    values: dict[str, float] = {}
    for name in _LIMIT_FIELDS:
        value = table.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
            raise ValueError(f"tenant {tenant!r}: {name} must be a positive number")
        if name in ("priority", "highest_priority") and not isinstance(value, int):
            raise ValueError(f"tenant {tenant!r}: {name} must be a whole number, 1 (the highest) or more")
        values[name] = float(value)
    for burst, rate in (("requests_burst", "requests_per_second"), ("tokens_burst", "tokens_per_minute")):
        if burst in values and rate not in values:
            raise ValueError(f"tenant {tenant!r}: {burst} without {rate}")
    if values.get("requests_burst", 1.0) < 1:
        raise ValueError(f"tenant {tenant!r}: requests_burst must be at least 1")
    if values.get("priority", math.inf) < values.get("highest_priority", 1.0):
        raise ValueError(
            f"tenant {tenant!r}: priority {values['priority']:g} is above its highest_priority"
            f" {values['highest_priority']:g} (1 is the highest)"
        )
    return TenantLimits(**values)
