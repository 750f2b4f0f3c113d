"""A model's text rules beyond one text in, one vector out: multi-vector (late-interaction) models and prompted pairs.

Both are read from a repository's parameters (service.core.repository) and written by the exporter.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class MultiVectorSpec:
    """A multi-vector (late-interaction) model's rules: tokenising queries and documents, keeping vectors, scoring.

    Which positions' vectors are a text's, and how a query scores a document (MaxSim).
    PyLate's ColBERT models insert a prefix token after the first special token ([Q] for queries, [D]
    for documents), pad queries to a fixed length with an expansion token ([MASK]) that is not attended
    to (unless attend_to_expansion_tokens) but whose vectors are kept, and drop the vectors of
    punctuation from documents. bge-m3's ColBERT head drops the first position ([CLS]/<s>).
    """

    score: str = "sum"
    """MaxSim over query tokens: sum (ColBERT, PyLate) or mean (bge-m3) of each one's best document match."""
    skip_first_token: bool = False
    """The first position's vector is not one of the text's (bge-m3)."""
    query_prefix_id: int | None = None
    """Token id inserted after a query's first token; None: none."""
    document_prefix_id: int | None = None
    query_length: int | None = None
    """A query's tokens, prefix and special tokens included (its truncation, and its expansion's length);
    None: the model's max_sequence_length."""
    document_length: int | None = None
    query_expansion_id: int | None = None
    """Queries are padded to query_length with this id, their vectors kept; None: no expansion."""
    attend_to_expansion_tokens: bool = False
    document_skip_ids: tuple[int, ...] = ()
    """Ids whose vectors are dropped from documents (punctuation)."""

    def to_json(self) -> str:
        """The config.pbtxt parameter's value."""
        fields = dataclasses.asdict(self)
        fields["document_skip_ids"] = list(self.document_skip_ids)
        return json.dumps(fields, sort_keys=True)


MULTIVECTOR_SCORES = ("sum", "mean")
PAIR_FIELDS = ("instruction", "query", "document")
"""The placeholders of a pair template's middle, each there exactly once."""
PAIR_PLACEHOLDER = re.compile(r"\{(" + "|".join(PAIR_FIELDS) + r")\}")


@dataclass(frozen=True)
class PairTemplate:
    """A (query, document) pair as one prompted sequence: prefix + middle (placeholders filled) + suffix.

    As Qwen3-Reranker's model card builds it: the prefix and the suffix are tokenised alone, without
    special tokens, and kept whole; the filled middle is tokenised alone and truncated at its end to
    the model's length less theirs.
    """

    prefix: str
    middle: str
    """Holds {instruction}, {query} and {document} once each; no other braces are read."""
    suffix: str
    default_instruction: str
    """The instruction a request naming none gets."""

    def filled(self, query: str, document: str, instruction: str | None = None) -> str:
        """The middle with its placeholders replaced (in one pass: a query holding "{document}" stays as it is)."""
        values = {"instruction": self.default_instruction if instruction is None else instruction}
        values |= {"query": query, "document": document}
        return PAIR_PLACEHOLDER.sub(lambda match: values[match.group(1)], self.middle)

    def to_json(self) -> str:
        """The config.pbtxt parameter's value."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)
