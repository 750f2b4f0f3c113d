"""The libraries' verdicts: each variant held to every library's answers as it is checked, recorded for the published.

Fast checks of export.gate.references.published's bookkeeping with stand-in checks; the libraries themselves
run in test_reference_library.py, test_bge_m3.py, test_splade.py and the other export tests.
"""

from __future__ import annotations

import onnxruntime as ort
import pytest

from export.gate.parity import GateRefused
from export.gate.references.loop import unchecked
from export.gate.references.published import LibraryAnswers, LibraryVerdicts, ModelVerdict


def _cosine_check(
    cosines: dict[str, float], floor: float, key: str = "reference_library", refusal: str = "reference library refused"
) -> LibraryAnswers:
    """A stand-in library whose answer each variant meets with its own cosine; below floor is a failure."""

    def check(variant: str, session: ort.InferenceSession) -> tuple[dict[str, object], list[str]]:
        failures = [f"{variant}: cosine {cosines[variant]} < {floor}"] if cosines[variant] < floor else []
        return {"min_cosine": cosines[variant]}, failures

    return LibraryAnswers(key, refusal, check)


def _report(variants: list[str]) -> dict[str, object]:
    return {"variants": {variant: {} for variant in variants}}


def test_each_published_variant_gets_every_librarys_figures() -> None:
    reason = "no sentence-transformers files"
    verdicts = LibraryVerdicts(
        [
            _cosine_check({"fp32": 1.0, "int8": 0.995}, floor=0.99),
            LibraryAnswers("flag_embedding", "FlagEmbedding refused", unchecked(reason, failed=False)),
        ],
        [ModelVerdict("masked_lm_reference", "transformers refused", {"max_abs_diff": 1e-6}, [])],
    )
    for variant in ("fp32", "int8"):
        verdicts.check(variant, None)
    report = _report(["fp32", "int8"])
    verdicts.record(["fp32", "int8"], report)
    assert report["variants"] == {
        "fp32": {"reference_library": {"min_cosine": 1.0}, "flag_embedding": {"library": None, "reason": reason}},
        "int8": {"reference_library": {"min_cosine": 0.995}, "flag_embedding": {"library": None, "reason": reason}},
    }
    assert report["masked_lm_reference"] == {"max_abs_diff": 1e-6}


def test_a_withdrawn_variant_failing_a_library_refuses_nothing() -> None:
    verdicts = LibraryVerdicts([_cosine_check({"fp32": 1.0, "fp16": 0.5}, floor=0.99)])
    verdicts.check("fp32", None)
    verdicts.check("fp16", None)
    report = _report(["fp32"])
    verdicts.record(["fp32"], report)
    assert report["variants"] == {"fp32": {"reference_library": {"min_cosine": 1.0}}}


def test_a_published_variant_failing_a_library_refuses_the_export_once_per_failure() -> None:
    failure = "sentence-transformers could not answer"
    verdicts = LibraryVerdicts(
        [
            LibraryAnswers("reference_library", "reference library refused", unchecked(failure, failed=True)),
            _cosine_check({"fp32": 0.5, "int8": 0.5}, 0.99, "flag_embedding", "FlagEmbedding refused"),
        ]
    )
    verdicts.check("fp32", None)
    verdicts.check("int8", None)
    with pytest.raises(GateRefused) as refusal:
        verdicts.record(["fp32", "int8"], _report(["fp32", "int8"]))
    assert str(refusal.value) == f"reference library refused: {failure}"


def test_the_model_verdict_refuses_after_the_variants_pass() -> None:
    verdicts = LibraryVerdicts(
        [_cosine_check({"fp32": 1.0}, floor=0.99)],
        [ModelVerdict("masked_lm_reference", "transformers refused", {}, ["max |diff| 0.1 > 1e-4"])],
    )
    verdicts.check("fp32", None)
    with pytest.raises(GateRefused) as refusal:
        verdicts.record(["fp32"], _report(["fp32"]))
    assert str(refusal.value) == "transformers refused: max |diff| 0.1 > 1e-4"
