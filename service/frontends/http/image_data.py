"""An image as a JSON body carries it: base64, or a `data:` URI holding base64; never a URL to fetch.

KServe v2 REST's JSON `data` for input `image` and OpenAI `/v1/embeddings` items `{"image": ...}` (Jina's
convention) both write an image's bytes this way. The server fetches nothing: an http(s) URL is refused with
what to send instead.
"""

from __future__ import annotations

import base64
import binascii

from service.errors import InvalidArgument

REMOTE_SCHEMES = ("http://", "https://")


def image_bytes(text: str, where: str) -> bytes:
    """The encoded image a string carries (base64, or a data: URI with base64); `where` names it in refusals."""
    if text.startswith(REMOTE_SCHEMES):
        raise InvalidArgument(
            f"{where} is a URL: this server does not fetch remote images; send the image itself, base64 or as a"
            " data: URI",
            "image_url",
        )
    data = text
    if text.startswith("data:"):
        header, comma, data = text.partition(",")
        media_type, *options = header[len("data:") :].split(";")
        if not comma or "base64" not in options:
            raise InvalidArgument(f"{where}: a data: URI must hold base64 (data:image/png;base64,...)", "image_data")
        if media_type and not media_type.startswith("image/"):
            raise InvalidArgument(f"{where}: data: URI of type {media_type!r}, not an image", "image_data")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as error:
        raise InvalidArgument(f"{where} is not base64 ({error}), nor a data: URI", "image_data") from error
