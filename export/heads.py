"""Sequence-classification heads: cross-encoder rerankers and text classifiers, on top of the encoder.

Each head reads the first position's hidden state ([CLS] / <s>), as the Hugging Face
`*ForSequenceClassification` models do, and answers raw logits [batch, num_labels]:
- BERT: its pooler (dense + tanh), then the classifier;
- RoBERTa, XLM-RoBERTa, MPNet: dense + tanh, then out_proj;
- DistilBERT: pre_classifier + ReLU, then the classifier.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from export.config import EncoderConfig
from export.model import Encoder

CLASSIFIER_SUFFIX = "ForSequenceClassification"
OUTPUT_NAMES = ("logits",)

# Head style -> (hidden layer, its activation, output layer), as the checkpoint names them.
_HEAD_LAYERS = {
    "bert": ("pooler.dense", "tanh", "classifier"),
    "roberta": ("classifier.dense", "tanh", "classifier.out_proj"),
    "distilbert": ("pre_classifier", "relu", "classifier"),
}
_HEAD_STYLE = {
    "bert": "bert",
    "roberta": "roberta",
    "xlm-roberta": "roberta",
    "mpnet": "roberta",
    "distilbert": "distilbert",
}


class HeadError(ValueError):
    """A classification checkpoint whose head cannot be built; the message names the problem."""


@dataclass(frozen=True)
class HeadConfig:
    """What a classification head is: its style and its labels, in id order."""

    style: str
    labels: tuple[str, ...]

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
    if model_type not in _HEAD_STYLE:
        raise HeadError(f"no sequence-classification head for {model_type!r} (supported: {', '.join(_HEAD_STYLE)})")
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
    return HeadConfig(_HEAD_STYLE[model_type], labels)


class ClassificationHead(nn.Module):
    """First position -> dense -> activation -> output layer: logits."""

    def __init__(self, d_model: int, head: HeadConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(d_model, d_model)
        self.activation = nn.Tanh() if _HEAD_LAYERS[head.style][1] == "tanh" else nn.ReLU()
        self.output = nn.Linear(d_model, head.num_labels)

    def forward(self, hidden: Tensor) -> Tensor:
        """Logits [batch, num_labels] from hidden states [batch, seq, d_model]."""
        return self.output(self.activation(self.dense(hidden[:, 0])))


class SequenceClassifier(nn.Module):
    """The encoder with a classification head: (input_ids, attention_mask[, token_type_ids]) -> logits."""

    output_names = OUTPUT_NAMES

    def __init__(self, config: EncoderConfig, head: HeadConfig) -> None:
        super().__init__()
        self.config = config
        self.head_config = head
        self.encoder = Encoder(config)
        self.head = ClassificationHead(config.d_model, head)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        """Raw logits [batch, num_labels] (no activation: scores are the server's to make)."""
        hidden, _ = self.encoder.hidden_states(input_ids, attention_mask, token_type_ids)
        return self.head(hidden)


def rename_head_weights(weights: dict[str, torch.Tensor], head: HeadConfig) -> dict[str, torch.Tensor]:
    """The head's weights under ClassificationHead's names, from the checkpoint's task-head weights."""
    dense, _, output = _HEAD_LAYERS[head.style]
    renamed = {}
    for ours, theirs in (("dense", dense), ("output", output)):
        for kind in ("weight", "bias"):
            key = f"{theirs}.{kind}"
            if key not in weights:
                raise HeadError(f"classification head weight {key!r} is missing")
            renamed[f"{ours}.{kind}"] = weights[key].to(torch.float32)
    if renamed["output.weight"].shape[0] != head.num_labels:
        raise HeadError(
            f"the classifier gives {renamed['output.weight'].shape[0]} labels, config.json declares {head.num_labels}"
        )
    return renamed


def labels_parameter(head: HeadConfig) -> str:
    """The labels as config.pbtxt stores them: a JSON list in id order."""
    return json.dumps(list(head.labels))
