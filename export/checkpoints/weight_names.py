"""A checkpoint's weight names: a wrapper's prefix taken off, the body's weights and the task heads' apart.

Two shapes: a checkpoint whose body is named as the encoder names it (split_weights), and one whose modules
are renamed onto the encoder's, layer by layer (ModuleRenames, with the BERT-shaped tables several families
share).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from export.checkpoints.architecture_error import ArchitectureError

BERT_EMBEDDINGS = {
    "embeddings.word_embeddings": "embeddings.token",
    "embeddings.token_type_embeddings": "embeddings.segment",
    "embeddings.LayerNorm": "embeddings.norm",
}
"""A BERT-shaped checkpoint's embedding modules -> the encoders' (export.families.bert, deberta, rotary_bert)."""
BERT_ATTENTION_OUTPUT = {"attention.output.dense": "attention.output", "attention.output.LayerNorm": "attention_norm"}
"""A BERT-shaped checkpoint layer's attention output and its LayerNorm -> the post-norm encoders' (bert, deberta)."""
BERT_FEED_FORWARD = {
    "intermediate.dense": "feed_forward.inner",
    "output.dense": "feed_forward.outer",
    "output.LayerNorm": "output_norm",
}
"""A BERT-shaped checkpoint layer's feed-forward network and its LayerNorm -> the post-norm encoders' (likewise)."""


def unwrapped(key: str, wrappers: Sequence[str]) -> str:
    """A weight's name without the first of `wrappers` it starts with (model., 0.auto_model., ...)."""
    for prefix in wrappers:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key


def split_weights(
    weights: dict[str, Tensor], wrappers: Sequence[str], body: tuple[str, ...], heads: tuple[str, ...]
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The body's weights (names starting with `body`) and the heads' (with `heads`), unwrapped, names kept.

    Any other weight is refused (ArchitectureError naming it): nothing in the folder is left unread.
    """
    kept: dict[str, Tensor] = {}
    head_weights: dict[str, Tensor] = {}
    for original, tensor in weights.items():
        key = unwrapped(original, wrappers)
        if key.startswith(heads):
            head_weights[key] = tensor
        elif key.startswith(body):
            kept[key] = tensor
        else:
            raise ArchitectureError(f"unexpected weight {original!r}")
    return kept, head_weights


class Slot(NamedTuple):
    """Where a checkpoint module lands: the encoder's module, as part `part` of `parts` of it.

    Parts are joined along the first axis (Q, K and V in one matrix); a whole module is part 0 of 1.
    """

    module: str
    part: int = 0
    parts: int = 1


def as_slot(place: str | Slot) -> Slot:
    """A table's entry as a slot (a plain name: the whole module)."""
    return Slot(place) if isinstance(place, str) else place


@dataclass(frozen=True)
class ModuleRenames:
    """How a checkpoint whose modules are named otherwise than the encoder's is read onto it."""

    wrappers: tuple[str, ...]
    """Prefixes that wrap the base model in task models and sentence-transformers modules (the first one taken off)."""
    heads: tuple[str, ...]
    """Task heads' weights, returned apart under their unwrapped names."""
    layers: str
    """A regular expression for the name of the layer list, before a layer's index (encoder\\.layer)."""
    layer_modules: Mapping[str, str | Slot]
    """A layer's modules -> the encoder layer's."""
    other_modules: Mapping[str, str]
    """Modules outside the layers (embeddings, ...) -> the encoder's."""
    unread: tuple[str, ...] = ()
    """Saved values no module reads: a buffer by its last name (position_ids), or a whole name."""
    norm_aliases: bool = False
    """LayerNorm's gamma and beta read as weight and bias (the oldest BERT checkpoints' names)."""

    def split(self, weights: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """The encoder's weights under its names (parts joined), and the task heads' apart.

        Any other weight, or one given twice, is refused (ArchitectureError naming it).
        """
        parts: dict[str, dict[int, Tensor]] = {}
        counts: dict[str, int] = {}
        heads: dict[str, Tensor] = {}
        for original, tensor in weights.items():
            key = unwrapped(original, self.wrappers)
            if self.norm_aliases:
                key = key.replace(".gamma", ".weight").replace(".beta", ".bias")
            if key in self.unread or key.rpartition(".")[2] in self.unread:
                continue
            if key.startswith(self.heads):
                heads[key] = tensor
                continue
            place = self._place(key)
            if place is None:
                raise ArchitectureError(f"unexpected weight {original!r}")
            name, part, count = place
            if counts.setdefault(name, count) != count or part in parts.setdefault(name, {}):
                raise ArchitectureError(f"weight {original!r} given twice (in two namings)")
            parts[name][part] = tensor
        encoder = {}
        for name, pieces in parts.items():
            if len(pieces) != counts[name]:
                raise ArchitectureError(f"{name}: {len(pieces)} of its {counts[name]} parts in the checkpoint")
            encoder[name] = pieces[0] if len(pieces) == 1 else torch.cat([pieces[i] for i in range(len(pieces))])
        return encoder, heads

    def _place(self, key: str) -> tuple[str, int, int] | None:
        """(the encoder's weight name, part, parts) of an unwrapped weight name; None: no module of it is read."""
        layer = re.match(rf"^(?:{self.layers})\.(\d+)\.(.+)\.(weight|bias)$", key)
        if layer:
            index, module, kind = layer.groups()
            if module not in self.layer_modules:
                return None
            slot = as_slot(self.layer_modules[module])
            return f"layers.{index}.{slot.module}.{kind}", slot.part, slot.parts
        module, _, kind = key.rpartition(".")
        return (f"{self.other_modules[module]}.{kind}", 0, 1) if module in self.other_modules else None
