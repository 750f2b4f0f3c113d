"""The gate's images: encoded as clients send them, in the shapes and modes a processor must handle.

Each case is an image of random pixels (so that every resize filter and crop offset shows), sized from the
model's input size: the size itself, larger and smaller squares, portrait and landscape (the crop takes a
different part of each), grey, RGBA with random alpha, and a palette PNG with a transparent index (a
tRNS chunk), encoded as PNG, JPEG, WebP or GIF.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import Image


@dataclass(frozen=True)
class ImageCase:
    """One gate image: its name (in parity.json and refusals), its encoded bytes."""

    name: str
    data: bytes


def _noise(width: int, height: int, mode: str, rng: np.random.Generator) -> Image.Image:
    """An image of random pixels in a mode Pillow makes from 8-bit bands."""
    bands = {"L": 1, "RGB": 3, "RGBA": 4}[mode]
    values = rng.integers(0, 256, size=(height, width, bands), dtype=np.uint8)
    return Image.fromarray(values[..., 0] if bands == 1 else values, mode=mode)


def _encoded(image: Image.Image, image_format: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=image_format, **options)
    return buffer.getvalue()


def _transparent_palette_png(width: int, height: int, rng: np.random.Generator) -> bytes:
    """A palette PNG whose index 0 is transparent (a tRNS chunk): the processor composites it onto white."""
    indices = rng.integers(0, 16, size=(height, width), dtype=np.uint8)
    image = Image.fromarray(indices, mode="P")
    image.putpalette(rng.integers(0, 256, size=16 * 3, dtype=np.uint8).tolist())
    return _encoded(image, "PNG", transparency=0)


def image_cases(size: int, seed: int = 0) -> list[ImageCase]:
    """The gate's images for a model that takes size x size pixels (the processor's output)."""
    rng = np.random.default_rng(seed)
    larger, smaller = 2 * size + 3, max(size // 2 + 1, 2)
    return [
        ImageCase(f"RGB PNG {size}x{size}", _encoded(_noise(size, size, "RGB", rng), "PNG")),
        ImageCase(f"RGB PNG {larger}x{larger}", _encoded(_noise(larger, larger, "RGB", rng), "PNG")),
        ImageCase(f"RGB PNG {smaller}x{smaller}", _encoded(_noise(smaller, smaller, "RGB", rng), "PNG")),
        ImageCase(f"portrait JPEG {size + 5}x{2 * size}", _encoded(_noise(size + 5, 2 * size, "RGB", rng), "JPEG")),
        ImageCase(
            f"landscape WebP {3 * size}x{size + 7}",
            _encoded(_noise(3 * size, size + 7, "RGB", rng), "WEBP", lossless=True),
        ),
        ImageCase(f"grey PNG {larger}x{size}", _encoded(_noise(larger, size, "L", rng), "PNG")),
        ImageCase(f"RGBA PNG {size}x{larger}", _encoded(_noise(size, larger, "RGBA", rng), "PNG")),
        ImageCase(f"palette PNG with transparency {larger}x{larger}", _transparent_palette_png(larger, larger, rng)),
        ImageCase(f"GIF {size + 1}x{size + 2}", _encoded(_noise(size + 1, size + 2, "RGB", rng), "GIF")),
    ]
