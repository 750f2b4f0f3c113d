"""The gate of a two-tower model (CLIP, SigLIP): each tower against transformers on the folder, each graph against both.

The reference is transformers' own model of the folder (`AutoModel`: CLIPModel, SiglipModel) with the folder's
own processor: `get_image_features` of the pixel values its image processor makes of each gate image
(export.gate.image_cases, opened with Pillow), `get_text_features` of the ids its tokenizer makes of the gate
sentences (padded as the family was trained: `text_padding`); without a tokenizer, of random ids. The graphs run
on what the server makes: its pixel values, and its tokenizer's ids of the same sentences. A model that is
a module of a sentence-transformers folder (clip-ViT-B-32's 0_CLIPModel) is held to that folder's `encode` of the
images (as Pillow opens them) and of the texts instead. Both are L2-normalised where the model is served
normalised. Figures, per tower:
- pixel values: the server's preprocessing (service.pipeline.images) against the processor's, <= 1e-5;
- model: our tower against transformers on the processor's pixel values (texts: the same ids), <= 1e-5;
- graph: the exported graph on the server's pixel values against our tower on them, <= 1e-5, and against
  transformers (what a client gets against what the library gives): cosine >= 0.9999, values within 1e-4.
A tower's int8 and fp16 graphs (check_variant) are held to our fp32 tower on the server's inputs at their variant's
own bar (service.core.fidelity.VARIANT_MIN_COSINE), their figures against the library recorded beside; the default
on CUDA follows the fidelity rule as the text models' does (preferred_variants).
"""

from __future__ import annotations

import gc
import io
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
import onnxruntime as ort
import torch
from PIL import Image

from export.families.two_tower import TwoTowerConfig
from export.gate.cases import row_label
from export.gate.image_cases import ImageCase
from export.gate.verdicts import device_defaults
from export.layers.vision import TwoTowerModel
from service.core.fidelity import FIDELITY_MIN_COSINE, VARIANT_MIN_COSINE, cosines
from service.pipeline.images import ImagePreprocessor
from service.pipeline.tokenizer import TextTokenizer

MODEL_MAX_ABS_DIFF = 1e-5
"""Our tower against transformers on the same weights and inputs."""
GRAPH_MAX_ABS_DIFF = 1e-5
"""A tower's fp32 graph against the tower."""
SERVED_MAX_ABS_DIFF = 1e-4
"""A tower's graph on the server's pixel values (or ids) against transformers on its processor's."""
PIXEL_MAX_ABS_DIFF = 1e-5
"""The server's pixel values against the processor's."""
RANDOM_TEXT_LENGTHS = (3, 7, 12)
"""Lengths (tokens) of the random texts a folder without a tokenizer is gated with."""


@dataclass(frozen=True)
class TowerInputs:
    """One tower's gate inputs as the library and the server make them, and the library's answers."""

    labels: tuple[str, ...]
    """What each row is (an image case's name, a text)."""
    library_feed: dict[str, np.ndarray]
    """The inputs transformers' processor or tokenizer made (the tower's input names)."""
    served_feed: dict[str, np.ndarray]
    """The inputs the server makes: the graph is run on them."""
    library: np.ndarray
    """transformers' embeddings of library_feed (normalised where the model is)."""


