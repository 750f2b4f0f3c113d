"""OpenAI's embeddings API: POST /v1/embeddings and GET /v1/models, to the engine and back.

As OpenAI's: `input` is a string or a list of strings, `encoding_format` float or base64
(little-endian float32, the SDK's default), `dimensions` only where the model can honestly give
it, `user` accepted and unused, `usage` counted by the model's own tokenizer. Unlike OpenAI's,
token arrays are refused: ids from OpenAI's tokenizer mean nothing to this model.

Extensions: `prompt_name` (sentence-transformers' prompts), `task` (a model's task adapter, as Jina's API:
jina-embeddings-v3's retrieval.query …), `truncate` (false: a text longer than
the model is embedded whole, in windows: service.pipeline.long_texts), `late_chunking` (the inputs
are consecutive chunks of one document, each embedded in its context, as Jina's API) and `embedding_type` (float,
int8, uint8, binary or ubinary: service.pipeline.embedding_types), whose integers come as JSON numbers, or with
encoding_format base64 as their bytes (one byte each). The SDK decodes base64 as float32 when it
chose the format itself, so a compact type is asked for with encoding_format="float" there.

Images (a two-tower model, as Jina's API has them): `input` items may be objects, `{"text": "..."}` or
`{"image": "<base64 or data: URI>"}`, mixed in one list; URLs are refused (nothing is fetched). The texts and the
images of a mixed request run as two inferences (each counted as one), and their vectors come back in the
input's order; a refused image is named by its place in `input`.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field

import numpy as np
import orjson

from service.envelope import RequestEnvelope
from service.errors import InvalidArgument
from service.frontends.codec import output_array
from service.frontends.http.image_data import image_bytes
from service.frontends.http.texts_and_images import embedded
from service.pipeline.api import (
    BASE64,
    EMBEDDING_TYPES,
    IMAGE_INPUT,
    JSON,
    OUTPUT_OF_TYPE,
    SCHEDULING,
    InferenceRequest,
    InputTensor,
    ModelInfo,
    Pipeline,
    RowLimit,
    embedding_types,
    json_values,
    scheduling_parameters,
)

ENCODINGS = ("float", "base64")
FIELDS = (
    "model",
    "input",
    "encoding_format",
    "dimensions",
    "user",
    "prompt_name",
    "embedding_type",
    "truncate",
    "late_chunking",
    "task",
    *SCHEDULING,
)
"""OpenAI's fields, and the extensions prompt_name (sentence-transformers'), embedding_type, truncate,
late_chunking and task (as Jina's API: the inputs are chunks of one document; the task adapter), priority and
timeout (Triton's: where the request waits in the queue, and for how long; the SDK sends them with extra_body)."""
OWNER = "encoder-serve"
TOKEN_ARRAYS_REFUSED = (
    'input must be a string or a list of strings (or of {"text": ...} and {"image": ...} objects): token arrays'
    " are not accepted, this server tokenises with the model's own tokenizer (LangChain:"
    " OpenAIEmbeddings(check_embedding_ctx_length=False))"
)


@dataclass(frozen=True)
class EmbeddingsRequest:
    """A /v1/embeddings body, checked for form (the model and the texts are checked by the engine's rules)."""

    model: str
    items: list[str | bytes]
    """The inputs in order: a text, or an encoded image (bytes)."""
    encoding_format: str
    dimensions: int | None
    prompt_name: str | None = None
    embedding_type: str = "float"
    """One of embedding_types.EMBEDDING_TYPES (checked against the model when it is known)."""
    truncate: bool = True
    late_chunking: bool = False
    task: str | None = None
    """The model's task adapter to embed with (checked against the model by the engine's rules)."""
    scheduling: dict[str, object] = field(default_factory=dict)
    """priority and timeout, where given (checked by the engine's rules)."""


def _items(value: object) -> list[str | bytes]:
    """The input's texts and images (objects with one field, text or image), in order."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise InvalidArgument(TOKEN_ARRAYS_REFUSED)
    items: list[str | bytes] = []
    for index, item in enumerate(value):
        if isinstance(item, dict) and len(item) == 1 and isinstance(next(iter(item.values())), str):
            kind, data = next(iter(item.items()))
            if kind == "text":
                items.append(data)
                continue
            if kind == IMAGE_INPUT:
                items.append(image_bytes(data, f"input[{index}].image"))
                continue
        if not isinstance(item, str):
            kinds = '{"text": "..."} or {"image": "<base64 or data: URI>"}'
            raise InvalidArgument(
                f"input[{index}]: an item is a string, {kinds}" if isinstance(item, dict) else TOKEN_ARRAYS_REFUSED
            )
        items.append(item)
    return items


def parse_embeddings(payload: object) -> EmbeddingsRequest:
    """The fields of a /v1/embeddings body; InvalidArgument names the first one that is wrong."""
    if not isinstance(payload, dict):
        raise InvalidArgument("the request body must be a JSON object")
    unknown = [name for name in payload if name not in FIELDS]
    if unknown:
        raise InvalidArgument(f"unrecognized request argument supplied: {unknown[0]} (accepted: {', '.join(FIELDS)})")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidArgument("model is required: the name of a served model (GET /v1/models lists them)")
    if "input" not in payload:
        raise InvalidArgument("input is required: a string or a list of strings")
    encoding_format = payload.get("encoding_format", "float")
    if encoding_format not in ENCODINGS:
        raise InvalidArgument(f"encoding_format must be one of {', '.join(ENCODINGS)}, got {encoding_format!r}")
    dimensions = payload.get("dimensions")
    if dimensions is not None and (isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1):
        raise InvalidArgument(f"dimensions must be a positive integer, got {dimensions!r}")
    if not isinstance(payload.get("user", ""), str):
        raise InvalidArgument("user must be a string")
    prompt_name = payload.get("prompt_name")
    if prompt_name is not None and not isinstance(prompt_name, str):
        raise InvalidArgument("prompt_name must be a string: the name of one of the model's prompts")
    task = payload.get("task")
    if task is not None and not isinstance(task, str):
        raise InvalidArgument("task must be a string: the name of one of the model's task adapters")
    embedding_type = payload.get("embedding_type", "float")
    if embedding_type not in EMBEDDING_TYPES:
        raise InvalidArgument(f"embedding_type must be one of {', '.join(EMBEDDING_TYPES)}, got {embedding_type!r}")
    truncate, late_chunking = payload.get("truncate", True), payload.get("late_chunking", False)
    if not isinstance(truncate, bool) or not isinstance(late_chunking, bool):
        raise InvalidArgument(
            f"{'truncate' if not isinstance(truncate, bool) else 'late_chunking'} must be true or false"
        )
    items = _items(payload["input"])
    return EmbeddingsRequest(
        model, items, encoding_format, dimensions, prompt_name, embedding_type, truncate, late_chunking, task,
        scheduling_parameters(payload),
    )  # fmt: skip


def _embeddings_body(vectors: np.ndarray, request: EmbeddingsRequest, prompt_tokens: int) -> bytes:
    rows, _ = output_array(vectors)
    if request.encoding_format == "base64":
        embeddings: list[object] = [base64.b64encode(row.tobytes()).decode("ascii") for row in rows]
    else:
        embeddings = [json_values(row) for row in rows]
    body = {
        "object": "list",
        "data": [{"object": "embedding", "index": index, "embedding": item} for index, item in enumerate(embeddings)],
        "model": request.model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
    return orjson.dumps(body)


async def embeddings(envelope: RequestEnvelope, request: EmbeddingsRequest, max_inputs: int) -> bytes:
    """Answer a /v1/embeddings request (`parse_embeddings`): its items' inferences (texts_and_images), OpenAI's answer.

    The answer is written inside the request's answer budget: its bytes stay there until the body is sent.
    """
    output = OUTPUT_OF_TYPE[request.embedding_type]
    async with embedded(
        envelope,
        request.items,
        request_for=lambda tensor: _inference_request(request, max_inputs, tensor),
        place=lambda index: f"input[{index}]",
        max_inputs=max_inputs,
    ) as result:
        vectors = result.outputs[output]
        return await result.inference.encode(lambda: _embeddings_body(vectors, request, result.prompt_tokens))


def _inference_request(request: EmbeddingsRequest, max_inputs: int, tensor: InputTensor) -> InferenceRequest:
    """The engine's request for the items of one kind (texts_and_images.items_tensor)."""
    output = OUTPUT_OF_TYPE[request.embedding_type]
    return InferenceRequest(
        model=request.model,
        inputs=(tensor,),
        outputs=(output,),
        row_limit=RowLimit(max_inputs, "--max-embedding-inputs"),
        dimensions=request.dimensions,
        parameters={"truncate": request.truncate}
        | ({"late_chunking": True} if request.late_chunking else {})
        | ({} if request.prompt_name is None else {"prompt_name": request.prompt_name})
        | ({} if request.task is None else {"task": request.task})
        | request.scheduling,
        encodings={output: BASE64 if request.encoding_format == "base64" else JSON},
    )


def _model_card(model: ModelInfo, created: int) -> dict[str, object]:
    """OpenAI's model object, with what this model does: its task, and an embedder's prompts and widths."""
    spec = model.spec
    card: dict[str, object] = {"id": spec.name, "object": "model", "created": created, "owned_by": OWNER}
    card["task"] = spec.task
    if spec.task == "embed":
        card["prompts"] = spec.prompts
        card["default_prompt_name"] = spec.default_prompt_name or None
        card["dimensions"] = [spec.hidden_size, *spec.matryoshka_dimensions]
        card["embedding_types"] = embedding_types(model.signature)
        card["tasks"] = list(spec.adapter_tasks)
    elif spec.task == "classify":
        card["labels"] = list(spec.labels)
    return card


def models_list(pipeline: Pipeline, created: int) -> bytes:
    """GET /v1/models: every loaded model (`created`: when the server started, seconds since the epoch)."""
    data = [_model_card(model, created) for model in pipeline.models()]
    return json.dumps({"object": "list", "data": data}).encode()


def model_card(pipeline: Pipeline, name: str, created: int) -> bytes:
    """GET /v1/models/{model}: one loaded model, or NotFound."""
    return json.dumps(_model_card(pipeline.model(name), created)).encode()
