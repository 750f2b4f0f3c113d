"""Segment (token type) embeddings, as the BERT-shaped encoders add them to their token embeddings."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class SegmentEmbedding(nn.Embedding):
    """The rows added for each token's segment.

    A single row is added to every token (RoBERTa: no input needed); else token_type_ids' rows (segment 0
    where none are given).
    """

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None) -> Tensor:
        """What to add to the token embeddings of input_ids [batch, seq]: [d_model] or [batch, seq, d_model]."""
        if self.num_embeddings == 1:
            return self.weight[0]
        return super().forward(torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids)
