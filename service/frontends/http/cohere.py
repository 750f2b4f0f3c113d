"""Cohere's API: POST /v2/embed (embeddings in every type), and POST /v1/rerank as Cohere and Jina answer it.

/v1/rerank, as LangChain's CohereRerank/JinaRerank and LlamaIndex call it: `documents` are strings
or {"text": ...} objects; `top_n` keeps the best ones; `return_documents` adds each one's text.
`relevance_score` is the sigmoid of the reranker's logit (in [0, 1], as Cohere's), results best
first. `model` may be left out when exactly one reranker is served. A two-tower (CLIP, SigLIP) embed model
reranks too, chosen when images are sent or named: the query and the documents may be images,
{"image": "<base64 or data: URI>"} as Jina's API sends them, and `relevance_score` is the cosine of the
served vectors (in [-1, 1]).

/v2/embed, as Cohere's v2 client sends it: `texts`, `embedding_types` (float, int8, uint8, binary,
ubinary, base64: little-endian float32 in base64), `input_type` (search_query, search_document,
classification, clustering: the model's prompt of that meaning where it declares one, else its
default prompt), `output_dimension` (a Matryoshka width) and `truncate` (END, the default, or NONE;
START is refused: this server keeps the start of long inputs).
On a two-tower model `images` (data: URIs, or base64) replaces `texts`, or `inputs` mixes them, each input one
part: {"type": "text", "text"} or {"type": "image_url", "image_url": {"url": "data:..."}} (a text and an image
fused into one vector is refused: the towers embed one or the other). URLs are refused (nothing is fetched), and
a refused image or text is named by its place (images[i], inputs[i]). input_type image means no prompt (images
take none).

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
    TaskCall,
    choose_model,
    rerank_model,
    reranked,
)
from service.frontends.http.texts_and_images import ITEM_KINDS, Item, embedded, item_of
from service.pipeline.api import (
    BASE64,
    DIMENSIONS,
    EMBEDDING_TYPES,
    IMAGE_INPUT,
    INSTRUCTION,
    JSON,
    PROMPT_NAME,
    SCHEDULING,
    TRUNCATE,
    InferenceRequest,
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
    "inputs",
    "input_type",
    "embedding_types",
    "output_dimension",
    "truncate",
    *SCHEDULING,
)
EMBED_TYPES = (*EMBEDDING_TYPES, "base64")
"""Cohere's embedding_types: the served forms, and base64 (the float embedding's bytes)."""
INPUT_TYPE_PROMPTS = {
    "search_query": ("query", "search_query"),
    "search_document": ("document", "passage", "search_document"),
    "classification": ("classification",),
    "clustering": ("clustering",),
    IMAGE_INPUT: (),
}
"""Cohere's input types and the prompt names that mean the same, in the order they are looked for."""
TRUNCATE_CHOICES = {"END": True, "NONE": False}


