"""Pooling: one vector per sequence from the last hidden states, as sentence-transformers' Pooling module does.

Every mode honours any 0/1 attention mask (right- or left-padded, or with holes), so the graph
answers the same for a row wherever its padding is. PooledEncoder is every family's encoder's answer:
its hidden states and their pooled vector.
"""

from __future__ import annotations

from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Pooling = Literal["mean", "cls", "max", "lasttoken"]
POOLING_MODES: tuple[str, ...] = ("mean", "cls", "max", "lasttoken")


def pool(hidden: Tensor, mask: Tensor, mode: str, normalize: bool) -> Tensor:
    """Pool hidden [batch, seq, d] over the float mask [batch, seq] into [batch, d]; L2-normalised if asked.

    mean: average of attended positions; cls: the first position; max: element-wise maximum of
    attended positions; lasttoken: the last attended position.
    """
    if mode == "cls":
        pooled = hidden[:, 0]
    elif mode == "mean":
        weights = mask.unsqueeze(-1)
        pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
    elif mode == "max":
        # As sentence-transformers: padding positions are pushed far below any real value first.
        pooled = (hidden + (1.0 - mask.unsqueeze(-1)) * -1e9).max(dim=1).values
    elif mode == "lasttoken":
        positions = torch.arange(hidden.shape[1], device=hidden.device, dtype=mask.dtype)
        last = torch.argmax(mask * (positions + 1.0), dim=1)
        pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    else:
        raise ValueError(f"unsupported pooling {mode!r} (supported: {', '.join(POOLING_MODES)})")
    if normalize:
        pooled = F.normalize(pooled, p=2.0, dim=1)
    return pooled


class PoolingSettings(Protocol):
    """What pooling reads from an encoder's configuration."""

    pooling: str
    normalize: bool


class PooledEncoder(nn.Module):
    """An encoder answering (last_hidden_state, embedding): its hidden states, pooled as its configuration says.

    Each family's encoder derives from it and defines hidden_states(input_ids, attention_mask, token_type_ids)
    -> (last hidden states [batch, seq, d_model], float mask [batch, seq]), where task heads start too; an
    encoder with task adapters takes adapter_ids as well (the graph has that input only then).
    """

    output_names = ("last_hidden_state", "embedding")

    def __init__(self, config: PoolingSettings) -> None:
        super().__init__()
        self.config = config

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        token_type_ids: Tensor | None = None,
        adapter_ids: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Return (last_hidden_state [batch, seq, d_model], embedding [batch, d_model])."""
        adapters = {} if adapter_ids is None else {"adapter_ids": adapter_ids}
        hidden, mask = self.hidden_states(input_ids, attention_mask, token_type_ids, **adapters)
        return hidden, pool(hidden, mask, self.config.pooling, self.config.normalize)
