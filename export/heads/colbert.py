"""ColBERT multi-vector models as PyLate saves them: the encoder, its Dense projection, a vector per position.

A PyLate folder chains sentence-transformers' Transformer and PyLate's Dense (`1_Dense`: a linear
projection, identity activation, optionally a bias and a residual); config_sentence_transformers.json
(model_type "ColBERT") says how texts are tokenised and which vectors are kept. The graph answers
`token_vectors` [batch, sequence, width]: every position's projected vector, L2-normalised (eps
1e-12), every position computed as the model computes it (the mask hides keys only), so a query's
unattended expansion tokens have their vectors too.

The rules published for the server (MultiVectorSpec) are PyLate's: a text truncated to its length
less one, the prefix token ([Q] / [D]) inserted after the first token; queries padded with the mask
token to query_length (unattended unless attend_to_expansion_tokens) and every position kept;
documents keep their attended positions whose ids are not in the skip list. The skip list is read as
PyLate reads it, since PyLate made the folder and scores with it: each skiplist word's id, a word
missing from the vocabulary mapped to the unknown token (transformers' `convert_tokens_to_ids`), so
that a document's unknown tokens are dropped too whenever a skiplist word is not in the vocabulary.
sentence-transformers' MultiVectorEncoder leaves such words out instead and keeps the unknown tokens.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import Tensor, nn

from export.gate.references.multivector import multivector_check
from export.heads.head import SEQUENCE, GraphOutput, Head, HeadFolder, HeadWeights, Ungated, UnreadableHead
from service.core.repository import P_MULTIVECTOR, TOKEN_VECTORS
from service.core.text_rules import MultiVectorSpec

IDENTITY_ACTIVATIONS = ("torch.nn.modules.linear.Identity",)
"""The Dense activations implemented (how sentence-transformers names nn.Identity)."""


class ColbertError(UnreadableHead):
    """A ColBERT folder whose projection or rules cannot be built; the message names the problem."""


@dataclass(frozen=True)
class ColbertConfig:
    """The Dense projection on the encoder's hidden states, and the rules the server applies to its vectors."""

    in_features: int
    out_features: int
    bias: bool
    use_residual: bool
    """The hidden state (or its `residual` projection, when the widths differ) is added to the projection."""
    rules: MultiVectorSpec

    @property
    def residual_projection(self) -> bool:
        """Whether the residual goes through its own linear layer (widths differ)."""
        return self.use_residual and self.in_features != self.out_features

    def to_dict(self) -> dict[str, object]:
        """Plain-data form, for parity.json."""
        return {
            "style": "colbert",
            "dense": {
                "in_features": self.in_features,
                "out_features": self.out_features,
                "bias": self.bias,
                "use_residual": self.use_residual,
            },
            "multivector": json.loads(self.rules.to_json()),
        }


