"""OpenAI's embeddings API: POST /v1/embeddings and GET /v1/models, to the engine and back.

As OpenAI's: `input` is a string or a list of strings, `encoding_format` float or base64
(little-endian float32, the SDK's default), `dimensions` only where the model can honestly give
it, `user` accepted and unused, `usage` counted by the model's own tokenizer. Unlike OpenAI's,
token arrays are refused: ids from OpenAI's tokenizer mean nothing to this model.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass

import numpy as np
import orjson

from service.core.repository import ModelSpec
from service.envelope import Envelope, RequestContext
from service.errors import InvalidArgument
from service.pipeline.answers import BASE64_VALUE_BYTES, JSON_VALUE_BYTES, json_values
from service.pipeline.api import InferenceRequest, InferenceResult, InputTensor, Pipeline, RowLimit
from service.pipeline.validation import TEXT_INPUT

ENCODINGS = ("float", "base64")
FIELDS = ("model", "input", "encoding_format", "dimensions", "user", "prompt_name")
"""OpenAI's fields, and sentence-transformers' prompt_name (the SDK sends it with extra_body)."""
OWNER = "encoder-serve"
_FLOAT32 = np.dtype("<f4")
TOKEN_ARRAYS_REFUSED = (
    "input must be a string or a list of strings: token arrays are not accepted, this server tokenises with"
    " the model's own tokenizer (LangChain: OpenAIEmbeddings(check_embedding_ctx_length=False))"
)


@dataclass(frozen=True)
class EmbeddingsRequest:
    """A /v1/embeddings body, checked for form (the model and the texts are checked by the engine's rules)."""

    model: str
    texts: list[str]
    encoding_format: str
    dimensions: int | None
    prompt_name: str | None = None


def _texts(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return value
    raise InvalidArgument(TOKEN_ARRAYS_REFUSED)


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
    return EmbeddingsRequest(model, _texts(payload["input"]), encoding_format, dimensions, prompt_name)


def _embeddings_body(vectors: np.ndarray, request: EmbeddingsRequest, prompt_tokens: int) -> bytes:
    rows = np.ascontiguousarray(vectors, dtype=_FLOAT32)
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


async def embeddings(
    door: Envelope, context: RequestContext, request: EmbeddingsRequest, max_inputs: int
) -> tuple[bytes, InferenceResult]:
    """Answer a /v1/embeddings request (`parse_embeddings`): its texts in one inference, OpenAI's answer.

    The result comes back with the body: its bytes stay in the answer budget until the body is sent.
    """
    # surrogatepass: a lone surrogate (legal in JSON) reaches the engine's UTF-8 check and its message.
    elements = [text.encode("utf-8", "surrogatepass") for text in request.texts]
    texts = InputTensor(TEXT_INPUT, "BYTES", (len(elements),), elements, raw=False)
    value_bytes = BASE64_VALUE_BYTES if request.encoding_format == "base64" else JSON_VALUE_BYTES
    inference_request = InferenceRequest(
        model=request.model,
        inputs=(texts,),
        outputs=("embedding",),
        row_limit=RowLimit(max_inputs, "--max-embedding-inputs"),
        dimensions=request.dimensions,
        parameters={} if request.prompt_name is None else {"prompt_name": request.prompt_name},
        value_bytes={"embedding": value_bytes},
    )
    async with door.inference(context, inference_request) as inference:
        result = inference.result
        vectors = result.outputs["embedding"]
        body = await inference.encode(lambda: _embeddings_body(vectors, request, result.prompt_tokens))
    return body, result


def _model_card(spec: ModelSpec, created: int) -> dict[str, object]:
    """OpenAI's model object, with what this model does: its task, and an embedder's prompts and widths."""
    card: dict[str, object] = {"id": spec.name, "object": "model", "created": created, "owned_by": OWNER}
    card["task"] = spec.task
    if spec.task == "embed":
        card["prompts"] = spec.prompts
        card["default_prompt_name"] = spec.default_prompt_name or None
        card["dimensions"] = [spec.hidden_size, *spec.matryoshka_dimensions]
    else:
        card["labels"] = list(spec.labels)
    return card


def models_list(pipeline: Pipeline, created: int) -> bytes:
    """GET /v1/models: every loaded model (`created`: when the server started, seconds since the epoch)."""
    data = [_model_card(model.spec, created) for model in pipeline.models()]
    return json.dumps({"object": "list", "data": data}).encode()


def model_card(pipeline: Pipeline, name: str, created: int) -> bytes:
    """GET /v1/models/{model}: one loaded model, or NotFound."""
    return json.dumps(_model_card(pipeline.model(name).spec, created)).encode()
