"""Sequence-classification heads: cross-encoder rerankers and text classifiers, on top of the encoder.

Each head reads the first position's hidden state ([CLS] / <s>), or ModernBERT's mean when its
config says so, as the Hugging Face `*ForSequenceClassification` models do, and answers raw
logits [batch, num_labels]:
- BERT: its pooler (dense + tanh), then the classifier;
- RoBERTa, XLM-RoBERTa, MPNet: dense + tanh, then out_proj;
- DistilBERT: pre_classifier + ReLU, then the classifier;
- ModernBERT: dense + its classifier activation + LayerNorm, then the classifier;
- DeBERTa-v2/v3: its ContextPooler (dense + pooler_hidden_act), then the classifier;
- EuroBERT: dense + GeLU, then the classifier, on the first position ("bos"), on the mean ("mean"), or on
  every position, the logits then averaged over the mask ("late", its default).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from export.families.family import EncoderSettings
from export.families.registry import classifier_model_types, classifier_style
from export.heads.head import GraphOutput, Head, HeadFolder, HeadWeights, Ungated, UnreadableHead
from export.layers.pooling import pool
from service.core.repository import P_LABELS

CLASSIFIER_SUFFIX = "ForSequenceClassification"
OUTPUT_NAMES = ("logits",)

# Head style -> (hidden layer, its LayerNorm or "", output layer), as the checkpoint names them.
_HEAD_LAYERS = {
    "bert": ("pooler.dense", "", "classifier"),
    "roberta": ("classifier.dense", "", "classifier.out_proj"),
    "distilbert": ("pre_classifier", "", "classifier"),
    "modernbert": ("head.dense", "head.norm", "classifier"),
    "deberta": ("pooler.dense", "", "classifier"),
    "eurobert": ("dense", "", "classifier"),
}
_ACTIVATIONS = {"tanh": torch.tanh, "relu": torch.relu, "gelu": nn.functional.gelu, "silu": nn.functional.silu}
_EUROBERT_POOLING = {"bos": "cls", "mean": "mean", "late": "late"}
"""EuroBERT's classifier_pooling -> what the head reads."""


class HeadError(UnreadableHead):
    """A classification checkpoint whose head cannot be built; the message names the problem."""


@dataclass(frozen=True)
class HeadConfig:
    """What a classification head is: its style and its labels, in id order."""

    style: str
    labels: tuple[str, ...]
    pooling: str = "cls"
    """What the head reads: the first position (cls), the mean over the mask (ModernBERT, EuroBERT may say so),
    or every position, its logits averaged over the mask (late: EuroBERT)."""
    activation: str = "tanh"
    layer_norm_eps: float | None = None
    """The LayerNorm after the activation (ModernBERT); None: no LayerNorm."""
    dense_bias: bool = True
    norm_bias: bool = True

    @property
    def num_labels(self) -> int:
        """Width of the logits."""
        return len(self.labels)

    def to_dict(self) -> dict[str, object]:
        """Plain-data form, for parity.json."""
        return {"style": self.style, "labels": list(self.labels)}


def is_classifier(hf_config: dict) -> bool:
    """Whether a config.json describes a sequence-classification model (a reranker or classifier)."""
    return any(str(name).endswith(CLASSIFIER_SUFFIX) for name in hf_config.get("architectures") or ())


def head_config(hf_config: dict, model_type: str) -> HeadConfig:
    """The head a classification config.json declares: its style from the architecture, labels from id2label."""
    style = classifier_style(model_type)
    if style is None:
        supported = ", ".join(classifier_model_types())
        raise HeadError(f"no sequence-classification head for {model_type!r} (supported: {supported})")
    id2label = hf_config.get("id2label") or {}
    count = hf_config.get("num_labels") or len(id2label) or 2
    try:
        labels = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(int(count)))
    except (TypeError, ValueError) as error:
        raise HeadError(f"config.json: num_labels {count!r} is not a count") from error
    if hf_config.get("problem_type") not in (
        None,
        "single_label_classification",
        "regression",
        "multi_label_classification",
    ):
        raise HeadError(f"config.json: unsupported problem_type {hf_config['problem_type']!r}")
    if style == "deberta":
        return _deberta_head(hf_config, labels)
    if style == "eurobert":
        return _eurobert_head(hf_config, labels)
    if style != "modernbert":
        return HeadConfig(style, labels, activation="relu" if style == "distilbert" else "tanh")
    activation = hf_config.get("classifier_activation", "gelu")
    pooling = hf_config.get("classifier_pooling", "cls")
    if activation not in _ACTIVATIONS or pooling not in ("cls", "mean"):
        raise HeadError(f"config.json: unsupported classifier_activation {activation!r} or pooling {pooling!r}")
    return HeadConfig(
        style,
        labels,
        pooling=pooling,
        activation=activation,
        layer_norm_eps=hf_config.get("norm_eps", 1e-5),
        dense_bias=hf_config.get("classifier_bias", False),
        norm_bias=hf_config.get("norm_bias", False),
    )


def _deberta_head(hf_config: dict, labels: tuple[str, ...]) -> HeadConfig:
    """DeBERTa's ContextPooler: the first position, dense (pooler_hidden_size wide) and pooler_hidden_act."""
    activation = hf_config.get("pooler_hidden_act", "gelu")
    if activation not in _ACTIVATIONS:
        raise HeadError(
            f"config.json: unsupported pooler_hidden_act {activation!r} (supported: {', '.join(_ACTIVATIONS)})"
        )
    width = hf_config.get("pooler_hidden_size", hf_config.get("hidden_size"))
    if width != hf_config.get("hidden_size"):
        raise HeadError(f"config.json: unsupported pooler_hidden_size {width} (only hidden_size)")
    return HeadConfig("deberta", labels, activation=activation)


