"""Fidelity: how close a variant's embeddings must be to the model's, and the check run at load.

The exporter stores a few fixed gate inputs (real sentences right-padded, one left-padded, one
with a hole in its mask) and the fp32 PyTorch model's embeddings for them in `fidelity.npz`.
When the server loads a variant it runs those inputs on the provider actually in use and
compares: the CPU the exporter measured on is not the GPU a deployment runs on (fused kernels,
fp16 accumulation), so this is the check that covers the deployment itself.

A classifier (a reranker) stores its logits instead and is held to the largest logit difference
(`LOGITS_MAX_ABS_DIFF`): logits have no meaningful cosine (a reranker's have one value per row).

Two bars, one rule:
- each variant has its own bar, the export gate's cosine (`VARIANT_MIN_COSINE`; a classifier's
  `LOGITS_MAX_ABS_DIFF`); an operator who names a variant (`--variant fp16`) is promised that bar;
- a variant the server picks by default must also meet the fidelity rule (`FIDELITY_MIN_COSINE`;
  a classifier's `LOGITS_FIDELITY_MAX_ABS_DIFF`): served answers equal the model's, as the
  reference library gives them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

FIDELITY_MIN_COSINE = 0.9999
"""The fidelity rule: the least cosine to the model a default (not operator-chosen) variant may give."""
VARIANT_MIN_COSINE = {"fp32": 0.99999, "fp16": 0.999, "int8": 0.99}
"""Each variant's own bar: the export gate's least embedding cosine, and what naming the variant promises."""
LOGITS_MAX_ABS_DIFF = {"fp32": 1e-3, "fp16": 0.05}
"""A classifier's bar at load per variant: the largest difference from the model's logits (int8 is not published)."""
LOGITS_FIDELITY_MAX_ABS_DIFF = 0.02
"""The fidelity rule for a classifier: the largest logit difference a default (not operator-chosen) variant may give."""
DEFAULT_VARIANTS = ("fp32", "fp16")
"""Variants the server may choose on its own; int8 is only ever the operator's explicit choice."""


class FidelityError(ValueError):
    """A fidelity reference file that cannot be read; the message names the file."""


def required_cosine(variant: str, chosen_by_default: bool) -> float:
    """The least cosine a variant must show at load: its own bar, and the fidelity rule when chosen by default."""
    bar = VARIANT_MIN_COSINE[variant]
    return max(bar, FIDELITY_MIN_COSINE) if chosen_by_default else bar


def required_logits_diff(variant: str, chosen_by_default: bool) -> float:
    """The largest logit difference a classifier's variant may show at load: its bar, the rule's when by default."""
    bar = LOGITS_MAX_ABS_DIFF[variant]
    return min(bar, LOGITS_FIDELITY_MAX_ABS_DIFF) if chosen_by_default else bar


def required_bar(output: str, variant: str, chosen_by_default: bool) -> float:
    """What a variant must show at load for a reference of `output`: a logit difference or a cosine."""
    if output == "logits":
        return required_logits_diff(variant, chosen_by_default)
    return required_cosine(variant, chosen_by_default)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity of two [rows, ...] arrays (each row flattened), computed in float64."""
    a64, b64 = a.reshape(len(a), -1).astype(np.float64), b.reshape(len(b), -1).astype(np.float64)
    norms = np.linalg.norm(a64, axis=1) * np.linalg.norm(b64, axis=1)
    return (a64 * b64).sum(axis=1) / np.maximum(norms, 1e-30)


@dataclass(frozen=True)
class FidelityReference:
    """Gate inputs, what each row is, and the model's fp32 answers.

    The inputs: int64 [rows, length] per graph input; an image tower's float32 pixel_values [rows, 3, size, size].
    """

    feed: dict[str, np.ndarray]
    labels: tuple[str, ...]
    embedding: np.ndarray
    """The model's fp32 answer per row: its embedding, or (output "logits") a classifier's logits."""
    output: str = "embedding"
    """The graph output the reference is of."""

    def save(self, path: Path) -> None:
        """Write the reference as an .npz file (plain arrays, no pickles)."""
        with path.open("wb") as file:
            np.savez(
                file, embedding=self.embedding, labels=np.array(self.labels), output=np.array(self.output), **self.feed
            )

    @classmethod
    def load(cls, path: Path, inputs: tuple[str, ...] = ("input_ids", "attention_mask")) -> FidelityReference:
        """Read a reference written by save(); `inputs`: the graph inputs it holds (an image tower's: pixel_values)."""
        try:
            with np.load(path, allow_pickle=False) as arrays:
                contents = {name: arrays[name] for name in arrays.files}
        except (OSError, ValueError) as error:
            raise FidelityError(f"{path}: not a fidelity reference: {error}") from error
        missing = {"embedding", "labels", *inputs} - set(contents)
        if missing:
            raise FidelityError(f"{path}: missing {', '.join(sorted(missing))}")
        embedding, labels = contents.pop("embedding"), contents.pop("labels")
        output = str(contents.pop("output", "embedding"))
        rows = contents[inputs[0]].shape[0]
        if embedding.shape[0] != rows or len(labels) != rows:
            raise FidelityError(f"{path}: {rows} input rows but {embedding.shape[0]} embeddings, {len(labels)} labels")
        return cls(feed=contents, labels=tuple(str(label) for label in labels), embedding=embedding, output=output)


@dataclass(frozen=True)
class FidelityCheck:
    """The outcome of running a reference through a variant on one provider."""

    variant: str
    provider: str
    min_cosine: float
    worst_row: str
    required: float
    max_abs_diff: float | None = None
    """A classifier's largest logit difference (then held to LOGITS_MAX_ABS_DIFF instead of a cosine)."""

    @property
    def passed(self) -> bool:
        """Whether the worst row met the required cosine (a classifier: the largest logit difference allowed)."""
        if self.max_abs_diff is not None:
            return self.max_abs_diff <= self.required
        return self.min_cosine >= self.required

    def describe(self) -> str:
        """One line for logs and errors."""
        if self.max_abs_diff is not None:
            verdict = "<=" if self.passed else ">"
            return (
                f"{self.variant} on {self.provider}: max logit difference from the model {self.max_abs_diff:.3g}"
                f" {verdict} {self.required} (worst: {self.worst_row})"
            )
        verdict = ">=" if self.passed else "<"
        return (
            f"{self.variant} on {self.provider}: min cosine to the model {self.min_cosine:.6f} {verdict} "
            f"{self.required} (worst: {self.worst_row})"
        )


def compare(
    reference: FidelityReference, embedding: np.ndarray, variant: str, provider: str, required: float
) -> FidelityCheck:
    """Compare a variant's answers for the reference inputs with the model's.

    `required` is `required_bar`'s: a least cosine, or for a classifier's logits the largest difference.
    """
    if reference.output == "logits":
        row_diffs = np.abs(embedding.astype(np.float64) - reference.embedding).max(axis=1)
        worst = int(np.argmax(row_diffs))
        return FidelityCheck(variant, provider, 1.0, reference.labels[worst], required, float(row_diffs[worst]))
    row_cosines = cosines(embedding, reference.embedding)
    worst = int(np.argmin(row_cosines))
    return FidelityCheck(variant, provider, float(row_cosines[worst]), reference.labels[worst], required)
