"""Qwen3-Reranker: a causal LM whose score for a pair is the next token's "yes" against "no" at the last position.

Its model card builds each pair as one prompt (QWEN3_RERANKER_TEMPLATE: a chat prefix whose system
message asks for "yes" or "no", `<Instruct>: … <Query>: … <Document>: …`, and a suffix opening the
assistant's empty thinking block), reads the language-model logits of "yes" and "no" at the last
token and scores softmax([no, yes])[yes] = sigmoid(logit_yes - logit_no). The graph answers that one
logit, logit_yes - logit_no, as a one-label reranker's `logits`: the server's sigmoid gives the
model card's score.

The decoder is Qwen3's (export.families.qwen3) read at the last attended token, as the embedder reads it;
the language-model head is needed only at the rows of "yes" and "no" (lm_head, or the token
embeddings where they are tied).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch import Tensor, nn

from export.gate.references import yes_no as model_card
from export.heads.classifier import CLASSIFIER_UNGATED, labels_parameter, logits_output
from export.heads.head import Head, HeadFolder, HeadWeights, UnreadableHead
from export.layers.pooling import pool
from service.core.repository import P_LABELS, P_PAIR_TEMPLATE
from service.core.text_rules import PairTemplate

YES, NO = "yes", "no"
QWEN3_RERANKER_TEMPLATE = PairTemplate(
    prefix=(
        "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct"
        ' provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
    ),
    middle="<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}",
    suffix="<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    default_instruction="Given a web search query, retrieve relevant passages that answer the query",
)
"""Qwen3-Reranker's pair, as its model card's format_instruction, prefix and suffix build it."""
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
"""The special tokens the template's prefix and suffix hold: the tokenizer must have each as one token."""
SUPPORTED_MODEL_TYPES = ("qwen3",)
OUTPUT_NAMES = ("logits",)


class YesNoError(UnreadableHead):
    """A causal-LM folder that cannot be read as a yes/no reranker; the message names the problem."""


@dataclass(frozen=True)
class YesNoHead:
    """A yes/no reranker's head: the token ids whose logits it compares, and its one label."""

    yes_id: int
    no_id: int
    labels: tuple[str, ...] = (YES,)

    @property
    def num_labels(self) -> int:
        """Width of the logits: one, logit_yes - logit_no."""
        return len(self.labels)

    def to_dict(self) -> dict[str, object]:
        """Plain-data form, for parity.json."""
        return {"style": "yes_no", "yes_id": self.yes_id, "no_id": self.no_id, "labels": list(self.labels)}


def is_causal_lm(hf_config: dict) -> bool:
    """Whether a config.json declares a causal language model (`*ForCausalLM`)."""
    return any(str(name).endswith("ForCausalLM") for name in hf_config.get("architectures") or ())


def read_head(folder: Path, model_type: str) -> YesNoHead:
    """The ids of "yes" and "no" in the folder's tokenizer.json, which must hold the template's chat tokens too."""
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise YesNoError(
            f"a causal LM of model_type {model_type!r} is read as a yes/no reranker only with Qwen3-Reranker's"
            f" template (model_type {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise YesNoError(f"{path}: missing: a yes/no reranker's pairs are built from its tokenizer's tokens")
    tokenizer = Tokenizer.from_file(str(path))
    ids = {token: tokenizer.token_to_id(token) for token in (YES, NO, *CHAT_TOKENS)}
    missing = [token for token, token_id in ids.items() if token_id is None]
    if missing:
        raise YesNoError(f"{path}: Qwen3-Reranker's template needs the tokens {', '.join(map(repr, missing))}")
    return YesNoHead(ids[YES], ids[NO])


def head_weights(
    hf_config: dict, head: YesNoHead, encoder_weights: dict[str, Tensor], other_weights: dict[str, Tensor]
) -> dict[str, Tensor]:
    """The language-model head's rows of "no" and "yes" (in that order), from lm_head or the tied token embeddings."""
    unexpected = sorted(set(other_weights) - {"lm_head.weight"})
    if unexpected:
        raise YesNoError(f"unexpected weight {unexpected[0]!r} beside a causal LM's lm_head")
    matrix = other_weights.get("lm_head.weight")
    if matrix is None:
        if not hf_config.get("tie_word_embeddings", False):
            raise YesNoError("lm_head.weight is missing and config.json does not tie it to the token embeddings")
        matrix = encoder_weights["embed_tokens.weight"]
    if max(head.yes_id, head.no_id) >= matrix.shape[0]:
        raise YesNoError(f"the language-model head has {matrix.shape[0]} rows, fewer than the ids of yes and no")
    return {"weight": matrix[[head.no_id, head.yes_id]].to(torch.float32).clone()}


class YesNoReranker(nn.Module):
    """The decoder read at each row's last attended token: logit_yes - logit_no, [batch, 1]."""

    output_names = OUTPUT_NAMES

    def __init__(self, encoder: nn.Module, head: YesNoHead) -> None:
        super().__init__()
        self.config = encoder.config
        self.head_config = head
        self.encoder = encoder
        self.head = nn.Linear(encoder.config.d_model, 2, bias=False)
        """The language-model head's rows of "no" and "yes"."""

    def forward(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        """logit_yes - logit_no at the last attended token (its sigmoid is the model card's score)."""
        hidden, mask = self.encoder.hidden_states(input_ids, attention_mask)
        no_yes = self.head(pool(hidden, mask, "lasttoken", normalize=False))
        return no_yes[:, 1:] - no_yes[:, :1]


def is_yes_no_reranker(folder: Path, hf_config: dict) -> bool:
    """A causal LM without sentence-transformers modules is read as a yes/no reranker (with them, as an embedder)."""
    return is_causal_lm(hf_config) and not (folder / "modules.json").is_file()


def _read(source: HeadFolder, weights: HeadWeights) -> tuple[YesNoHead, dict[str, Tensor]]:
    """The ids of "yes" and "no", with the language-model head's rows of them."""
    try:
        head = read_head(source.folder, weights.model_type)
        return head, head_weights(source.hf_config, head, weights.encoder, weights.rest)
    except YesNoError as error:
        raise YesNoError(f"{source.folder}: {error}") from error


HEAD = Head(
    name="yes_no",
    config_type=YesNoHead,
    task="classify",
    claims=lambda source: is_yes_no_reranker(source.folder, source.hf_config),
    read=_read,
    wrap=YesNoReranker,
    outputs=logits_output,
    parameters=lambda head: {P_LABELS: labels_parameter(head), P_PAIR_TEMPLATE: QWEN3_RERANKER_TEMPLATE.to_json()},
    scores_pairs=is_yes_no_reranker,
    pooling=lambda source: ("lasttoken", False),
    pair_template=QWEN3_RERANKER_TEMPLATE,
    ungated=CLASSIFIER_UNGATED,
    library_check=model_card.published_check,
    library_stage="the model card: transformers' scoring on the source folder, for each published variant",
)
"""A causal LM's yes/no reranker (Qwen3-Reranker)."""