@dataclass
class TowerFigures:
    """One tower's figures and failures, as parity.json records them."""

    labels: tuple[str, ...]
    figures: dict[str, dict[str, float]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def compare(self, what: str, got: np.ndarray, expected: np.ndarray, max_abs: float, min_cosine: float) -> None:
        """Record got against expected (rows alike) under `what`; a failure names the worst row."""
        row_diffs = np.abs(got.astype(np.float64) - expected).reshape(len(got), -1).max(axis=1)
        row_cosines = cosines(got, expected)
        worst = int(np.argmax(row_diffs))
        self.figures[what] = {
            "max_abs_diff": float(f"{row_diffs[worst]:.3g}"),
            "min_cosine": round(float(row_cosines.min()), 8),
        }
        if row_diffs[worst] > max_abs:
            at = row_label(self.labels[worst])
            self.failures.append(f"{what}: max |diff| {row_diffs[worst]:.3g} > {max_abs} at {at}")
        low = int(np.argmin(row_cosines))
        if row_cosines[low] < min_cosine:
            at = row_label(self.labels[low])
            self.failures.append(f"{what}: cosine {row_cosines[low]:.6f} < {min_cosine} at {at}")

    def to_dict(self) -> dict[str, object]:
        """Plain data for parity.json."""
        return {"inputs": list(self.labels), **self.figures, "passed": not self.failures, "failures": self.failures}


def _features(output: object) -> torch.Tensor:
    """get_*_features' answer: a tensor, or (transformers 5) an output whose pooler_output it is."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output


def _normalised(vectors: torch.Tensor, normalize: bool) -> np.ndarray:
    return (torch.nn.functional.normalize(vectors, dim=-1) if normalize else vectors).numpy()


def text_rows(
    folder: Path, config: TwoTowerConfig, sentences: list[str], max_length: int, served_tokenizer: Path
) -> TowerInputs:
    """The gate's texts as the folder's tokenizer makes them and as the server does; no answers yet.

    The server's: service.pipeline.tokenizer on the tokenizer.json published, padded as the family says.
    """
    import transformers  # noqa: PLC0415  (build-time only: the server never imports it)

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    padding = "max_length" if config.text_padding == "max_length" else True
    encoded = tokenizer(sentences, padding=padding, truncation=True, max_length=max_length, return_tensors="np")
    library = {name: encoded[name].astype(np.int64) for name in ("input_ids", "attention_mask")}
    rows = TextTokenizer(served_tokenizer, max_length, config.pad_token_id).encode_rows(sentences)
    if config.text_padding == "max_length":
        rows = msgspec.structs.replace(rows, width=max_length)
    served = rows.padded(config.pad_token_id)
    return TowerInputs(tuple(sentences), library, {name: served[name] for name in library}, np.empty(0))


def random_text_rows(config: TwoTowerConfig, max_length: int, seed: int = 0) -> TowerInputs:
    """Random ids (a CLIP text ended by its end-of-text id), padded as the family says; no answers yet."""
    rng = np.random.default_rng(seed)
    lengths = [min(length, max_length) for length in RANDOM_TEXT_LENGTHS]
    width = max_length if config.text_padding == "max_length" else max(lengths)
    input_ids = np.full((len(lengths), width), config.pad_token_id, dtype=np.int64)
    attention_mask = np.zeros_like(input_ids)
    end = getattr(config, "eos_token_id", None)
    for row, length in enumerate(lengths):
        input_ids[row, :length] = rng.integers(1, config.vocab_size, size=length)
        if end is not None:
            input_ids[row, length - 1] = end
        attention_mask[row, :length] = 1
    feed = {"input_ids": input_ids, "attention_mask": attention_mask}
    return TowerInputs(tuple(f"random ids ({length} tokens)" for length in lengths), feed, feed, np.empty(0))


def _sentence_transformers_answers(
    folder: Path, pictures: list[Image.Image], texts: tuple[str, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """sentence-transformers' encode of the images and of the texts (one call each: it takes one modality a call)."""
    from sentence_transformers import SentenceTransformer  # noqa: PLC0415  (build-time only)

    model = SentenceTransformer(str(folder), device="cpu", local_files_only=True)
    answers = [model.encode(list(batch), convert_to_tensor=True) for batch in (pictures, texts)]
    del model
    return answers[0], answers[1]


def library_answers(
    folder: Path,
    config: TwoTowerConfig,
    images: list[ImageCase],
    texts: TowerInputs,
    preprocessor: ImagePreprocessor,
    *,
    sentence_transformers_folder: Path | None = None,
) -> dict[str, TowerInputs]:
    """The library's answers: each tower's inputs and embeddings; the library is let go after.

    The library: transformers on the folder, or sentence-transformers on the folder it is a module of.
    """
    import transformers  # noqa: PLC0415  (build-time only: the server never imports it)

    processor = transformers.AutoImageProcessor.from_pretrained(str(folder), local_files_only=True)
    pictures = [Image.open(io.BytesIO(case.data)) for case in images]
    library_pixels = processor(images=pictures, return_tensors="np")["pixel_values"].astype(np.float32)
    served_pixels = preprocessor.encode([case.data for case in images])
    if sentence_transformers_folder is not None:
        image_features, text_features = _sentence_transformers_answers(
            sentence_transformers_folder, pictures, texts.labels
        )
    else:
        model = transformers.AutoModel.from_pretrained(str(folder), local_files_only=True).eval()
        with torch.inference_mode():
            image_features = _features(model.get_image_features(pixel_values=torch.from_numpy(library_pixels)))
            text_feed = {name: torch.from_numpy(array) for name, array in texts.library_feed.items()}
            text_features = _features(model.get_text_features(**text_feed))
        del model
    answers = {
        "image": TowerInputs(
            tuple(case.name for case in images),
            {"pixel_values": library_pixels},
            {"pixel_values": served_pixels},
            _normalised(image_features, config.normalize),
        ),
        "text": TowerInputs(
            texts.labels, texts.library_feed, texts.served_feed, _normalised(text_features, config.normalize)
        ),
    }
    gc.collect()
    return answers


def model_answers(model: TwoTowerModel, inputs: dict[str, TowerInputs]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Our towers' embeddings of each tower's inputs: (of the library's inputs, of the server's)."""
    towers = {"image": model.vision, "text": model.text}
    answers = {}
    with torch.inference_mode():
        for name, tower_inputs in inputs.items():
            tower = towers[name]

            def run(feed: dict[str, np.ndarray], tower: Callable = tower) -> np.ndarray:
                return tower(*(torch.from_numpy(feed[input_name]) for input_name in tower.input_names)).numpy()

            answers[name] = (run(tower_inputs.library_feed), run(tower_inputs.served_feed))
    return answers


def check_tower(
    name: str, inputs: TowerInputs, ours: tuple[np.ndarray, np.ndarray], session: ort.InferenceSession
) -> TowerFigures:
    """One tower's figures: pixel values (images), our tower against the library, the graph against both."""
    figures = TowerFigures(inputs.labels)
    if name == "image":
        figures.compare(
            "pixel_values_vs_processor",
            inputs.served_feed["pixel_values"],
            inputs.library_feed["pixel_values"],
            PIXEL_MAX_ABS_DIFF,
            -1.0,
        )
    on_library_inputs, on_served_inputs = ours
    figures.compare("model_vs_library", on_library_inputs, inputs.library, MODEL_MAX_ABS_DIFF, FIDELITY_MIN_COSINE)
    feed = {graph_input.name: inputs.served_feed[graph_input.name] for graph_input in session.get_inputs()}
    (graph,) = session.run(["embedding"], feed)
    figures.compare("graph_vs_model", graph, on_served_inputs, GRAPH_MAX_ABS_DIFF, FIDELITY_MIN_COSINE)
    figures.compare("graph_vs_library", graph, inputs.library, SERVED_MAX_ABS_DIFF, FIDELITY_MIN_COSINE)
    figures.failures = [f"{name} tower: {failure}" for failure in figures.failures]
    return figures


def check_variant(
    name: str, variant: str, inputs: TowerInputs, fp32_answers: np.ndarray, session: ort.InferenceSession
) -> TowerFigures:
    """One tower's int8 or fp16 graph on the server's inputs, held to our fp32 tower at its variant's own bar.

    The bar: VARIANT_MIN_COSINE; its figures against the library are recorded beside, with no bar.
    """
    figures = TowerFigures(inputs.labels)
    feed = {graph_input.name: inputs.served_feed[graph_input.name] for graph_input in session.get_inputs()}
    (graph,) = session.run(["embedding"], feed)
    figures.compare("graph_vs_model", graph, fp32_answers, math.inf, VARIANT_MIN_COSINE[variant])
    figures.compare("graph_vs_library", graph, inputs.library, math.inf, -1.0)
    figures.failures = [f"{name} tower: {failure}" for failure in figures.failures]
    return figures


def preferred_variants(
    fp16: dict[str, TowerFigures] | None, provider: str | None, withdrawn: str | None, cuda_problem: str | None
) -> dict[str, dict[str, object]]:
    """The default per device under the fidelity rule, as a text model's (export.gate.verdicts.device_defaults).

    fp16 meets the rule where both towers' fp16 graphs measured >= it against the fp32 towers. fp16: its towers'
    figures, None where it was not built; withdrawn: why it was withdrawn, if it was.
    """
    if fp16 is None or withdrawn is not None:
        return device_defaults(None, f"fp16 not published: {withdrawn}" if withdrawn is not None else "")
    tower, measured = min(
        ((name, figures.figures["graph_vs_model"]["min_cosine"]) for name, figures in fp16.items()),
        key=lambda pair: pair[1],
    )
    meets = measured >= FIDELITY_MIN_COSINE
    rule = f"{'>=' if meets else '<'} {FIDELITY_MIN_COSINE}"
    figure = f"fp16 min cosine to the model {measured:.6f} {rule} ({tower} tower)"
    return device_defaults((meets, figure, str(provider)), cuda_problem=cuda_problem)
