"""Texts and images in one HTTP request to a two-tower model: each kind's inference, the vectors in the items' order.

An engine request carries texts or images, never both (service.pipeline.validation). A route whose request mixes
them (OpenAI's and Cohere's `inputs`, a rerank's image query among text documents, /similarity's image sentences)
runs the texts' inference and the images' as the parts of one request (the envelope's `inferences`: counted once,
its tenant admitted and charged once) and reads each output back in the items' order. A refusal naming a
text or an image by its place in its own inference is renamed by that item's place in the request.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

import numpy as np

from service.envelope import Inference, RequestEnvelope
from service.errors import InvalidArgument, RequestTooLarge, ServiceError
from service.frontends.http.image_data import image_bytes
from service.pipeline.api import IMAGE_INPUT, TEXT_INPUT, InferenceRequest, InferenceResult, InputTensor

Item = str | bytes
"""One input of a request: a text, or an encoded image."""
ITEM_KINDS = '{"text": "..."} or {"image": "<base64 or data: URI>"}'
"""How a request writes a text or an image as an object (Jina's convention), for refusals."""
_ENGINE_NAMES = {
    str: re.compile(r"\binput text\[(\d+)\]"),
    bytes: re.compile(r"\bimage (\d+)\b|\binput image\[(\d+)\]"),
}
"""How the engine's refusals name a text, and an image, by its place in its own inference."""


def item_of(value: object, where: str) -> Item | None:
    """A string or {"text": str} as its text, {"image": base64 or data: URI} as its bytes; None for anything else.

    `where` names the item in the refusal of an image that is not one (a URL, not base64).
    """
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and len(value) == 1:
        kind, data = next(iter(value.items()))
        if kind == "text" and isinstance(data, str):
            return data
        if kind == IMAGE_INPUT and isinstance(data, str):
            return image_bytes(data, f"{where}.image")
    return None


def has_images(items: Sequence[Item]) -> bool:
    """Whether any item is an image."""
    return any(isinstance(item, bytes) for item in items)


def items_tensor(items: Sequence[Item]) -> InputTensor:
    """Items of one kind as the engine's input: texts as `text`, images as `image` (BYTES, one element each)."""
    if isinstance(items[0], bytes):
        return InputTensor(IMAGE_INPUT, "BYTES", (len(items),), list(items), raw=False)
    # surrogatepass: a lone surrogate (legal in JSON) reaches the engine's UTF-8 check and its message.
    elements = [text.encode("utf-8", "surrogatepass") for text in items]
    return InputTensor(TEXT_INPUT, "BYTES", (len(elements),), elements, raw=False)


@dataclass(frozen=True)
class ItemsEmbedded:
    """The outputs of a request's items, each output's rows in the items' order."""

    outputs: dict[str, np.ndarray]
    prompt_tokens: int
    inference: Inference[InferenceResult]
    """The last inference run: its `encode` writes the answer inside the request's answer budget."""


@asynccontextmanager
async def embedded(
    envelope: RequestEnvelope,
    items: Sequence[Item],
    *,
    request_for: Callable[[InputTensor], InferenceRequest],
    place: Callable[[int], str],
    max_inputs: int,
) -> AsyncIterator[ItemsEmbedded]:
    """The items run as one request of one inference per kind (`request_for` makes each), held until answered.

    Texts alone run as one inference whose refusals stay as the engine words them. Where images are among the
    items, a refusal naming one of them is renamed `place(index)` (its place in the request), and the request's
    items count against `max_inputs` (--max-embedding-inputs) together.
    """
    places = {kind: [index for index, item in enumerate(items) if isinstance(item, kind)] for kind in (str, bytes)}
    if not places[bytes]:
        async with envelope.inference(request_for(items_tensor(items))) as inference:
            yield ItemsEmbedded(inference.result.outputs, inference.result.prompt_tokens, inference)
        return
    if len(items) > max_inputs:
        raise RequestTooLarge(
            f"{len(items)} inputs, over the limit of {max_inputs} per request (--max-embedding-inputs)",
            "too_many_inputs",
        )
    kinds = [kind for kind in (str, bytes) if places[kind]]
    parts = [request_for(items_tensor([items[index] for index in places[kind]])) for kind in kinds]
    async with AsyncExitStack() as stack:
        try:
            runs = await stack.enter_async_context(envelope.inferences(parts))
        except ServiceError as error:
            raise _named_by_place(error, places, place) from error
        order = np.argsort(np.array([index for kind in kinds for index in places[kind]]), kind="stable")
        outputs = {
            name: np.concatenate([run.result.outputs[name] for run in runs])[order] for name in runs[0].result.outputs
        }
        yield ItemsEmbedded(outputs, sum(run.result.prompt_tokens for run in runs), runs[-1])


def _named_by_place(error: ServiceError, places: dict[type, list[int]], place: Callable[[int], str]) -> ServiceError:
    """A refusal (InvalidArgument), each text or image it names renamed by its place in the request."""
    if not isinstance(error, InvalidArgument):
        return error
    message = str(error)
    for kind, pattern in _ENGINE_NAMES.items():

        def renamed(match: re.Match[str], kind: type = kind) -> str:
            number = int(next(group for group in match.groups() if group is not None))
            return place(places[kind][number]) if number < len(places[kind]) else match.group(0)

        message = pattern.sub(renamed, message)
    return error if message == str(error) else type(error)(message, error.reason)