def _eurobert_head(hf_config: dict, labels: tuple[str, ...]) -> HeadConfig:
    """EuroBERT's head: dense + GeLU + classifier, read where classifier_pooling says."""
    pooling = hf_config.get("classifier_pooling", "late")
    if pooling not in _EUROBERT_POOLING:
        raise HeadError(
            f"config.json: unsupported classifier_pooling {pooling!r} (supported: {', '.join(_EUROBERT_POOLING)})"
        )
    remote = hf_config.get("clf_pooling", pooling)
    if remote != pooling:  # the remote-code model's key, which transformers does not read
        raise HeadError(
            f"config.json: clf_pooling {remote!r} (EuroBERT's remote-code key) disagrees with classifier_pooling"
            f" {pooling!r}, which transformers reads"
        )
    return HeadConfig("eurobert", labels, pooling=_EUROBERT_POOLING[pooling], activation="gelu")


class ClassificationHead(nn.Module):
    """First position or mean -> dense -> activation (-> LayerNorm) -> output: logits (late: per position, averaged)."""

    def __init__(self, d_model: int, head: HeadConfig) -> None:
        super().__init__()
        self.pooling = head.pooling
        self.dense = nn.Linear(d_model, d_model, bias=head.dense_bias)
        self.activation = _ACTIVATIONS[head.activation]
        eps = head.layer_norm_eps
        self.norm = nn.Identity() if eps is None else nn.LayerNorm(d_model, eps=eps, bias=head.norm_bias)
        self.output = nn.Linear(d_model, head.num_labels)

    def _logits(self, pooled: Tensor) -> Tensor:
        return self.output(self.norm(self.activation(self.dense(pooled))))

    def forward(self, hidden: Tensor, mask: Tensor) -> Tensor:
        """Logits [batch, num_labels] from hidden states [batch, seq, d_model] and the float mask [batch, seq]."""
        if self.pooling == "late":
            return pool(self._logits(hidden), mask, "mean", normalize=False)
        return self._logits(pool(hidden, mask, self.pooling, normalize=False))


class SequenceClassifier(nn.Module):
    """The encoder with a classification head: (input_ids, attention_mask[, token_type_ids]) -> logits."""

    output_names = OUTPUT_NAMES

    def __init__(self, encoder: nn.Module, head: HeadConfig) -> None:
        super().__init__()
        self.config = encoder.config
        self.head_config = head
        self.encoder = encoder
        self.head = ClassificationHead(encoder.config.d_model, head)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        """Raw logits [batch, num_labels] (no activation: scores are the server's to make)."""
        hidden, mask = self.encoder.hidden_states(input_ids, attention_mask, token_type_ids)
        return self.head(hidden, mask)


def rename_head_weights(weights: dict[str, torch.Tensor], head: HeadConfig) -> dict[str, torch.Tensor]:
    """The head's weights under ClassificationHead's names, from the checkpoint's task-head weights."""
    dense, norm, output = _HEAD_LAYERS[head.style]
    layers = [("dense", dense, head.dense_bias), ("output", output, True)]
    if norm:
        layers.append(("norm", norm, head.norm_bias))
    renamed = {}
    for ours, theirs, has_bias in layers:
        for kind in ("weight", "bias") if has_bias else ("weight",):
            key = f"{theirs}.{kind}"
            if key not in weights:
                raise HeadError(f"classification head weight {key!r} is missing")
            renamed[f"{ours}.{kind}"] = weights[key].to(torch.float32)
    if renamed["output.weight"].shape[0] != head.num_labels:
        raise HeadError(
            f"the classifier gives {renamed['output.weight'].shape[0]} labels, config.json declares {head.num_labels}"
        )
    return renamed


class PairScorer(Protocol):
    """A pair scorer's head configuration (a classifier's, a yes/no reranker's): its labels, in id order."""

    labels: tuple[str, ...]


def labels_parameter(head: PairScorer) -> str:
    """The labels as config.pbtxt stores them: a JSON list in id order."""
    return json.dumps(list(head.labels))


def logits_output(config: EncoderSettings, head: PairScorer) -> tuple[GraphOutput, ...]:
    """A pair scorer's one output: its logits [batch, num_labels] (a classifier's, or a yes/no reranker's)."""
    return (GraphOutput(OUTPUT_NAMES[0], (len(head.labels),)),)


CLASSIFIER_UNGATED = Ungated(("int8",), "a classifier: published in fp32 and fp16 (int8 is not gated for logits)")
"""A pair scorer's variants: its logits are gated in fp32 and fp16, not int8."""


def _read(source: HeadFolder, weights: HeadWeights) -> tuple[HeadConfig, dict[str, torch.Tensor]]:
    """The head config.json declares, with its weights under ClassificationHead's names."""
    try:
        head = head_config(source.hf_config, weights.model_type)
        return head, rename_head_weights(weights.rest, head)
    except HeadError as error:
        raise HeadError(f"{source.folder}: {error}") from error


HEAD = Head(
    name="classifier",
    config_type=HeadConfig,
    task="classify",
    claims=lambda source: source.task == "classify",
    read=_read,
    wrap=SequenceClassifier,
    outputs=logits_output,
    parameters=lambda head: {P_LABELS: labels_parameter(head)},
    scores_pairs=lambda folder, hf_config: is_classifier(hf_config),
    ungated=CLASSIFIER_UNGATED,
)
"""A cross-encoder reranker's or a text classifier's head."""
