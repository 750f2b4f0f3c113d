"""SPLADE sparse embedders: the encoder, its masked-language-model head, and SPLADE pooling.

The masked-LM head is the one transformers' `*ForMaskedLM` models put on the encoder's last
hidden states: dense, activation, LayerNorm, then a decoder to the vocabulary (its weight the
word embeddings when the config ties them) plus a bias per token. Each family names its layers
its own way and picks its activation its own way:
- BERT: `cls.predictions.transform.{dense, LayerNorm}`, config.hidden_act, `cls.predictions.bias`;
- RoBERTa, XLM-RoBERTa, MPNet: `lm_head.{dense, layer_norm}`, exact GELU always, `lm_head.bias`;
- DistilBERT: `vocab_transform`, `vocab_layer_norm` (eps 1e-12), config.activation, `vocab_projector.bias`.
Pooling is sentence-transformers' `SpladePooling`: log(1 + relu(logits)) (applied twice for its
log1p_relu activation) with padding masked out, then the maximum (or sum) over tokens: a
[batch, vocab_size] vector per text.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from export.gate.references.library import check_masked_lm
from export.heads.head import (
    GraphOutput,
    Head,
    HeadFolder,
    HeadWeights,
    ModelReference,
    ReferenceInputs,
    Ungated,
    UnreadableHead,
)

SPARSE_OUTPUT = "sparse_embedding"
POOLING_STRATEGIES = ("max", "sum")
ACTIVATION_FUNCTIONS = ("relu", "log1p_relu")
"""SpladePooling's activations: log1p(relu(x)), or log1p applied once more (OpenSearch's SPLADE models)."""
_HEAD_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


@dataclass(frozen=True)
class _HeadLayout:
    """How one family's masked-LM head names its layers and chooses its activation."""

    dense: str
    norm: str
    decoder: str
    bias: str
    activation_key: str | None
    """config.json key naming the activation; None: exact GELU whatever the config says."""
    fixed_eps: float | None = None
    """The LayerNorm's epsilon where the family hard-codes it (DistilBERT); None: config.json's layer_norm_eps."""


_BERT_HEAD = _HeadLayout(
    "cls.predictions.transform.dense",
    "cls.predictions.transform.LayerNorm",
    "cls.predictions.decoder",
    "cls.predictions.bias",
    "hidden_act",
)
_ROBERTA_HEAD = _HeadLayout("lm_head.dense", "lm_head.layer_norm", "lm_head.decoder", "lm_head.bias", None)
_HEAD_LAYOUTS = {
    "bert": _BERT_HEAD,
    "roberta": _ROBERTA_HEAD,
    "xlm-roberta": _ROBERTA_HEAD,
    "mpnet": _ROBERTA_HEAD,
    "distilbert": _HeadLayout(
        "vocab_transform", "vocab_layer_norm", "vocab_projector", "vocab_projector.bias", "activation", 1e-12
    ),
}


class SpladeError(UnreadableHead):
    """A SPLADE checkpoint whose head or pooling cannot be built; the message names the problem."""


@dataclass(frozen=True)
class SpladeConfig:
    """The masked-LM head (its family's layout and activation) and the SPLADE pooling on top of it."""

    model_type: str
    head_activation: str
    layer_norm_eps: float
    tied_decoder: bool
    """Whether the decoder's weight is the word embeddings (config.json tie_word_embeddings)."""
    pooling_strategy: str = "max"
    activation_function: str = "relu"

    def to_dict(self) -> dict[str, object]:
        """Plain-data form, for parity.json."""
        return {
            "style": "splade",
            "masked_lm_head": self.model_type,
            "head_activation": self.head_activation,
            "tied_decoder": self.tied_decoder,
            "pooling_strategy": self.pooling_strategy,
            "activation_function": self.activation_function,
        }


def splade_config(hf_config: dict, model_type: str, pooling_strategy: str, activation_function: str) -> SpladeConfig:
    """The SPLADE model a masked-LM config.json and a SpladePooling configuration describe, checked."""
    layout = _HEAD_LAYOUTS.get(model_type)
    if layout is None:
        raise SpladeError(f"no masked-LM head implemented for {model_type!r} (supported: {', '.join(_HEAD_LAYOUTS)})")
    activation = "gelu" if layout.activation_key is None else hf_config.get(layout.activation_key, "gelu")
    if activation not in _HEAD_ACTIVATIONS:
        raise SpladeError(
            f"config.json: masked-LM head activation {layout.activation_key} {activation!r} is not supported"
            f" (supported: {', '.join(_HEAD_ACTIVATIONS)})"
        )
    if pooling_strategy not in POOLING_STRATEGIES or activation_function not in ACTIVATION_FUNCTIONS:
        raise SpladeError(
            f"SpladePooling {pooling_strategy!r} with {activation_function!r} is not supported"
            f" (pooling_strategy {' or '.join(POOLING_STRATEGIES)}, activation_function"
            f" {' or '.join(ACTIVATION_FUNCTIONS)})"
        )
    eps = layout.fixed_eps if layout.fixed_eps is not None else hf_config.get("layer_norm_eps", 1e-12)
    return SpladeConfig(
        model_type,
        activation,
        float(eps),
        bool(hf_config.get("tie_word_embeddings", True)),
        pooling_strategy,
        activation_function,
    )


