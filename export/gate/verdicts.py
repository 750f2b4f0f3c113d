"""The gate's verdicts on each variant of an export, and the variant each device serves by default.

VariantGate holds what every variant is compared with (the PyTorch references, the served path, the
server's check at load, the reference libraries' answers) and each variant's verdicts as export.build
gates and records them; preferred_variants applies the fidelity rule (service.core.fidelity) to them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import onnxruntime as ort

from export.gate import parity
from export.gate.references.loop import KeptAnswers
from export.gate.references.published import LibraryVerdicts
from export.gate.served import ServedFigures, ServedPath
from export.graph import forms as optimize
from export.graph.timing import cpu_session
from service.core.fidelity import (
    FIDELITY_MIN_COSINE,
    LOGITS_FIDELITY_MAX_ABS_DIFF,
    FidelityCheck,
    FidelityReference,
    compare,
    required_bar,
)
from service.core.runtime import CUDA

log = logging.getLogger(__name__)


@dataclass
class VariantGate:
    """Everything the variants are compared with: references, the served path, and the verdicts so far."""

    references: list[parity.Reference]
    served: ServedPath | None
    fidelity: FidelityReference
    """What the server checks each variant with at load: a published variant must pass it here too."""
    threads: int
    results: dict[str, parity.GateResult] = field(default_factory=dict)
    served_figures: dict[str, ServedFigures] = field(default_factory=dict)
    load_checks: dict[str, FidelityCheck] = field(default_factory=dict)
    forms: dict[str, dict[str, parity.GateResult]] = field(default_factory=dict)
    """variant -> CPU graph form -> verdict, for every form measured."""
    libraries: LibraryVerdicts = field(default_factory=lambda: LibraryVerdicts([]))
    """The reference libraries' answers, and each recorded variant's figures against them."""

    def check(self, variant: str, session: ort.InferenceSession) -> parity.GateResult:
        """The parity gate's verdict on one variant's session."""
        return parity.check_variant(variant, session, self.references)

    def passes(self, variant: str, form: str, session: ort.InferenceSession) -> bool:
        """Gate one CPU graph form of a variant; its verdict joins the variant's forms (a refusal is logged)."""
        result = self.check(variant, session)
        self.forms.setdefault(variant, {})[form] = result
        if not result.passed:
            log.warning("%s graph form %s refused by the parity gate: %s", variant, form, "; ".join(result.failures))
        return result.passed

    def publishable(self, variant: str, candidates: dict[str, Path]) -> dict[str, Path]:
        """Gate every candidate form of a variant, one session at a time; the ones that pass."""
        self.forms[variant] = {}
        level = optimize.cpu_graph_optimization(variant)
        return {
            form: path
            for form, path in candidates.items()
            if self.passes(variant, form, cpu_session(str(path), self.threads, level))
        }

    def record(self, variant: str, form: str | None, session: ort.InferenceSession) -> None:
        """The verdict, served figures, load check and reference libraries' figures of the variant as published.

        The checks after the gate share the session's answers (KeptAnswers): a feed two of them make runs once.
        """
        self.results[variant] = self.forms[variant][form] if form is not None else self.check(variant, session)
        answers = KeptAnswers(session)
        self.libraries.check(variant, answers)
        if self.served is not None:
            self.served_figures[variant] = self.served.measure(answers)
        (embedding,) = answers.run([self.fidelity.output], self.fidelity.feed)
        provider = session.get_providers()[0]
        self.load_checks[variant] = compare(
            self.fidelity, embedding, variant, provider, required_bar(self.fidelity.output, variant, False)
        )

    def failures(self, variants: Iterable[str]) -> list[str]:
        """The recorded variants' misses: their tolerances, and the server's check at load."""
        chosen = [variant for variant in variants if variant in self.results]
        failures = [failure for variant in chosen for failure in self.results[variant].failures]
        return failures + [
            f"{variant}: would fail the server's check at load: {self.load_checks[variant].describe()}"
            for variant in chosen
            if not self.load_checks[variant].passed
        ]


