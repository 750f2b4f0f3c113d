"""A yes/no reranker's last gate: its model card's transformers code on the folder, against every published variant.

sentence-transformers' CrossEncoder loads a causal LM as a yes/no reranker only through a chat
template that renders its pairs' query and document roles, which Qwen3-Reranker's folder does not
ship (its template is Qwen3's chat template); the model card's own code is the reference. As the
card does it: the prefix and the suffix tokenised alone, each `<Instruct>: … <Query>: … <Document>: …`
tokenised with truncation at the length they leave, the batch padded on the left, and
logit("yes") - logit("no") read at the last position of AutoModelForCausalLM (the logit whose
sigmoid is the card's softmax([no, yes])[yes]). Each published variant, fed as the server feeds
it (right padding, each pair alone and in batches), must give the same logits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from export.gate.cases import SENTENCE_BATCH, sentence_pairs
from export.gate.references.library import LONG_TEXT_LABEL, LibraryReference, against, quiet_loading
from export.gate.references.loop import VariantCheck
from service.core.text_rules import PairTemplate
from service.pipeline.tokenizer import TextTokenizer

if TYPE_CHECKING:  # the heads list these checks, and the checkpoint lists the heads
    from export.checkpoints.checkpoint import Checkpoint


def model_card_logits(checkpoint: Checkpoint, pairs: list[tuple[str, str]], template: PairTemplate) -> np.ndarray:
    """logit("yes") - logit("no") per pair, [pairs, 1], as the model card scores them on the folder (fp32)."""
    import transformers  # noqa: PLC0415  (build-time only: the server never imports it)

    folder = str(checkpoint.folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, padding_side="left", local_files_only=True)
    with quiet_loading():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, local_files_only=True
        ).eval()
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    prefix = tokenizer.encode(template.prefix, add_special_tokens=False)
    suffix = tokenizer.encode(template.suffix, add_special_tokens=False)
    room = checkpoint.max_seq_length - len(prefix) - len(suffix)
    middles = [
        template.middle.format(instruction=template.default_instruction, query=query, document=document)
        for query, document in pairs
    ]
    logits = []
    for start in range(0, len(middles), SENTENCE_BATCH):
        encoded = tokenizer(
            middles[start : start + SENTENCE_BATCH],
            padding=False,
            truncation="longest_first",
            return_attention_mask=False,
            max_length=room,
        )
        rows = {"input_ids": [prefix + ids + suffix for ids in encoded["input_ids"]]}
        batch = tokenizer.pad(rows, padding=True, return_tensors="pt")
        with torch.inference_mode():
            # logits_to_keep=1: the language-model head at the last position only, as the card reads it
            # (every position's logits over a 151k vocabulary would be gigabytes per batch at full size).
            last = model(**batch, logits_to_keep=1).logits[:, -1, :]
        logits.append((last[:, yes] - last[:, no]).numpy()[:, None])
    return np.concatenate(logits).astype(np.float32)


def published_check(
    checkpoint: Checkpoint, tokenizer: TextTokenizer, input_names: list[str], sentences: list[str]
) -> VariantCheck:
    """The model card's scoring of the gate pairs (and one long pair, truncated), as each published variant's check."""
    import transformers  # noqa: PLC0415  (build-time only)

    texts = [*sentences, " ".join(sentences)]
    pairs = sentence_pairs(texts)
    labels = [f"input {i + 1}: {text[:40]!r}" for i, text in enumerate(sentences)] + [LONG_TEXT_LABEL]
    reference = LibraryReference(
        library=f"transformers {transformers.__version__}",
        model_class="AutoModelForCausalLM",
        inputs=pairs,
        labels=labels,
        expected=model_card_logits(checkpoint, pairs, checkpoint.pair_template),
        output="logits",
        normalized=False,
        compared=(
            'logit("yes") - logit("no") at the last position, pairs built, truncated and left-padded as'
            " Qwen3-Reranker's model card does it"
        ),
        against="the model card's scoring with transformers' AutoModelForCausalLM on the folder",
    )
    return against(reference, checkpoint, tokenizer, input_names)
