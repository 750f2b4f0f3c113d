"""Cohere's API: POST /v2/embed (embeddings in every type), and POST /v1/rerank as Cohere and Jina answer it.

/v1/rerank, as LangChain's CohereRerank/JinaRerank and LlamaIndex call it: `documents` are strings
or {"text": ...} objects; `top_n` keeps the best ones; `return_documents` adds each one's text.
`relevance_score` is the sigmoid of the reranker's logit (in [0, 1], as Cohere's), results best
first. `model` may be left out when exactly one reranker is served.

/v2/embed, as Cohere's v2 client sends it: `texts`, `embedding_types` (float, int8, uint8, binary,
ubinary, base64: little-endian float32 in base64), `input_type` (search_query, search_document,
classification, clustering: the model's prompt of that meaning where it declares one, else its
default prompt), `output_dimension` (a Matryoshka width) and `truncate` (END, the default, or NONE;
START is refused: this server keeps the start of long inputs). A two-tower model takes `images` instead of
`texts` (data URIs, or base64; `input_type` image or none), as Cohere's v2 client sends them.

Errors on both routes come as Cohere's {"message"} (Cohere's own clients, and Jina's, read the status and show
the body).
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Callable

import numpy as np
import orjson

from service.errors import InvalidArgument
from service.frontends.codec import output_array
from service.frontends.http.image_data import image_bytes
from service.frontends.http.tasks import (
    EMBEDDER,
    RERANKER,
    TaskCall,
    bytes_tensor,
    choose_model,
    pair_scores,
    reranked,
)
from service.pipeline.api import (
    BASE64,
    DIMENSIONS,
    EMBEDDING_TYPES,
    IMAGE_INPUT,
    INSTRUCTION,
    JSON,
    PROMPT_NAME,
    SCHEDULING,
    TEXT_INPUT,
    TRUNCATE,
    InferenceRequest,
    InferenceResult,
    InputTensor,
    ModelInfo,
    json_values,
    scheduling_parameters,
    type_output,
)

FIELDS = (
    "model",
    "query",
    "documents",
    "top_n",
    "return_documents",
    "max_chunks_per_doc",
    "rank_fields",
    "instruction",
    *SCHEDULING,
)
EMBED_FIELDS = (
    "model",
    "texts",
    "images",
    "input_type",
    "embedding_types",
    "output_dimension",
    "truncate",
    *SCHEDULING,
)
IMAGE_INPUT_TYPE = "image"
"""Cohere's input_type of images."""
EMBED_TYPES = (*EMBEDDING_TYPES, "base64")
"""Cohere's embedding_types: the served forms, and base64 (the float embedding's bytes)."""
INPUT_TYPE_PROMPTS = {
    "search_query": ("query", "search_query"),
    "search_document": ("document", "passage", "search_document"),
    "classification": ("classification",),
    "clustering": ("clustering",),
}
"""Cohere's input types and the prompt names that mean the same, in the order they are looked for."""
TRUNCATE_CHOICES = {"END": True, "NONE": False}


def _documents(value: object) -> list[str]:
    if not isinstance(value, list) or not value:
        raise InvalidArgument('documents is required: a non-empty list of strings or {"text": ...} objects')
    texts = []
    for index, document in enumerate(value):
        text = document.get("text") if isinstance(document, dict) else document
        if not isinstance(text, str):
            raise InvalidArgument(f"documents[{index}] must be a string or an object with a string field text")
        texts.append(text)
    return texts


def _body(payload: object, accepted: tuple[str, ...]) -> dict:
    """The request body as an object of accepted fields; InvalidArgument naming the first that is not."""
    if not isinstance(payload, dict):
        raise InvalidArgument("the request body must be a JSON object")
    unknown = [name for name in payload if name not in accepted]
    if unknown:
        raise InvalidArgument(f"unrecognized request argument supplied: {unknown[0]} (accepted: {', '.join(accepted)})")
    return payload


async def rerank(call: TaskCall, payload: object) -> bytes:
    """POST /v1/rerank: {"model", "query", "documents", "top_n", "return_documents"} -> {"results": [...], ...}.

    `instruction` (an extension) replaces the default instruction of a reranker with a pair template.
    """
    payload = _body(payload, FIELDS)
    query = payload.get("query")
    if not isinstance(query, str) or not query:
        raise InvalidArgument("query is required: a non-empty string")
    documents = _documents(payload.get("documents"))
    top_n = payload.get("top_n", len(documents))
    if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1:
        raise InvalidArgument(f"top_n must be a positive integer, got {top_n!r}")
    return_documents = payload.get("return_documents", False)
    if not isinstance(return_documents, bool):
        raise InvalidArgument("return_documents must be true or false")
    model = choose_model(call.pipeline, RERANKER, payload.get("model"))

    def body_of(result: InferenceResult) -> Callable[[], object]:
        relevance = pair_scores(result, raw=False)
        best = np.argsort(-relevance, kind="stable")[:top_n]

        def body() -> object:
            results = [
                {
                    "index": int(i),
                    "relevance_score": float(relevance[i]),
                    **({"document": {"text": documents[i]}} if return_documents else {}),
                }
                for i in best
            ]
            return {
                "id": str(uuid.uuid4()),
                "model": model.spec.name,
                "results": results,
                "usage": {"total_tokens": result.prompt_tokens},
            }

        return body

    parameters = scheduling_parameters(payload)
    if payload.get(INSTRUCTION) is not None:
        parameters[INSTRUCTION] = payload[INSTRUCTION]
    return await reranked(call, model, query, documents, parameters, body_of=body_of)


