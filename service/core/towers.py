"""A two-tower model's layout in the repository (CLIP, SigLIP: texts and images in one embedding space).

A two-tower model is an embedder whose graphs answer `embedding` only: model.onnx (and model.int8.onnx,
model.fp16.onnx where published) is its text tower (input_ids, attention_mask; pooling inside the graph), and
    REPO/<model>/<version>/image.onnx      the image tower, pixel_values [n, 3, size, size] (image_variant.fp32)
    REPO/<model>/<version>/image.int8.onnx, image.fp16.onnx   its other variants (image_variant.int8, .fp16)
    REPO/<model>/preprocessor_config.json  encoded image -> pixel values (service.pipeline.images; image_preprocessor)
    REPO/<model>/image_fidelity.npz        a few gate images' pixel values and the fp32 tower's embeddings of
                                           them: the image graph's check at load (IMAGE_FIDELITY_FILE)
with parameter text_padding saying how a batch of texts is padded (TEXT_PADDINGS). service.core.repository reads
these parameters into its ModelSpec; the checks of what they say are here. A repository exported before the
image tower had variants holds image.onnx alone and no image_fidelity.npz: it is served in fp32, unchecked.
"""

from __future__ import annotations

from pathlib import Path

P_IMAGE_VARIANT_PREFIX = "image_variant."
IMAGE_VARIANT_FILES = {"fp32": "image.onnx", "int8": "image.int8.onnx", "fp16": "image.fp16.onnx"}
IMAGE_FIDELITY_FILE = "image_fidelity.npz"
"""The image tower's fidelity reference (service.core.fidelity.FidelityReference, fed pixel_values)."""
P_IMAGE_PREPROCESSOR = "image_preprocessor"
P_TEXT_PADDING = "text_padding"
TEXT_PADDINGS = ("longest", "max_length")
"""longest: a batch of texts is padded to its longest text; max_length: every text to max_sequence_length, as
SigLIP was trained (its text embedding is read at the sequence's last position)."""
TOWER_POOLINGS = ("eos_token", "highest_id", "last_position")
"""How a two-tower model's text graph picks its token (CLIP's, in legacy configs the highest id; SigLIP's)."""
PIXEL_VALUES = "pixel_values"
"""The image graph's one input: float32 [images, channels, height, width]."""


def tower_facts(
    task: str, image_variants: dict[str, Path], preprocessor: Path, padding: str, fidelity: Path
) -> dict[str, object]:
    """A two-tower model's image graphs, preprocessor, text padding and image reference, checked (ValueError).

    The ModelSpec fields they fill: image_variants, image_preprocessor, text_padding, image_fidelity_file (None
    where the repository holds no image reference).
    """
    if task != "embed" or "fp32" not in image_variants:
        raise ValueError(f"an image tower needs task embed and {P_IMAGE_VARIANT_PREFIX}fp32")
    unknown = sorted(set(image_variants) - set(IMAGE_VARIANT_FILES))
    if unknown:
        raise ValueError(f"image variant {unknown[0]!r} is not one of {', '.join(IMAGE_VARIANT_FILES)}")
    if not preprocessor.is_file():
        raise ValueError(f"image preprocessor file {preprocessor} does not exist")
    if padding not in TEXT_PADDINGS:
        raise ValueError(f"text_padding {padding!r} is not one of {', '.join(TEXT_PADDINGS)}")
    return {
        "image_variants": image_variants,
        "image_preprocessor": preprocessor,
        "text_padding": padding,
        "image_fidelity_file": fidelity if fidelity.is_file() else None,
    }
