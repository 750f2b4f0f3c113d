"""Which libraries check a published model, and their verdicts in parity.json (export.build asks here).

sentence-transformers (SentenceTransformer, CrossEncoder, SparseEncoder, MultiVectorEncoder) for what it made,
the model card's transformers scoring for Qwen3-Reranker, FlagEmbedding for bge-m3, and transformers'
masked-LM for a SPLADE model's PyTorch reading.
"""

from __future__ import annotations

from collections.abc import Callable

import onnxruntime as ort
from torch import nn

from export.checkpoints.checkpoint import Checkpoint
from export.gate.parity import GateRefused
from export.gate.references import bge_m3, library, multivector, yes_no
from service.pipeline.tokenizer import TextTokenizer


def check_with_libraries(
    checkpoint: Checkpoint,
    model: nn.Module,
    tokenizer: TextTokenizer | None,
    input_names: list[str],
    sessions: dict[str, ort.InferenceSession],
    *,
    sentences: list[str],
    stage: Callable[[str], None],
    report: dict[str, object],
) -> None:
    """The libraries that made the folder, on the folder, against every published variant (sessions).

    Their figures go into the report (parity.json); raises GateRefused at the first library that disagrees.
    """
    check = library.check_published
    if checkpoint.task == "multivector" and tokenizer is not None:
        check = multivector.check_multivector
    if checkpoint.pair_template is not None and tokenizer is not None:
        stage("the model card: each published variant against its transformers scoring on the source folder")
        check = yes_no.check_published
    else:
        stage("reference library: each published variant against sentence-transformers on the source folder")
    library_figures, library_failures = check(checkpoint, tokenizer, input_names, sessions, sentences)
    if library_failures:
        raise GateRefused("reference library refused: " + "; ".join(library_failures))
    for variant, figures in library_figures.items():
        report["variants"][variant]["reference_library"] = figures
    if checkpoint.bge_m3 is not None:
        stage("FlagEmbedding: each published variant against BGEM3FlagModel on the source folder")
        flag_embedding, flag_failures = bge_m3.check_published(checkpoint, tokenizer, input_names, sessions, sentences)
        if flag_failures:
            raise GateRefused("FlagEmbedding refused: " + "; ".join(flag_failures))
        for variant, figures in flag_embedding.items():
            report["variants"][variant]["flag_embedding"] = figures
    if checkpoint.task == "sparse" and tokenizer is not None:
        stage("transformers: the PyTorch model against AutoModelForMaskedLM on the source folder")
        report["masked_lm_reference"], masked_lm_failures = library.check_masked_lm(
            checkpoint, model, tokenizer, input_names, sentences
        )
        if masked_lm_failures:
            raise GateRefused("transformers refused: " + "; ".join(masked_lm_failures))