def _embedding_types(value: object) -> list[str]:
    if value is None:
        return ["float"]
    if not isinstance(value, list) or not value or not all(isinstance(kind, str) for kind in value):
        raise InvalidArgument(f"embedding_types must be a non-empty list of {', '.join(EMBED_TYPES)}")
    for kind in value:
        if kind not in EMBED_TYPES:
            raise InvalidArgument(f"embedding_types: {kind!r} is not one of {', '.join(EMBED_TYPES)}")
    return list(dict.fromkeys(value))


def _prompt_name(input_type: object, model: ModelInfo) -> str | None:
    """The model's prompt meaning `input_type`, or None (its default prompt)."""
    if input_type is None:
        return None
    if input_type not in INPUT_TYPE_PROMPTS:
        raise InvalidArgument(f"input_type must be one of {', '.join(INPUT_TYPE_PROMPTS)}, got {input_type!r}")
    return next((name for name in INPUT_TYPE_PROMPTS[input_type] if name in model.spec.prompts), None)


def _truncate(value: object) -> bool:
    if value == "START":
        raise InvalidArgument("truncate START is not supported: this server keeps the start of long inputs (END)")
    if value not in TRUNCATE_CHOICES:
        raise InvalidArgument(f"truncate must be END or NONE, got {value!r}")
    return TRUNCATE_CHOICES[value]


def _embeddings_by_type(arrays: dict[str, np.ndarray]) -> dict[str, object]:
    """Cohere's `embeddings` object: each type's rows, as JSON numbers or (base64) a string a row."""
    embeddings: dict[str, object] = {}
    for kind, array in arrays.items():
        if kind == "base64":
            rows, _ = output_array(array)
            embeddings[kind] = [base64.b64encode(row.tobytes()).decode("ascii") for row in rows]
        else:
            embeddings[kind] = [json_values(row) for row in array]
    return embeddings


async def embed(call: TaskCall, payload: object) -> bytes:
    """POST /v2/embed: {"model", "texts", "input_type", "embedding_types", ...} -> {"embeddings": {type: ...}, ...}."""
    payload = _body(payload, EMBED_FIELDS)
    field = "images" if "images" in payload else "texts"
    items = payload.get(field)
    if "images" in payload and "texts" in payload:
        raise InvalidArgument("send texts or images, not both: each request embeds one kind")
    if not isinstance(items, list) or not items or not all(isinstance(item, str) for item in items):
        raise InvalidArgument(f"{field} is required: a non-empty list of strings")
    kinds = _embedding_types(payload.get("embedding_types"))
    model = choose_model(call.pipeline, EMBEDDER, payload.get("model"))
    outputs = {
        kind: type_output("float" if kind == "base64" else kind, model.signature, "embedding_types") for kind in kinds
    }
    parameters = scheduling_parameters(payload) | {TRUNCATE: _truncate(payload.get("truncate", "END"))}
    if field == "images":
        if payload.get("input_type") not in (None, IMAGE_INPUT_TYPE):
            raise InvalidArgument(f"input_type of images must be {IMAGE_INPUT_TYPE}, got {payload['input_type']!r}")
        encoded = [image_bytes(item, f"images[{index}]") for index, item in enumerate(items)]
        tensor = InputTensor(IMAGE_INPUT, "BYTES", (len(encoded),), encoded, raw=False)
    else:
        tensor = bytes_tensor(TEXT_INPUT, items)
        prompt_name = _prompt_name(payload.get("input_type"), model)
        if prompt_name is not None:
            parameters[PROMPT_NAME] = prompt_name
    if payload.get("output_dimension") is not None:
        parameters[DIMENSIONS] = payload["output_dimension"]
    names = tuple(dict.fromkeys(outputs.values()))
    request = InferenceRequest(
        model=model.spec.name,
        inputs=(tensor,),
        outputs=names,
        parameters=parameters,
        row_limit=call.row_limit,
        encodings={name: BASE64 if kinds == ["base64"] else JSON for name in names},
    )
    async with call.envelope.inference(request) as inference:
        result = inference.result

        def body() -> bytes:
            answer = {
                "id": str(uuid.uuid4()),
                "embeddings": _embeddings_by_type({kind: result.outputs[name] for kind, name in outputs.items()}),
                **({"texts": items} if field == "texts" else {}),
                "meta": {"api_version": {"version": "2"}, "billed_units": {"input_tokens": result.prompt_tokens}},
                "response_type": "embeddings_by_type",
            }
            return orjson.dumps(answer)

        encoded = await inference.encode(body)
    return encoded