def rename_head_weights(weights: dict[str, Tensor], word_embeddings: Tensor, splade: SpladeConfig) -> dict[str, Tensor]:
    """The head's weights under MaskedLMHead's names, from the checkpoint's.

    Tied (transformers' default), the decoder's weight is the word embeddings and its bias the
    head's own (`cls.predictions.bias`, `lm_head.bias`); untied, transformers ties neither and the
    decoder's weight and bias are read as stored under the decoder's name.
    """
    layout = _HEAD_LAYOUTS[splade.model_type]
    wanted = {
        "dense.weight": f"{layout.dense}.weight",
        "dense.bias": f"{layout.dense}.bias",
        "norm.weight": f"{layout.norm}.weight",
        "norm.bias": f"{layout.norm}.bias",
        "decoder.bias": layout.bias,
    }
    if not splade.tied_decoder:
        wanted |= {"decoder.weight": f"{layout.decoder}.weight", "decoder.bias": f"{layout.decoder}.bias"}
    renamed = {}
    for ours, theirs in wanted.items():
        if theirs not in weights:
            raise SpladeError(f"masked-LM head weight {theirs!r} is missing")
        renamed[ours] = weights[theirs].to(torch.float32)
    if splade.tied_decoder:
        renamed["decoder.weight"] = word_embeddings.to(torch.float32).clone()
    if tuple(renamed["decoder.weight"].shape) != tuple(word_embeddings.shape):
        raise SpladeError(
            f"masked-LM decoder {layout.decoder}.weight has shape {tuple(renamed['decoder.weight'].shape)},"
            f" the word embeddings {tuple(word_embeddings.shape)}"
        )
    if tuple(renamed["decoder.bias"].shape) != (word_embeddings.shape[0],):
        raise SpladeError(f"masked-LM decoder bias has shape {tuple(renamed['decoder.bias'].shape)}")
    return renamed


class MaskedLMHead(nn.Module):
    """Hidden states -> dense -> activation -> LayerNorm -> decoder + bias: logits over the vocabulary."""

    def __init__(self, d_model: int, vocab_size: int, splade: SpladeConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(d_model, d_model)
        self.activation = _HEAD_ACTIVATIONS[splade.head_activation]
        self.norm = nn.LayerNorm(d_model, eps=splade.layer_norm_eps)
        self.decoder = nn.Linear(d_model, vocab_size)

    def forward(self, hidden: Tensor) -> Tensor:
        """Logits [batch, seq, vocab_size] from hidden states [batch, seq, d_model]."""
        return self.decoder(self.norm(self.activation(self.dense(hidden))))


def splade_pool(logits: Tensor, mask: Tensor, strategy: str, activation_function: str) -> Tensor:
    """SpladePooling: log1p(relu(logits x mask)) (twice for log1p_relu), then max or sum over tokens."""
    weights = torch.log1p(torch.relu(logits * mask.unsqueeze(-1)))
    if activation_function == "log1p_relu":
        weights = torch.log1p(weights)
    return weights.amax(dim=1) if strategy == "max" else weights.sum(dim=1)


class SpladeEncoder(nn.Module):
    """The encoder, its masked-LM head and SPLADE pooling: (input_ids, attention_mask[, token_type_ids]) -> sparse."""

    output_names = (SPARSE_OUTPUT,)

    def __init__(self, encoder: nn.Module, splade: SpladeConfig) -> None:
        super().__init__()
        self.config = encoder.config
        self.head_config = splade
        self.encoder = encoder
        self.head = MaskedLMHead(encoder.config.d_model, encoder.config.vocab_size, splade)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        """The sparse embedding [batch, vocab_size]: each token id's weight for the text (0 for most)."""
        hidden, mask = self.encoder.hidden_states(input_ids, attention_mask, token_type_ids)
        return splade_pool(
            self.head(hidden), mask, self.head_config.pooling_strategy, self.head_config.activation_function
        )


def _read(source: HeadFolder, weights: HeadWeights) -> tuple[SpladeConfig, dict[str, Tensor]]:
    """The masked-LM head and SPLADE pooling the folder declares, checked, with the head's weights."""
    declarations = source.declarations
    strategy, activation = declarations.splade_pooling
    try:
        splade = splade_config(source.hf_config, weights.model_type, strategy, activation)
    except SpladeError as error:
        where = declarations.pooling_file if str(error).startswith("SpladePooling") else source.folder
        raise SpladeError(f"{where}: {error}") from error
    word_embeddings = weights.encoder["embeddings.token.weight"]  # the BERT family's (splade_config checked it)
    if declarations.splade_dimension not in (None, word_embeddings.shape[0]):
        raise SpladeError(
            f"{declarations.pooling_file}: embedding dimension {declarations.splade_dimension}"
            f" is not the vocabulary's size {word_embeddings.shape[0]}"
        )
    try:
        return splade, rename_head_weights(weights.rest, word_embeddings, splade)
    except SpladeError as error:
        raise SpladeError(f"{source.folder}: {error}") from error


def _masked_lm_reference(run: ReferenceInputs, model: nn.Module) -> tuple[dict[str, object], list[str]]:
    """The PyTorch model against transformers' AutoModelForMaskedLM on the folder, pooled by hand."""
    return check_masked_lm(run.checkpoint, model, run.tokenizer, run.input_names, run.sentences)


HEAD = Head(
    name="splade",
    config_type=SpladeConfig,
    task="sparse",
    claims=lambda source: source.task == "sparse",
    read=_read,
    wrap=SpladeEncoder,
    outputs=lambda config, splade: (GraphOutput(SPARSE_OUTPUT, (config.vocab_size,)),),
    ungated=Ungated(
        ("int8", "fp16"),
        "a sparse embedder: published in fp32 only (int8 and fp16 are not gated for sparse embeddings)",
    ),
    model_references=(
        ModelReference(
            stage="transformers: the PyTorch model against AutoModelForMaskedLM on the source folder",
            library="transformers",
            report_key="masked_lm_reference",
            needs_tokenizer=True,
            check=_masked_lm_reference,
        ),
    ),
)
"""A sparse embedder's masked-LM head and SPLADE pooling."""
