"""The error every checkpoint reader raises (the family registry, each family's readers)."""

from __future__ import annotations


class ArchitectureError(ValueError):
    """A config.json or weight that the architecture cannot be built from; the message names it."""
