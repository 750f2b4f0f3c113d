"""What a load test runs: the run's settings and its load levels, validated when built."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from client import DEFAULT_MODEL
from protocol.channel_security import ClientSecurity

CORPORA = ("short", "long", "chunks")
"""Names of the corpora a request mix may draw from: `short` and `long` are shipped files
(`tools/loadtest/<name>.txt`); `chunks` is cut from `long`'s words as document chunks are."""

Mode = Literal["closed", "open"]
InputKind = Literal["text", "tokens"]

# host:port, [v6]:port, or a gRPC name-resolver URI (dns:///name:port, ipv4:..., unix:...).
_TARGET = re.compile(r"^(?:[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\]):\d{1,5}$|^(?:dns|ipv4|ipv6|unix|unix-abstract):.+$")


class ConfigError(ValueError):
    """Settings that make no sense; raised before any load is sent."""


@dataclass(frozen=True)
class Level:
    """One load level: `closed` with `value` workers, or `open` at `value` requests/s (Poisson)."""

    mode: Mode
    value: float

    def __post_init__(self) -> None:
        if self.mode not in ("closed", "open"):
            raise ConfigError(f"mode must be closed or open, got {self.mode!r}")
        if not math.isfinite(self.value) or self.value <= 0:
            name = "concurrency" if self.mode == "closed" else "rate"
            raise ConfigError(f"{name} must be positive, got {self.value:g}")
        if self.mode == "closed" and self.value != int(self.value):
            raise ConfigError(f"concurrency must be a whole number, got {self.value:g}")

    @property
    def concurrency(self) -> int:
        """Workers of a closed-loop level."""
        return int(self.value)

    @property
    def label(self) -> str:
        """Short name for tables and plots."""
        return f"c={self.concurrency}" if self.mode == "closed" else f"{self.value:g}/s"


@dataclass(frozen=True)
class LoadConfig:
    """Everything about a run except its levels; validated on construction."""

    target: str
    """host:port, or dns:///name:port to balance round-robin over every address."""
    model: str = DEFAULT_MODEL
    duration_s: float = 30.0
    """Measured window of each level."""
    warmup_s: float = 5.0
    """Load before each measured window whose requests are not counted."""
    input_kind: InputKind = "text"
    """`text`: BYTES input, the server tokenises; `tokens`: input_ids + attention_mask INT64."""
    tokenizer_path: Path | None = None
    """tokenizer.json for `tokens` input."""
    max_length: int = 256
    """Truncation of client-side tokenisation (tokens per sequence, special tokens included)."""
    batch_size: int = 1
    """Sequences per request."""
    mix: dict[str, float] = field(default_factory=lambda: {"short": 1.0})
    """Relative weights of request kinds, each drawn from one shipped corpus."""
    timeout_s: float = 10.0
    """Deadline of each request."""
    max_outstanding: int = 1000
    """Open loop: requests in flight beyond which scheduled sends are dropped (and counted)."""
    pool_size: int = 128
    """Distinct request messages built up front and cycled through."""
    seed: int = 0
    progress: bool = False
    """Show a progress bar on stderr."""
    security: ClientSecurity = field(default_factory=ClientSecurity)
    """TLS, mutual TLS and API key of every channel and call."""
    streaming: bool = False
    """Closed loop over ModelStreamInfer: each worker keeps one stream and sends its next request when
    the previous one's answer arrives (instead of one ModelInfer call per request)."""

    def __post_init__(self) -> None:
        if not _TARGET.match(self.target):
            raise ConfigError(f"target must be HOST:PORT or dns:///NAME:PORT, got {self.target!r}")
        if not self.model:
            raise ConfigError("model must not be empty")
        _check_positive(duration_s=self.duration_s, timeout_s=self.timeout_s)
        if not math.isfinite(self.warmup_s) or self.warmup_s < 0:
            raise ConfigError(f"warmup_s must be >= 0, got {self.warmup_s:g}")
        _check_positive(batch_size=self.batch_size, max_outstanding=self.max_outstanding, pool_size=self.pool_size)
        if self.max_length < 2:
            raise ConfigError(f"max_length must be at least 2, got {self.max_length}")
        if self.input_kind not in ("text", "tokens"):
            raise ConfigError(f"input must be text or tokens, got {self.input_kind!r}")
        if self.input_kind == "tokens" and self.tokenizer_path is None:
            raise ConfigError("tokens input needs a tokenizer (--tokenizer path/to/tokenizer.json)")
        if self.tokenizer_path is not None and not Path(self.tokenizer_path).is_file():
            raise ConfigError(f"tokenizer file not found: {self.tokenizer_path}")
        _check_mix(self.mix)

    def to_dict(self) -> dict[str, object]:
        """Plain values for JSON."""
        values = {item.name: getattr(self, item.name) for item in dataclasses.fields(self)}
        values["mix"] = dict(self.mix)
        values["tokenizer_path"] = None if self.tokenizer_path is None else str(self.tokenizer_path)
        values["security"] = self.security.describe()
        return values


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not math.isfinite(value) or value <= 0:
            raise ConfigError(f"{name} must be positive, got {value:g}")


def _check_mix(mix: dict[str, float]) -> None:
    if not mix:
        raise ConfigError("the request mix is empty")
    unknown = sorted(set(mix) - set(CORPORA))
    if unknown:
        raise ConfigError(f"unknown mix key {unknown[0]!r}; known: {', '.join(CORPORA)}")
    if any(not math.isfinite(weight) or weight < 0 for weight in mix.values()) or sum(mix.values()) <= 0:
        raise ConfigError("mix weights must be >= 0 with a positive sum")


def parse_levels(text: str, mode: Mode) -> tuple[Level, ...]:
    """`"1,8,32"` -> closed or open levels, in the given order."""
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or any(not item for item in items):
        raise ConfigError(f"load levels must be a comma-separated list of numbers, got {text!r}")
    try:
        values = [float(item) for item in items]
    except ValueError:
        raise ConfigError(f"load levels must be a comma-separated list of numbers, got {text!r}") from None
    return tuple(Level(mode, value) for value in values)


def parse_mix(text: str) -> dict[str, float]:
    """`"short=0.8,long=0.2"` -> `{"short": 0.8, "long": 0.2}` (validated)."""
    mix: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, separator, weight = item.partition("=")
        if not separator:
            raise ConfigError(f"mix entries look like short=0.8, got {item!r}")
        try:
            mix[name.strip()] = float(weight)
        except ValueError:
            raise ConfigError(f"mix weight of {name.strip()!r} is not a number: {weight!r}") from None
    _check_mix(mix)
    return mix
