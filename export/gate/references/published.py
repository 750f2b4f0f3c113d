"""Which libraries check a published model, and their verdicts in parity.json (export.build asks here).

sentence-transformers (SentenceTransformer, CrossEncoder, SparseEncoder) for what it made, unless the model's
head declares its own library check (MultiVectorEncoder for ColBERT, the model card's transformers scoring for
Qwen3-Reranker); then the checks the head adds (FlagEmbedding for bge-m3, transformers' masked LM for SPLADE).

Each library answers once, before any ONNX Runtime session is built (its model is let go as soon as it has
answered), and each published variant is then held to those answers while its session is open: a library's
model and a variant's session are never in memory together.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from export.checkpoints.checkpoint import Checkpoint
from export.gate.parity import GateRefused
from export.gate.references import library
from export.gate.references.loop import VariantCheck, VariantSession
from export.heads.head import ReferenceInputs
from service.pipeline.tokenizer import TextTokenizer


@dataclass(frozen=True)
class LibraryAnswers:
    """One library's answers, as the check each published variant is held to."""

    report_key: str
    """The key under each variant in parity.json: reference_library, or the head's (flag_embedding)."""
    refusal: str
    """How the refusal's line begins: "reference library refused"."""
    check: VariantCheck


@dataclass(frozen=True)
class ModelVerdict:
    """A library's verdict on the PyTorch model (SPLADE's masked LM): figures for parity.json's top, and failures."""

    report_key: str
    refusal: str
    figures: dict[str, object]
    failures: list[str]


@dataclass
class LibraryVerdicts:
    """The libraries' answers for a folder, and each variant's figures and failures against them as checked."""

    answers: list[LibraryAnswers]
    model_verdicts: list[ModelVerdict] = field(default_factory=list)
    figures: dict[str, dict[str, dict[str, object]]] = field(default_factory=dict)
    """variant -> report key -> figures."""
    failures: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    """variant -> report key -> failures."""

    def check(self, variant: str, session: VariantSession) -> None:
        """Hold one variant (its session, open now) to every library's answers."""
        for answers in self.answers:
            figures, failures = answers.check(variant, session)
            self.figures.setdefault(variant, {})[answers.report_key] = figures
            self.failures.setdefault(variant, {})[answers.report_key] = failures

    def record(self, published: list[str], report: dict[str, object]) -> None:
        """The published variants' figures into the report; raises GateRefused at the first library that disagrees."""
        for answers in self.answers:
            failures = [failure for variant in published for failure in self.failures[variant][answers.report_key]]
            if failures:
                raise GateRefused(f"{answers.refusal}: " + "; ".join(dict.fromkeys(failures)))
            for variant in published:
                report["variants"][variant][answers.report_key] = self.figures[variant][answers.report_key]
        for verdict in self.model_verdicts:
            report[verdict.report_key] = verdict.figures
            if verdict.failures:
                raise GateRefused(f"{verdict.refusal}: " + "; ".join(verdict.failures))


def library_answers(
    checkpoint: Checkpoint,
    tokenizer: TextTokenizer | None,
    input_names: list[str],
    *,
    sentences: list[str],
    stage: Callable[[str], None],
) -> list[LibraryAnswers]:
    """The libraries that made the folder, run on the folder now: the checks every published variant is held to."""
    declaration = checkpoint.head_declaration
    make_check = library.published_check
    stage_name = "reference library: sentence-transformers on the source folder, for each published variant"
    if declaration is not None and declaration.library_check is not None and tokenizer is not None:
        make_check = declaration.library_check
        stage_name = declaration.library_stage or stage_name
    stage(stage_name)
    answers = [
        LibraryAnswers(
            "reference_library", "reference library refused", make_check(checkpoint, tokenizer, input_names, sentences)
        )
    ]
    inputs = ReferenceInputs(checkpoint, tokenizer, input_names, sentences)
    for reference in () if declaration is None else declaration.references:
        if reference.runs(tokenizer is not None):
            stage(reference.stage)
            answers.append(
                LibraryAnswers(reference.report_key, f"{reference.library} refused", reference.answers(inputs))
            )
    return answers


def model_verdicts(
    checkpoint: Checkpoint,
    model: nn.Module,
    tokenizer: TextTokenizer | None,
    input_names: list[str],
    *,
    sentences: list[str],
    stage: Callable[[str], None],
) -> list[ModelVerdict]:
    """The libraries the model's head holds its PyTorch reading (model) to, on the folder."""
    declaration = checkpoint.head_declaration
    inputs = ReferenceInputs(checkpoint, tokenizer, input_names, sentences)
    verdicts = []
    for reference in () if declaration is None else declaration.model_references:
        if reference.runs(tokenizer is not None):
            stage(reference.stage)
            figures, failures = reference.check(inputs, model)
            verdicts.append(ModelVerdict(reference.report_key, f"{reference.library} refused", figures, failures))
    return verdicts
