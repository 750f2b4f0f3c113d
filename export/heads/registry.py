"""The one list of task heads; adding one is its module and one line in HEADS."""

from __future__ import annotations

from pathlib import Path

from export.families.family import EncoderSettings
from export.heads import bge_m3, classifier, colbert, dense, splade, yes_no
from export.heads.head import GraphOutput, Head, HeadConfiguration, HeadFolder, embedder_outputs

HEADS: tuple[Head, ...] = (
    bge_m3.HEAD,
    yes_no.HEAD,
    classifier.HEAD,
    splade.HEAD,
    colbert.HEAD,
    dense.HEAD,
)
"""Every head the exporter puts on an encoder, in the order they are asked whether a folder is theirs."""
_BY_CONFIG: dict[type, Head] = {head.config_type: head for head in HEADS}


def head_of(config: object) -> Head:
    """The head a head configuration belongs to."""
    return _BY_CONFIG[type(config)]


def scores_pairs(folder: Path, hf_config: dict) -> bool:
    """Whether config.json makes a folder a pair scorer for one of the heads (its task is then classify)."""
    return any(head.scores_pairs is not None and head.scores_pairs(folder, hf_config) for head in HEADS)


def claiming_head(source: HeadFolder) -> Head | None:
    """The first head that claims a folder; None: a plain embedder (raises UnreadableHead for a broken head)."""
    return next((head for head in HEADS if head.claims(source)), None)


def graph_outputs(config: EncoderSettings, head: HeadConfiguration | None) -> tuple[GraphOutput, ...]:
    """The graph's outputs for an encoder and its head's configuration (None: a plain embedder)."""
    return embedder_outputs(config) if head is None else head_of(head).outputs(config, head)
