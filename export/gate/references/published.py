"""Which libraries check a published model, and their verdicts in parity.json (export.build asks here).

sentence-transformers (SentenceTransformer, CrossEncoder, SparseEncoder) for what it made, unless the model's
head declares its own library check (MultiVectorEncoder for ColBERT, the model card's transformers scoring for
Qwen3-Reranker); then the checks the head adds (FlagEmbedding for bge-m3, transformers' masked LM for SPLADE).
"""

from __future__ import annotations

from collections.abc import Callable

import onnxruntime as ort
from torch import nn

from export.checkpoints.checkpoint import Checkpoint
from export.gate.parity import GateRefused
from export.gate.references import library
from export.heads.head import ReferenceInputs
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
    declaration = checkpoint.head_declaration
    check = library.check_published
    stage_name = "reference library: each published variant against sentence-transformers on the source folder"
    if declaration is not None and declaration.library_check is not None and tokenizer is not None:
        check = declaration.library_check
        stage_name = declaration.library_stage or stage_name
    stage(stage_name)
    library_figures, library_failures = check(checkpoint, tokenizer, input_names, sessions, sentences)
    if library_failures:
        raise GateRefused("reference library refused: " + "; ".join(library_failures))
    for variant, figures in library_figures.items():
        report["variants"][variant]["reference_library"] = figures
    inputs = ReferenceInputs(checkpoint, model, tokenizer, input_names, sessions, sentences)
    for reference in () if declaration is None else declaration.references:
        if not reference.runs(tokenizer is not None):
            continue
        stage(reference.stage)
        figures, failures = reference.check(inputs)
        if failures:
            raise GateRefused(f"{reference.library} refused: " + "; ".join(failures))
        if reference.per_variant:
            for variant, variant_figures in figures.items():
                report["variants"][variant][reference.report_key] = variant_figures
        else:
            report[reference.report_key] = figures
