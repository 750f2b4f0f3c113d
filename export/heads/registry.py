"""The one list of task heads; adding one is its module and one line in HEADS."""

from __future__ import annotations

from export.heads import bge_m3, classifier, colbert, dense, splade, yes_no
from export.heads.head import Head

HEADS: tuple[Head, ...] = (
    classifier.HEAD,
    yes_no.HEAD,
    splade.HEAD,
    colbert.HEAD,
    bge_m3.HEAD,
    dense.HEAD,
)
"""Every head the exporter puts on an encoder."""
_BY_CONFIG: dict[type, Head] = {head.config_type: head for head in HEADS}


def head_of(config: object) -> Head:
    """The head a head configuration belongs to."""
    return _BY_CONFIG[type(config)]
