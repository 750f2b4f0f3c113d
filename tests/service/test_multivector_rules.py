"""The server's multi-vector and bge-m3 sparse rules on known rows: tokenisation, kept positions, MaxSim, terms."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from service.core.rows import TokenRows
from service.core.text_rules import MultiVectorSpec
from service.pipeline import multivector
from service.pipeline.sparse import token_terms
from service.pipeline.tokenizer import TextTokenizer
from tests.conftest import DEFAULT_MODEL

MASK, PREFIX = 103, 1  # [MASK] and [unused0] in the default model's WordPiece vocabulary


def test_queries_are_prefixed_and_expanded_documents_only_prefixed(default_repository: Path) -> None:
    tokenizer = TextTokenizer(default_repository / DEFAULT_MODEL / "tokenizer.json", 256)
    plain = tokenizer.encode_rows(["a cat sat"])
    queries = tokenizer.encode_marked_rows(["a cat sat"], 8, PREFIX, MASK)
    ids = plain.input_ids.tolist()
    assert queries.input_ids.tolist() == [ids[0], PREFIX, *ids[1:], MASK, MASK]
    assert queries.attention_mask.tolist() == [1] * (len(ids) + 1) + [0, 0]
    attended = tokenizer.encode_marked_rows(["a cat sat"], 8, PREFIX, MASK, attend_expansion=True)
    assert attended.attention_mask is None and attended.lengths.tolist() == [8]
    long = tokenizer.encode_marked_rows(["a cat sat on the mat by the door"], 6, PREFIX)
    assert long.lengths.tolist() == [6] and long.input_ids[1] == PREFIX and long.input_ids[-1] == ids[-1]


def test_kept_positions_follow_each_rule() -> None:
    rows = TokenRows(
        np.array([2, 9, 5, 7, 3, 2, 9, 6, 3, 4, 4]),
        np.array([5, 6]),
        6,
        np.array([1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0]),
    )
    colbert = MultiVectorSpec(query_expansion_id=4, document_skip_ids=(5,))
    assert [k.tolist() for k in multivector.kept_positions(rows, colbert, "document")] == [[0, 1, 3, 4], [0, 1, 2, 3]]
    assert [k.tolist() for k in multivector.kept_positions(rows, colbert, "query")] == [[0, 1, 2, 3, 4], list(range(6))]
    bge_m3 = MultiVectorSpec(score="mean", skip_first_token=True)
    assert [k.tolist() for k in multivector.kept_positions(rows, bge_m3, "document")] == [[1, 2, 3, 4], [1, 2, 3]]


def test_maxsim_sums_or_averages_each_query_vectors_best_match() -> None:
    query = np.array([[1.0, 0.0], [0.0, 1.0]], dtype=np.float32)
    document = np.array([[0.6, 0.8], [1.0, 0.0]], dtype=np.float32)
    assert np.isclose(multivector.maxsim(query, document, "sum"), 1.8)
    assert np.isclose(multivector.maxsim(query, document, "mean"), 0.9)
    array, lengths = multivector.padded([document, document[:1]], 2)
    assert array.shape == (2, 2, 2) and lengths.tolist() == [2, 1] and not array[1, 1].any()


def test_token_terms_take_each_ids_largest_positive_weight() -> None:
    rows = TokenRows(np.array([0, 7, 8, 7, 2, 0, 9, 2]), np.array([5, 3]), 5)
    weights = np.zeros((2, 5, 1), dtype=np.float32)
    weights[0, :5, 0] = [0.0, 0.2, 0.5, 0.4, 0.0]
    weights[1, :3, 0] = [0.0, 0.3, 0.0]
    indices, values = token_terms(rows, weights, top_k=None)
    assert indices.tolist() == [[8, 7], [9, -1]]
    np.testing.assert_allclose(values, [[0.5, 0.4], [0.3, 0.0]])
    indices, _ = token_terms(rows, weights, top_k=1)
    assert indices.tolist() == [[8], [9]]


def test_rows_join_and_split_back() -> None:
    first = TokenRows(np.array([1, 2, 3]), np.array([3]), 3)
    second = TokenRows(np.array([4, 5, 6, 7]), np.array([2, 2]), 2, np.array([1, 0, 1, 1]))
    joined = first.joined(second)
    assert joined.width == 3 and joined.attention_mask.tolist() == [1, 1, 1, 1, 0, 1, 1]
    head, tail = joined.split(1)
    assert head.input_ids.tolist() == [1, 2, 3] and tail.lengths.tolist() == [2, 2]
    assert tail.attention_mask.tolist() == [1, 0, 1, 1]
