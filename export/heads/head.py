"""What a task head is, as each head module declares it at its end (export.heads.registry lists them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass(frozen=True)
class Head:
    """A task head: its configuration type, the task it serves, and how it wraps an encoder."""

    name: str
    config_type: type
    """The head's configuration class (one head a class)."""
    task: str
    """The served task: "embed", "classify", "sparse" or "multivector"."""
    wrap: Callable[[nn.Module, Any], nn.Module]
    """(encoder, the head's configuration) -> the model answering the head's outputs."""
