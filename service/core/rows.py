"""Token rows: one request's sequences, each at its own length, as the batcher takes them.

The engine batches rows, not requests: a row keeps its own length until the batch it joins is
padded to that batch's longest. A request's rows travel as a few flat arrays (cheap to hand to
another thread or process): the ids of every row one after another, and each row's length.

Right padding carries no meaning, so it is dropped: a row ends at its last attended token. A
mask with zeros before that (left padding, holes) changes what the model computes — positions
count from the row's first slot — so such rows keep their slots and their mask.
"""

from __future__ import annotations

import msgspec
import numpy as np

_INT64 = np.int64


class TokenRows(msgspec.Struct, gc=False):
    """Token sequences of one request: the ids of every row concatenated, and each row's length.

    A msgspec Struct: built in C, at a quarter of a dataclass's cost (one per request on the engine's loop).
    """

    input_ids: np.ndarray
    """int64 [sum of lengths]."""
    lengths: np.ndarray
    """int64 [rows]: each row's length, up to and including its last attended token."""
    width: int
    """The request's own padded length: last_hidden_state is [rows, width, hidden]."""
    attention_mask: np.ndarray | None = None
    """int64 [sum of lengths], or None when every token of every row attends."""
    token_type_ids: np.ndarray | None = None
    """int64 [sum of lengths], or None when every segment id is 0."""

    @property
    def rows(self) -> int:
        """Sequences in the request."""
        return len(self.lengths)

    @property
    def real_tokens(self) -> int:
        """Attended tokens of all rows (special tokens included)."""
        if self.attention_mask is None:
            return len(self.input_ids)
        return int(np.count_nonzero(self.attention_mask))

    @classmethod
    def from_padded(cls, tokens: dict[str, np.ndarray]) -> TokenRows:
        """Rows from [rows, length] arrays (input_ids, attention_mask, optional token_type_ids): right padding dropped.

        The request's width stays the arrays' length. The mask is kept only where some row has a
        zero before its last attended token.
        """
        ids, mask = tokens["input_ids"], tokens["attention_mask"]
        width = ids.shape[1]
        attended = mask != 0
        # Each row ends after its last attended token (rows attend to at least one: the codec checks).
        lengths = (width - np.argmax(attended[:, ::-1], axis=1)).astype(_INT64)
        kept = np.arange(width) < lengths[:, None]
        needs_mask = bool((np.count_nonzero(attended, axis=1) != lengths).any())
        types = tokens.get("token_type_ids")
        if types is not None and not types.any():
            types = None
        return cls(
            input_ids=np.ascontiguousarray(ids[kept], dtype=_INT64),
            lengths=lengths,
            width=width,
            attention_mask=np.ascontiguousarray(mask[kept], dtype=_INT64) if needs_mask else None,
            token_type_ids=None if types is None else np.ascontiguousarray(types[kept], dtype=_INT64),
        )

    def padded(self, pad_token_id: int = 0) -> dict[str, np.ndarray]:
        """The rows as [rows, width] arrays, right-padded (the form the model and the fidelity check take)."""
        kept = np.arange(self.width) < self.lengths[:, None]
        ids = np.full((self.rows, self.width), pad_token_id, dtype=_INT64)
        ids[kept] = self.input_ids
        mask = kept.astype(_INT64)
        if self.attention_mask is not None:
            mask[kept] = self.attention_mask
        types = np.zeros((self.rows, self.width), dtype=_INT64)
        if self.token_type_ids is not None:
            types[kept] = self.token_type_ids
        return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