def _token_name(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an object with its content."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _token_id(tokenizer: Tokenizer, token: str, what: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise ColbertError(f"{what} {token!r} is not a token of tokenizer.json")
    return token_id


def _length(declared: dict, key: str) -> int:
    value = declared.get(key)
    if type(value) is not int or value < 3:
        raise ColbertError(f"config_sentence_transformers.json: {key} must be an integer of at least 3, got {value!r}")
    return value


def _flag(declared: dict, key: str, default: bool) -> bool:
    value = declared.get(key, default)
    if type(value) is not bool:
        raise ColbertError(f"config_sentence_transformers.json: {key} must be true or false, got {value!r}")
    return value


def multivector_rules(declared: dict, tokenizer_folder: Path) -> MultiVectorSpec:
    """The server's rules from PyLate's config_sentence_transformers.json fields and the folder's tokenizer."""
    tokenizer = Tokenizer.from_file(str(tokenizer_folder / "tokenizer.json"))
    prefix_ids = []
    for key in ("query_prefix", "document_prefix"):
        prefix = declared.get(key, "")
        if not isinstance(prefix, str):
            raise ColbertError(f"config_sentence_transformers.json: {key} must be a string, got {prefix!r}")
        prefix_ids.append(_token_id(tokenizer, prefix, key) if prefix else None)
    settings_file = tokenizer_folder / "tokenizer_config.json"
    settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
    expansion_id = None
    if _flag(declared, "do_query_expansion", True):
        mask = _token_name(settings.get("mask_token"))
        if mask is None:
            raise ColbertError("query expansion without a mask token in tokenizer_config.json is not supported")
        expansion_id = _token_id(tokenizer, mask, "mask token")
    words = declared.get("skiplist_words", list(string.punctuation))
    if not isinstance(words, list) or not all(isinstance(word, str) for word in words):
        raise ColbertError("config_sentence_transformers.json: skiplist_words must be a list of strings")
    skip_ids = {tokenizer.token_to_id(word) for word in words}
    if None in skip_ids:  # PyLate's convert_tokens_to_ids: a word missing from the vocabulary is the unknown token
        skip_ids.remove(None)
        unknown = _token_name(settings.get("unk_token"))
        if unknown is None or tokenizer.token_to_id(unknown) is None:
            raise ColbertError(
                "skiplist_words holds words missing from the vocabulary, and tokenizer_config.json names no unknown"
                " token of it: PyLate's skip list cannot be read"
            )
        skip_ids.add(tokenizer.token_to_id(unknown))
    return MultiVectorSpec(
        score="sum",
        query_prefix_id=prefix_ids[0],
        document_prefix_id=prefix_ids[1],
        query_length=_length(declared, "query_length"),
        document_length=_length(declared, "document_length"),
        query_expansion_id=expansion_id,
        attend_to_expansion_tokens=_flag(declared, "attend_to_expansion_tokens", False),
        document_skip_ids=tuple(sorted(skip_ids)),
    )


def colbert_config(dense: dict, declared: dict, d_model: int, tokenizer_folder: Path) -> ColbertConfig:
    """The ColBERT model a PyLate Dense config.json and config_sentence_transformers.json describe, checked."""
    activation = dense.get("activation_function", IDENTITY_ACTIVATIONS[0])
    if activation not in IDENTITY_ACTIVATIONS:
        raise ColbertError(f"Dense activation_function {activation!r} is not supported (only the identity)")
    in_features, out_features = dense.get("in_features"), dense.get("out_features")
    if type(in_features) is not int or type(out_features) is not int or out_features <= 0:
        raise ColbertError(
            f"Dense in_features and out_features must be integers, got {in_features!r}, {out_features!r}"
        )
    if in_features != d_model:
        raise ColbertError(f"Dense in_features {in_features} is not the encoder's hidden size {d_model}")
    bias, use_residual = dense.get("bias", True), dense.get("use_residual", False)
    if type(bias) is not bool or type(use_residual) is not bool:
        raise ColbertError(f"Dense bias and use_residual must be true or false, got {bias!r}, {use_residual!r}")
    return ColbertConfig(in_features, out_features, bias, use_residual, multivector_rules(declared, tokenizer_folder))


def dense_weights(weights: dict[str, Tensor], colbert: ColbertConfig) -> dict[str, Tensor]:
    """The Dense module's weights under ColbertProjection's names (PyLate's own), checked name by name and shape."""
    expected = ColbertProjection(colbert).state_dict()
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise ColbertError(f"Dense weights: missing {missing}, unexpected {unexpected}")
    for name, tensor in expected.items():
        if tuple(weights[name].shape) != tuple(tensor.shape):
            raise ColbertError(f"Dense weight {name} has shape {tuple(weights[name].shape)}, not {tuple(tensor.shape)}")
    return {name: weights[name].to(torch.float32) for name in expected}


class ColbertProjection(nn.Module):
    """PyLate's Dense with the identity activation: linear (+ the hidden state, or its residual projection)."""

    def __init__(self, colbert: ColbertConfig) -> None:
        super().__init__()
        self.use_residual = colbert.use_residual
        self.linear = nn.Linear(colbert.in_features, colbert.out_features, bias=colbert.bias)
        self.residual = (
            nn.Linear(colbert.in_features, colbert.out_features, bias=False) if colbert.residual_projection else None
        )

    def forward(self, hidden: Tensor) -> Tensor:
        """Vectors [batch, seq, out_features] from hidden states [batch, seq, in_features]."""
        projected = self.linear(hidden)
        if self.use_residual:
            projected = projected + (hidden if self.residual is None else self.residual(hidden))
        return projected


class ColbertEncoder(nn.Module):
    """The encoder and its Dense projection: (input_ids, attention_mask[, token_type_ids]) -> token_vectors."""

    output_names = (TOKEN_VECTORS,)

    def __init__(self, encoder: nn.Module, colbert: ColbertConfig) -> None:
        super().__init__()
        self.config = encoder.config
        self.head_config = colbert
        self.encoder = encoder
        self.head = ColbertProjection(colbert)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        """Every position's L2-normalised vector [batch, seq, out_features]."""
        hidden, _ = self.encoder.hidden_states(input_ids, attention_mask, token_type_ids)
        return F.normalize(self.head(hidden), p=2, dim=-1, eps=1e-12)


def _read(source: HeadFolder, weights: HeadWeights) -> tuple[ColbertConfig, dict[str, Tensor]]:
    """The Dense projection and rules a PyLate folder declares, checked, with the projection's weights."""
    declarations = source.declarations
    try:
        colbert = colbert_config(declarations.dense, declarations.model_config, weights.d_model, source.folder)
        return colbert, dense_weights(weights.read_file(declarations.dense_folder), colbert)
    except ColbertError as error:
        raise ColbertError(f"{source.folder}: {error}") from error


HEAD = Head(
    name="colbert",
    config_type=ColbertConfig,
    task="multivector",
    claims=lambda source: source.task == "multivector",
    read=_read,
    wrap=ColbertEncoder,
    outputs=lambda config, colbert: (GraphOutput(TOKEN_VECTORS, (SEQUENCE, colbert.out_features)),),
    parameters=lambda colbert: {P_MULTIVECTOR: colbert.rules.to_json()},
    ungated=Ungated(
        ("int8", "fp16"), "a ColBERT model: published in fp32 only (int8 and fp16 are not gated for token vectors)"
    ),
    library_check=multivector_check,
)
"""A ColBERT model's projection of every token."""