def _documents(value: object) -> list[Item]:
    if not isinstance(value, list) or not value:
        raise InvalidArgument(f"documents is required: a non-empty list of strings or {ITEM_KINDS} objects")
    documents = []
    for index, document in enumerate(value):
        item = item_of(document, f"documents[{index}]")
        if item is None:
            raise InvalidArgument(f"documents[{index}] must be a string or an object {ITEM_KINDS}")
        documents.append(item)
    return documents


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

    `instruction` (an extension) replaces the default instruction of a reranker with a pair template. On a
    two-tower embed model (chosen when images are sent, or named) the query and the documents may be images,
    {"image": "<base64 or data: URI>"} (as Jina's API sends them), scored by the cosine of the served vectors.
    """
    payload = _body(payload, FIELDS)
    query = item_of(payload.get("query"), "query")
    if query is None or query == "":
        raise InvalidArgument(f"query is required: a non-empty string, or {ITEM_KINDS}")
    documents = _documents(payload.get("documents"))
    top_n = payload.get("top_n", len(documents))
    if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1:
        raise InvalidArgument(f"top_n must be a positive integer, got {top_n!r}")
    return_documents = payload.get("return_documents", False)
    if not isinstance(return_documents, bool):
        raise InvalidArgument("return_documents must be true or false")
    model = rerank_model(call.pipeline, payload.get("model"), [query, *documents])

    def returned(index: int) -> dict[str, object]:
        """The document as it was sent: {"text": ...}, or {"image": ...} as the request wrote it."""
        if isinstance(documents[index], str):
            return {"document": {"text": documents[index]}}
        return {"document": {"image": payload["documents"][index]["image"]}}

    def body_of(relevance: np.ndarray, prompt_tokens: int) -> Callable[[], object]:
        best = np.argsort(-relevance, kind="stable")[:top_n]

        def body() -> object:
            results = [
                {
                    "index": int(i),
                    "relevance_score": float(relevance[i]),
                    **(returned(int(i)) if return_documents else {}),
                }
                for i in best
            ]
            return {
                "id": str(uuid.uuid4()),
                "model": model.spec.name,
                "results": results,
                "usage": {"total_tokens": prompt_tokens},
            }

        return body

    parameters = scheduling_parameters(payload)
    if payload.get(INSTRUCTION) is not None:
        parameters[INSTRUCTION] = payload[INSTRUCTION]
    return await reranked(
        call, model, query, documents, parameters, raw=False, documents_field="documents", body_of=body_of
    )


def _embedding_types(value: object) -> list[str]:
    if value is None:
        return ["float"]
    if not isinstance(value, list) or not value or not all(isinstance(kind, str) for kind in value):
        raise InvalidArgument(f"embedding_types must be a non-empty list of {', '.join(EMBED_TYPES)}")
    for kind in value:
        if kind not in EMBED_TYPES:
            raise InvalidArgument(f"embedding_types: {kind!r} is not one of {', '.join(EMBED_TYPES)}")
    return list(dict.fromkeys(value))


def _prompt_name(input_type: object, model: ModelInfo, texts: bool) -> str | None:
    """The model's prompt meaning `input_type`, or None (its default prompt); `texts`: whether texts are embedded.

    A prompt is put before texts only; input_type image (for images alone) means none.
    """
    if input_type is None:
        return None
    if input_type not in INPUT_TYPE_PROMPTS or (texts and input_type == IMAGE_INPUT):
        for_texts = ", ".join(kind for kind in INPUT_TYPE_PROMPTS if kind != IMAGE_INPUT)
        raise InvalidArgument(
            f"input_type must be one of {for_texts} (texts and inputs), or image (images), got {input_type!r}"
        )
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


def _embed_items(payload: dict) -> tuple[list[Item], Callable[[int], str]]:
    """The items of a /v2/embed body (its texts, images or inputs) and how a refusal names the item at a place."""
    given = [name for name in ("texts", "images", "inputs") if payload.get(name) is not None]
    if len(given) > 1:
        raise InvalidArgument(
            f"send texts or images, not both, or inputs alone: this request gives {' and '.join(given)}"
        )
    if given == ["images"]:
        images = payload["images"]
        if not isinstance(images, list) or not images or not all(isinstance(image, str) for image in images):
            raise InvalidArgument("images must be a non-empty list of data: URIs (data:image/png;base64,...)")
        return [image_bytes(image, f"images[{index}]") for index, image in enumerate(images)], "images[{}]".format
    if given == ["inputs"]:
        inputs = payload["inputs"]
        if not isinstance(inputs, list) or not inputs:
            raise InvalidArgument('inputs must be a non-empty list of {"content": [...]} objects')
        return [_input_item(value, index) for index, value in enumerate(inputs)], "inputs[{}]".format
    texts = payload.get("texts")
    if not isinstance(texts, list) or not texts or not all(isinstance(text, str) for text in texts):
        raise InvalidArgument("texts is required: a non-empty list of strings (or images, or inputs)")
    return texts, "texts[{}]".format


def _input_item(value: object, index: int) -> Item:
    """One of Cohere's `inputs`: {"content": [one part]}, a text part or an image_url part (a data: URI)."""
    where = f"inputs[{index}]"
    content = value.get("content") if isinstance(value, dict) else None
    if not isinstance(content, list) or len(content) != 1 or not isinstance(content[0], dict):
        fused = isinstance(content, list) and len(content) > 1
        raise InvalidArgument(
            f"{where}: content must hold one part, a text or an image_url"
            + (f" (it holds {len(content)}: the towers embed a text or an image, never both fused)" if fused else "")
        )
    part, where = content[0], f"{where}.content[0]"
    if part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    if part.get("type") == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if isinstance(url, str):
            return image_bytes(url, f"{where}.image_url")
    raise InvalidArgument(
        f'{where} must be {{"type": "text", "text": "..."}} or {{"type": "image_url", "image_url": {{"url":'
        ' "data:image/...;base64,..."}}'
    )


async def embed(call: TaskCall, payload: object) -> bytes:
    """POST /v2/embed: {"model", "texts" | "images" | "inputs", "input_type", "embedding_types", ...}.

    Answers {"embeddings": {type: [...]}, ...}, a row per text, image or input, in their order.
    """
    payload = _body(payload, EMBED_FIELDS)
    items, place = _embed_items(payload)
    kinds = _embedding_types(payload.get("embedding_types"))
    model = choose_model(call.pipeline, EMBEDDER, payload.get("model"))
    outputs = {
        kind: type_output("float" if kind == "base64" else kind, model.signature, "embedding_types") for kind in kinds
    }
    parameters = scheduling_parameters(payload) | {TRUNCATE: _truncate(payload.get("truncate", "END"))}
    prompt_name = _prompt_name(payload.get("input_type"), model, any(isinstance(item, str) for item in items))
    if prompt_name is not None:
        parameters[PROMPT_NAME] = prompt_name
    if payload.get("output_dimension") is not None:
        parameters[DIMENSIONS] = payload["output_dimension"]
    names = tuple(dict.fromkeys(outputs.values()))

    def request_for(tensor: InputTensor) -> InferenceRequest:
        return InferenceRequest(
            model=model.spec.name,
            inputs=(tensor,),
            outputs=names,
            parameters=parameters,
            row_limit=call.row_limit,
            encodings={name: BASE64 if kinds == ["base64"] else JSON for name in names},
        )

    image_count = sum(isinstance(item, bytes) for item in items)
    async with embedded(
        call.envelope, items, request_for=request_for, place=place, max_inputs=call.max_inputs
    ) as result:

        def body() -> bytes:
            billed = {"input_tokens": result.prompt_tokens} | ({"images": image_count} if image_count else {})
            answer = {
                "id": str(uuid.uuid4()),
                "embeddings": _embeddings_by_type({kind: result.outputs[name] for kind, name in outputs.items()}),
                **({"texts": items} if payload.get("texts") is not None else {}),
                "meta": {"api_version": {"version": "2"}, "billed_units": billed},
                "response_type": "embeddings_by_type",
            }
            return orjson.dumps(answer)

        encoded = await result.inference.encode(body)
    return encoded
