"""Clipping long texts before tokenisation never changes the tokens that survive truncation."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from service.pipeline.tokenizer import CLIP_CHARS_PER_TOKEN, TextTokenizer

MAX_LENGTH = 32  # small, so that short generated texts already need clipping


@pytest.fixture(scope="module")
def tokenizer_file(default_folder: Path) -> Path:
    return default_folder / "tokenizer.json"


@pytest.fixture(scope="module")
def served(tokenizer_file: Path) -> TextTokenizer:
    return TextTokenizer(tokenizer_file, MAX_LENGTH)


@pytest.fixture(scope="module")
def reference(tokenizer_file: Path) -> Tokenizer:
    """The same tokenizer truncating the whole text, as sentence-transformers does."""
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=MAX_LENGTH)
    return tokenizer


def ids(served: TextTokenizer, text: str) -> list[int]:
    batch = served.encode([text])
    return [int(i) for i, m in zip(batch.input_ids[0], batch.attention_mask[0], strict=True) if m]


# Words, punctuation, accents, CJK (split per character), control and zero-width characters
# (removed by the normaliser), and whitespace runs: the cases where a cut could change tokens.
PIECES = st.sampled_from(
    [
        "the", "embedding", "unbelievably", "naïve", "Café", "東京", "😀", "don't", "U.S.A.", "3.14",
        ",", ".", "!", "-", " ", "  ", "\n", "\t", "\u200b", "\x00", "\x07", "\u0301", "e\u0301",
        "a" * 120, "x" * 40,
    ]
)  # fmt: skip


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(PIECES, min_size=1, max_size=400).map("".join))
def test_clipped_texts_tokenise_exactly_as_whole_ones(served: TextTokenizer, reference: Tokenizer, text: str) -> None:
    assert ids(served, text) == reference.encode(text).ids


def test_prose_is_clipped_to_the_first_window(served: TextTokenizer, reference: Tokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 2000
    clipped = served.clip(text)
    assert len(clipped) == CLIP_CHARS_PER_TOKEN * MAX_LENGTH
    assert ids(served, text) == reference.encode(text).ids


@pytest.mark.parametrize(
    "text",
    [
        "word " + " " * 50_000 + "late words that still count",  # a long run of spaces
        "\x00" * 30_000 + " real words after control characters",  # removed characters
        "y" * 50_000 + " and then words",  # one giant word ([UNK])
    ],
)
def test_texts_with_few_words_grow_the_window_or_are_not_clipped(
    served: TextTokenizer, reference: Tokenizer, text: str
) -> None:
    assert ids(served, text) == reference.encode(text).ids


@pytest.mark.parametrize(
    "word", ["cat", "time", "house", "number", "between", "question", "something", "government", "development"]
)
@pytest.mark.parametrize("separator", [" ", ", ", "  "])
def test_a_cut_near_the_last_kept_word_changes_nothing(
    served: TextTokenizer, reference: Tokenizer, word: str, separator: str
) -> None:
    # Single-token words of every length put the window's cut at every distance from the last kept token.
    text = separator.join([word] * 400)
    assert ids(served, text) == reference.encode(text).ids


def test_short_texts_are_untouched(served: TextTokenizer) -> None:
    assert served.clip("a short sentence") == "a short sentence"


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(PIECES, min_size=1, max_size=60).map("".join), min_size=2, max_size=4))
def test_a_text_alone_gets_the_rows_it_gets_in_a_batch(served: TextTokenizer, texts: list[str]) -> None:
    """Padding is to the longest text of the request: a text's row in a batch is its row alone, then padding."""
    batch = served.encode(texts)
    for row, text in enumerate(texts):
        alone = served.encode([text])
        length = alone.input_ids.shape[1]
        assert int(batch.attention_mask[row].sum()) == length
        for name in ("input_ids", "attention_mask", "token_type_ids"):
            single, batched = getattr(alone, name), getattr(batch, name)
            assert single.dtype == batched.dtype == "int64"
            assert single[0].tolist() == batched[row, :length].tolist(), name