def fidelity_basis(gate: VariantGate, variant: str) -> tuple[bool, str]:
    """Whether a variant meets the fidelity rule, and the figure it rests on.

    Embeddings: the served path's least cosine, or (no tokenizer) every gated case's. A classifier:
    its largest logit difference on real sentence pairs, masks included (no tokenizer: every case), as
    users send them: random token ids move fp16 logits most (Qwen3-Reranker-0.6B, random weights:
    0.025 on one random token, 0.014 on sentences).
    """
    if gate.fidelity.output == "logits":
        kinds = gate.results[variant].figures
        real = [kinds[name] for name in ("sentences", "sentence_masks") if name in kinds] or list(kinds.values())
        worst = max(kind.max_abs_diff for kind in real)
        meets = worst <= LOGITS_FIDELITY_MAX_ABS_DIFF
        rule = f"{'<=' if meets else '>'} {LOGITS_FIDELITY_MAX_ABS_DIFF}"
        return meets, f"{variant} max logit difference from the model {worst:.3g} {rule}"
    if variant in gate.served_figures:
        measured = gate.served_figures[variant].min_cosine
    else:
        measured = min(kind.min_cosine for kind in gate.results[variant].figures.values())
    meets = measured >= FIDELITY_MIN_COSINE
    return meets, f"{variant} min cosine to the model {measured:.6f} {'>=' if meets else '<'} {FIDELITY_MIN_COSINE}"


def preferred_variants(
    gate: VariantGate, published: list[str], withdrawn: dict[str, str], cuda_problem: str | None
) -> dict[str, dict[str, object]]:
    """The default per device under the fidelity rule, with what it rests on (device_defaults on the gate's fp16)."""
    if "fp16" not in published:
        return device_defaults(None, f"fp16 not published: {withdrawn['fp16']}" if "fp16" in withdrawn else "")
    meets, figure = fidelity_basis(gate, "fp16")
    return device_defaults((meets, figure, gate.results["fp16"].provider), cuda_problem=cuda_problem)


def device_defaults(
    fp16: tuple[bool, str, str] | None, unpublished: str = "", cuda_problem: str | None = None
) -> dict[str, dict[str, object]]:
    """The fidelity rule's default per device, with what it rests on (a text model's, or both towers' together).

    CPU: fp32 (int8 is only ever an explicit choice). CUDA: fp16 where it measured >= the fidelity rule, else
    fp32. fp16: whether it meets the rule, the figure it rests on and the provider it was measured on; None where
    it was not published (`unpublished` says why; "": not built). When fp16 could only be measured on the CPU,
    that is said (`cuda_problem`), and the server checks it again on CUDA at load.
    """
    choices: dict[str, dict[str, object]] = {
        "cpu": {"variant": "fp32", "basis": "fidelity rule: fp32 on the CPU; int8 only by explicit choice"}
    }
    if fp16 is None:
        choices["cuda"] = {"variant": "fp32", "basis": unpublished or "fp16 not built"}
        return choices
    meets, figure, provider = fp16
    where = f"measured on {provider}"
    if provider != CUDA:
        where += f" only, not CUDA ({cuda_problem}); the server re-checks fp16 on CUDA at load"
    choices["cuda"] = {
        "variant": "fp16" if meets else "fp32",
        "basis": f"{figure}, {where}",
        "fp16_checked_on_cuda": provider == CUDA,
    }
    return choices


def load_check_figures(check: FidelityCheck) -> dict[str, object]:
    """The server's check at load as measured here: the least cosine, or a classifier's largest logit difference."""
    figures: dict[str, object] = {"provider": check.provider}
    if check.max_abs_diff is None:
        figures["min_cosine"] = round(check.min_cosine, 8)
    else:
        figures["max_abs_diff"] = float(f"{check.max_abs_diff:.3g}")
    return figures | {"worst_row": check.worst_row, "required": check.required}
