"""The error every checkpoint reader raises: export.architectures and the encoders' own (export.modernbert)."""

from __future__ import annotations


class ArchitectureError(ValueError):
    """A config.json or weight that the architecture cannot be built from; the message names it."""
