"""A checkpoint's weight names: a wrapper's prefix taken off, the body's weights and the task heads' apart."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from export.checkpoints.architecture_error import ArchitectureError


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
