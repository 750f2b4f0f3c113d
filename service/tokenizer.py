"""Text -> token ids, configured from the model's own settings.

The bundled tokenizer.json of sentence-transformers models often carries truncation and fixed
padding to 128; the model is served with its own max sequence length and padded to the longest
text of a request, as sentence-transformers does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer


@dataclass(frozen=True)
class TokenizedBatch:
    """Token ids of several texts, padded to the longest; all arrays int64 [rows, length]."""

    input_ids: np.ndarray
    attention_mask: np.ndarray
    token_type_ids: np.ndarray

    def feed(
        self, input_names: Sequence[str] = ("input_ids", "attention_mask", "token_type_ids")
    ) -> dict[str, np.ndarray]:
        """The arrays by graph input name (only the names asked for)."""
        return {name: getattr(self, name) for name in input_names}


class TextTokenizer:
    """A `tokenizers` tokenizer with truncation at max_length and padding to the longest text."""

    def __init__(self, path: Path, max_length: int, pad_token_id: int | None = None) -> None:
        """pad_token_id None: the id the file gives its pad token."""
        self._tokenizer = Tokenizer.from_file(str(path))
        padding = self._tokenizer.padding or {}
        pad_token = padding.get("pad_token", "[PAD]")
        if pad_token_id is None:
            pad_token_id = padding.get("pad_id", self._tokenizer.token_to_id(pad_token) or 0)
        self._tokenizer.no_padding()
        self._tokenizer.enable_truncation(max_length=max_length)
        self._tokenizer.enable_padding(pad_id=pad_token_id, pad_token=pad_token, pad_type_id=0)

    def encode(self, texts: list[str]) -> TokenizedBatch:
        """Tokenise texts (with special tokens) into one padded batch."""
        encodings = self._tokenizer.encode_batch(texts)
        return TokenizedBatch(
            input_ids=np.array([e.ids for e in encodings], dtype=np.int64),
            attention_mask=np.array([e.attention_mask for e in encodings], dtype=np.int64),
            token_type_ids=np.array([e.type_ids for e in encodings], dtype=np.int64),
        )
