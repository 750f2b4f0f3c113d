"""How large a request each transport receives: --max-message-bytes, raised where a model takes images.

The rule (docs/configuration.md, "Message and image limits"): a server that serves a model with an image tower
receives a request that carries one image of --max-image-bytes, so that an image is refused by its own limit
(INVALID_ARGUMENT naming it; HTTP 413) and never first by the transport's. Over gRPC (grpcio and Envoy alike)
that is the image's bytes and IMAGE_FRAMING_BYTES for the fields around them; over HTTP, the image's base64
(4 bytes for every 3) and the same allowance. Never below --max-message-bytes; a text-only server receives
--max-message-bytes as set. Decided once at start, before any model loads: from the repository's model folders
(an image variant in a model's config.pbtxt), and for a model given by name (--model), whose towers are known
only once it is exported, as if it took images.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from service.core.repository import RepositoryError, model_directories, read_model
from service.ops.settings import Settings

IMAGE_FRAMING_BYTES = 64 * 1024
"""What a request holds besides its one image: the model's name, the input's name and shape, parameters, JSON."""


@dataclass(frozen=True)
class ReceiveLimits:
    """The largest request each transport receives, bytes."""

    grpc_bytes: int
    """A gRPC message, as received and once decompressed (grpcio's max_receive_message_length, Envoy's app's)."""
    http_bytes: int
    """An HTTP request body."""

    @classmethod
    def of(cls, settings: Settings, takes_images: bool) -> ReceiveLimits:
        """The limits for these settings, on a server where a model takes images (`takes_images`) or none does."""
        message = settings.max_message_bytes
        if not takes_images:
            return cls(message, message)
        image = settings.max_image_bytes
        return cls(
            max(message, image + IMAGE_FRAMING_BYTES),
            max(message, 4 * math.ceil(image / 3) + IMAGE_FRAMING_BYTES),
        )


def takes_images(settings: Settings) -> bool:
    """Whether a model this server serves may take images: one given by name, or a folder with an image tower.

    A folder that cannot be read takes none here: its load refuses it.
    """
    if settings.model:
        return True
    if not settings.serves_repository:
        return False
    for folder in model_directories(settings.model_repository):
        try:
            if read_model(folder).image_variants:
                return True
        except RepositoryError:
            continue
    return False
