"""The one per-variant loop every reference check runs: each published variant checked, its figures kept."""

from __future__ import annotations

from collections.abc import Callable

import onnxruntime as ort

VariantCheck = Callable[[str, ort.InferenceSession], tuple[dict[str, object], list[str]]]
"""(variant, its session) -> (its figures for parity.json, its failures)."""
Checked = tuple[dict[str, dict[str, object]], list[str]]
"""Figures per variant for parity.json, and every failure."""


def each_variant(sessions: dict[str, ort.InferenceSession], check: VariantCheck) -> Checked:
    """Every published variant (its session) through one check."""
    report: dict[str, dict[str, object]] = {}
    failures: list[str] = []
    for variant, session in sessions.items():
        report[variant], variant_failures = check(variant, session)
        failures += variant_failures
    return report, failures


def unchecked(sessions: dict[str, ort.InferenceSession], reason: str, *, failed: bool) -> Checked:
    """Every variant left unchecked for one reason; failed: the reason is a failure (the library could not answer)."""
    return {variant: {"library": None, "reason": reason} for variant in sessions}, [reason] if failed else []
