"""What the CLIP and SigLIP tests share: seeded inputs, and a tower's graph run against the tower."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from export.graph.towers import export_tower
from export.layers.vision import ImageTower, TextTower

TOLERANCE = 1e-5
"""Largest |difference| allowed between our towers and transformers', and between a graph and its tower."""


def images(count: int, size: int, seed: int = 0) -> torch.Tensor:
    """count random RGB pixel-value images [count, 3, size, size] (normal, as normalised pixels are)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(count, 3, size, size, generator=generator)


def texts(lengths: list[int], *, width: int, eos: int, pad: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of random ids in [2, eos - 2) each ended by eos, right-padded with pad to width: (input_ids, mask)."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.full((len(lengths), width), pad, dtype=torch.int64)
    attention_mask = torch.zeros_like(input_ids)
    for row, length in enumerate(lengths):
        input_ids[row, : length - 1] = torch.randint(2, eos - 2, (length - 1,), generator=generator)
        input_ids[row, length - 1] = eos
        attention_mask[row, :length] = 1
    return input_ids, attention_mask


def exported(tower: ImageTower | TextTower, path: Path) -> ort.InferenceSession:
    """The tower exported to path (export.graph.towers), in an onnxruntime CPU session."""
    export_tower(tower, path)
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def assert_graph_equals_tower(
    session: ort.InferenceSession, tower: ImageTower | TextTower, feeds: list[tuple[torch.Tensor, ...]]
) -> None:
    """Each feed (the tower's inputs, in order) through the graph and the tower: embeddings within TOLERANCE."""
    for inputs in feeds:
        with torch.inference_mode():
            expected = tower(*inputs).numpy()
        feed = {name: tensor.numpy() for name, tensor in zip(tower.input_names, inputs, strict=True)}
        (got,) = session.run(["embedding"], feed)
        assert got.shape == expected.shape
        assert np.abs(got - expected).max() <= TOLERANCE
