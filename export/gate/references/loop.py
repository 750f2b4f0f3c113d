"""A reference library's check of one published variant: its answers computed once, each variant held to them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
import onnxruntime as ort


class VariantSession(Protocol):
    """What a check asks of a published variant's graph: its answers to a feed, and the provider it ran on."""

    def run(self, output_names: list[str], input_feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        """The named outputs for one feed."""
        ...

    def get_providers(self) -> list[str]:
        """The execution providers, the one that ran first."""
        ...


VariantCheck = Callable[[str, VariantSession], tuple[dict[str, object], list[str]]]
"""(variant, its session) -> (its figures for parity.json, its failures)."""


class KeptAnswers:
    """A published variant's session whose answers are kept per feed while its checks run.

    A feed that two checks share runs once. For a model without a prompt, the served path and the
    reference library's check both run the gate sentences one at a time and the same first batches.
    """

    def __init__(self, session: ort.InferenceSession) -> None:
        self.session = session
        self.answers: dict[tuple, list[np.ndarray]] = {}

    def run(self, output_names: list[str], input_feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        """The session's answer, run once per distinct (outputs, feed)."""
        key = (
            tuple(output_names),
            *((name, array.dtype.str, array.shape, array.tobytes()) for name, array in sorted(input_feed.items())),
        )
        if key not in self.answers:
            self.answers[key] = self.session.run(output_names, input_feed)
        return self.answers[key]

    def get_providers(self) -> list[str]:
        """The session's execution providers."""
        return self.session.get_providers()


def unchecked(reason: str, *, failed: bool) -> VariantCheck:
    """A check that leaves every variant unchecked for one reason; failed: the reason is a failure."""

    def check(variant: str, session: VariantSession) -> tuple[dict[str, object], list[str]]:
        return {"library": None, "reason": reason}, [reason] if failed else []

    return check
