"""A reference library's check of one published variant: its answers computed once, each variant held to them."""

from __future__ import annotations

from collections.abc import Callable

import onnxruntime as ort

VariantCheck = Callable[[str, ort.InferenceSession], tuple[dict[str, object], list[str]]]
"""(variant, its session) -> (its figures for parity.json, its failures)."""


def unchecked(reason: str, *, failed: bool) -> VariantCheck:
    """A check that leaves every variant unchecked for one reason; failed: the reason is a failure."""

    def check(variant: str, session: ort.InferenceSession) -> tuple[dict[str, object], list[str]]:
        return {"library": None, "reason": reason}, [reason] if failed else []

    return check
