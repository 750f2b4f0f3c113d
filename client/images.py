"""Images as the clients send them: what an input item is, its encoded bytes, and how many go in one request.

An item of `embed` is a text (a `str`) or an image: encoded bytes (PNG, JPEG, WebP, GIF) sent as they
are, a path (`os.PathLike`, e.g. `pathlib.Path`) whose file is read and sent as it is, or a PIL image,
sent as a PNG (lossless; its pixels as they are, no EXIF orientation carried). Pillow is not a
dependency of the client: an item is a PIL image only where the caller has Pillow loaded.
"""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    from PIL import Image

ImageItem: TypeAlias = "bytes | bytearray | memoryview | os.PathLike[str] | Image.Image"
"""An image as `embed` takes it: encoded bytes, a path to its file, or a PIL image."""

IMAGE_REQUEST_BYTES = 1 << 20
"""The encoded images one request carries at most, in bytes (an image larger than this goes alone): half the
server's default --max-message-bytes, which bounds a whole gRPC message."""
PNG_MODES = frozenset({"1", "L", "LA", "P", "RGB", "RGBA"})
"""The PIL modes a PNG holds as they are; an image of another mode (CMYK, YCbCr, I, F...) is sent converted to RGB, as
the server would convert it."""


def encoded_image(item: ImageItem, place: int) -> bytes:
    """An image item's encoded bytes: bytes as they are, a path's file read, a PIL image as a PNG.

    `place` names the item in errors: TypeError for an item that is neither a text nor an image.
    """
    if isinstance(item, bytes):
        return item
    if isinstance(item, bytearray | memoryview):
        return bytes(item)
    if isinstance(item, os.PathLike):
        with open(item, "rb") as file:
            return file.read()
    if _is_pil_image(item):
        return _png(item)
    raise TypeError(
        f"inputs[{place}] is a {type(item).__name__}: give a text (str) or an image (bytes, a path or a PIL image)"
    )


def image_batches(sizes: Sequence[int], batch_size: int, max_bytes: int = IMAGE_REQUEST_BYTES) -> list[range]:
    """Consecutive images grouped into requests: batch_size at most each, and max_bytes of them (but one) at most."""
    batches: list[range] = []
    start = total = 0
    for index, size in enumerate(sizes):
        if index > start and (index - start == batch_size or total + size > max_bytes):
            batches.append(range(start, index))
            start, total = index, 0
        total += size
    if sizes:
        batches.append(range(start, len(sizes)))
    return batches


def _is_pil_image(item: object) -> bool:
    pil = sys.modules.get("PIL.Image")  # not loaded: the item cannot be a PIL image
    return pil is not None and isinstance(item, pil.Image)


def _png(image: Image.Image) -> bytes:
    if image.mode not in PNG_MODES:
        image = image.convert("RGB")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
