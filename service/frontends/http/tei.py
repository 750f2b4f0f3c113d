"""text-embeddings-inference's routes: POST /embed, /similarity, /rerank, /predict, /tokenize, /decode and GET /info.

Request and answer shapes are TEI's, so its clients (LangChain's HuggingFaceEndpointEmbeddings,
huggingface_hub's InferenceClient, TEI's own examples) work unchanged. These routes name no model:
each goes to the one served model of the task it needs (an embedder for /embed, /similarity,
/tokenize and /decode, a reranker, a classifier of one label, for /rerank, any classifier for
/predict); an optional `model` field chooses when several are served (the choice, and the one
inference a route runs, are shared with Cohere's routes: tasks.py).

Where this server differs from TEI: `truncate` defaults to true (as sentence-transformers and the
server's other routes; false refuses over-long inputs with 422, where TEI answers 413), and
`normalize: false` is refused for a model that normalises inside its graph (its unnormalised
vectors are not there). An empty list (`inputs`, `sentences`) is 422, where TEI answers 400 ("Empty").
A model failure is 424 ("Backend"), as TEI answers it.

Images (an extension): on a two-tower embed model (CLIP, SigLIP), /similarity's source and sentences and
/rerank's query and texts may be images, {"image": "<base64 or data: URI>"} (texts also {"text": ...}, Jina's
convention), scored by the cosine of the served vectors; a refused item is named by its place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import orjson

from service.errors import InvalidArgument, NotFound
from service.frontends.http.tasks import (
    CLASSIFIER,
    EMBEDDER,
    SPARSE_EMBEDDER,
    TOKEN_VECTORS,
    TWO_TOWER,
    Need,
    TaskCall,
    answered,
    bytes_tensor,
    choose_model,
    cosines_to_first,
    rerank_model,
    reranked,
    scores,
    utf8,
)
from service.frontends.http.texts_and_images import ITEM_KINDS, Item, embedded, has_images, item_of
from service.pipeline.api import (
    DIMENSIONS,
    EMBEDDING,
    INDICES,
    INPUT_TYPE,
    INSTRUCTION,
    JSON,
    MULTIVECTOR,
    MULTIVECTOR_LENGTHS,
    PROMPT_NAME,
    QUERY_INPUT,
    RAW,
    SCHEDULING,
    TEXT_INPUT,
    TOKEN_STATES,
    TOP_K,
    TRUNCATE,
    VALUES,
    DecodeRequest,
    InferenceRequest,
    InferenceResult,
    InputTensor,
    ModelInfo,
    Pipeline,
    Token,
    TokenizeRequest,
    scheduling_parameters,
    type_output,
)

EMBED_ALL_FIELDS = ("inputs", "truncate", "truncation_direction", "prompt_name", "input_type", "model", *SCHEDULING)
SPARSE_FIELDS = ("inputs", "truncate", "truncation_direction", "prompt_name", "top_k", "model", *SCHEDULING)
EMBED_FIELDS = (
    "inputs",
    "normalize",
    "truncate",
    "truncation_direction",
    "prompt_name",
    "dimensions",
    "embedding_type",
    "model",
    *SCHEDULING,
)
RERANK_FIELDS = (
    "query",
    "texts",
    "raw_scores",
    "return_text",
    "truncate",
    "truncation_direction",
    "model",
    "instruction",
    *SCHEDULING,
)
PREDICT_FIELDS = ("inputs", "raw_scores", "truncate", "truncation_direction", "model", *SCHEDULING)
TOKENIZE_FIELDS = ("inputs", "add_special_tokens", "prompt_name", "model")
SIMILARITY_FIELDS = ("inputs", "parameters", "model", *SCHEDULING)
SIMILARITY_INPUTS = ("source_sentence", "sentences")
SIMILARITY_PARAMETERS = ("truncate", "truncation_direction", "prompt_name")
"""TEI's SimilarityParameters: they go in the body's `parameters` object, as Hugging Face's sentence-similarity task
sends them."""
DECODE_FIELDS = ("ids", "skip_special_tokens", "model")


def _object(payload: object, fields: tuple[str, ...], name: str = "") -> dict:
    """A JSON object of only these fields (`name`: where it is in the body; the body itself when empty)."""
    if not isinstance(payload, dict):
        raise InvalidArgument(f"{name or 'the request body'} must be a JSON object")
    unknown = [field for field in payload if field not in fields]
    if unknown:
        where = f" in {name}" if name else ""
        raise InvalidArgument(f"unknown field {unknown[0]!r}{where} (accepted: {', '.join(fields)})")
    if payload.get("truncation_direction", "Right") not in ("Right", "right"):
        raise InvalidArgument("truncation_direction must be Right: this server keeps the start of long inputs")
    return payload


def _flag(payload: dict, name: str, default: bool) -> bool:
    value = payload.get(name, default)
    if not isinstance(value, bool):
        raise InvalidArgument(f"{name} must be true or false")
    return value


def _strings(value: object, name: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(item, str) for item in value):
        return value
    raise InvalidArgument(f"{name} must be a string or a non-empty list of strings")


def _parameters(payload: dict, *names: str) -> dict[str, bool | int | float | str]:
    """The engine's request parameters from the body's fields of these names and its scheduling fields, where given."""
    return {name: payload[name] for name in names if payload.get(name) is not None} | scheduling_parameters(payload)


def _text_route(
    call: TaskCall, payload: object, accepted: tuple[str, ...], need: Need
) -> tuple[dict, list[str], ModelInfo]:
    """A route over texts: its body's fields (each accepted, `truncate` a flag), its texts, and the model it goes to."""
    fields = _object(payload, accepted)
    if "inputs" not in fields:
        raise InvalidArgument("inputs is required: a string or a list of strings")
    texts = _strings(fields["inputs"], "inputs")
    model = choose_model(call.pipeline, need, fields.get("model"))
    _flag(fields, TRUNCATE, True)
    return fields, texts, model


async def embed(call: TaskCall, payload: object) -> bytes:
    """POST /embed: {"inputs": str | [str], "normalize", "truncate", "prompt_name", "dimensions"} -> [[float]].

    `embedding_type` (an extension: int8, uint8, binary, ubinary) answers that form of the model's own
    vector as integers; `normalize` applies to float vectors only.
    """
    fields, texts, model = _text_route(call, payload, EMBED_FIELDS, EMBEDDER)
    normalize = _flag(fields, "normalize", True)
    if not normalize and model.spec.normalize:
        raise InvalidArgument(
            f"model {model.spec.name} normalises its embeddings in its graph: normalize false is not available"
        )
    parameters = _parameters(fields, TRUNCATE, PROMPT_NAME, DIMENSIONS)
    output = type_output(fields.get("embedding_type", "float"), model.signature, "embedding_type")

    def body_of(result: InferenceResult) -> Callable[[], object]:
        vectors = result.outputs[output]
        if output == EMBEDDING and normalize and not model.spec.normalize:
            vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        return lambda: vectors

    return await answered(call, model, (bytes_tensor(TEXT_INPUT, texts),), output, parameters, body_of=body_of)


async def embed_all(call: TaskCall, payload: object) -> bytes:
    """POST /embed_all: {"inputs": str | [str], "truncate", "prompt_name", "input_type"} -> [[[float]]], token vectors.

    An embedder's last hidden state of every token of each text, special tokens included, padding left
    out (sentence-transformers' `encode(output_value="token_embeddings")`); a multi-vector model's
    vectors of each text (service.pipeline.multivector), as a query or a document (`input_type`, an
    extension; default document).
    """
    fields, texts, model = _text_route(call, payload, EMBED_ALL_FIELDS, TOKEN_VECTORS)
    if MULTIVECTOR in model.signature.outputs:
        return await _multivectors(call, model, texts, _parameters(fields, TRUNCATE, PROMPT_NAME, INPUT_TYPE))
    if INPUT_TYPE in fields:
        raise InvalidArgument(f"input_type: model {model.spec.name} is not a multi-vector model")
    parameters = _parameters(fields, TRUNCATE, PROMPT_NAME)

    def body_of(result: InferenceResult) -> Callable[[], object]:
        states = result.outputs[TOKEN_STATES]
        return lambda: [states[row, :tokens] for row, tokens in enumerate(result.row_tokens)]

    inputs = (bytes_tensor(TEXT_INPUT, texts),)
    return await answered(call, model, inputs, TOKEN_STATES, parameters, body_of=body_of)


async def _multivectors(call: TaskCall, model: ModelInfo, texts: list[str], parameters: dict) -> bytes:
    """A multi-vector model's vectors of each text, as /embed_all answers them."""
    outputs = (MULTIVECTOR, MULTIVECTOR_LENGTHS)
    request = InferenceRequest(
        model=model.spec.name,
        inputs=(bytes_tensor(TEXT_INPUT, texts),),
        outputs=outputs,
        parameters=parameters,
        row_limit=call.row_limit,
        encodings=dict.fromkeys(outputs, JSON),
    )
    async with call.envelope.inference(request) as inference:
        vectors, lengths = inference.result.outputs[MULTIVECTOR], inference.result.outputs[MULTIVECTOR_LENGTHS]
        body = await inference.encode(
            lambda: orjson.dumps(
                [vectors[row, :length] for row, length in enumerate(lengths[:, 0].tolist())],
                option=orjson.OPT_SERIALIZE_NUMPY,
            )
        )
    return body


def _sparse_rows(indices: np.ndarray, values: np.ndarray) -> list[list[dict[str, object]]]:
    """Each row's terms as TEI writes them: [{"index", "value"}], largest first (padding left out)."""
    return [
        [
            {"index": int(index), "value": float(value)}
            for index, value in zip(row_indices, row_values, strict=True)
            if index >= 0
        ]
        for row_indices, row_values in zip(indices, values, strict=True)
    ]


async def embed_sparse(call: TaskCall, payload: object) -> bytes:
    """POST /embed_sparse: {"inputs": str | [str], "truncate", "prompt_name", "top_k"} -> [[{"index", "value"}]].

    A sparse model's (SPLADE's) non-zero terms per text, largest first; `top_k` (an extension) keeps the
    k largest. The terms are the gRPC outputs sparse_indices and sparse_values (service.pipeline.sparse).
    """
    fields, texts, model = _text_route(call, payload, SPARSE_FIELDS, SPARSE_EMBEDDER)
    outputs = (INDICES, VALUES)
    request = InferenceRequest(
        model=model.spec.name,
        inputs=(bytes_tensor(TEXT_INPUT, texts),),
        outputs=outputs,
        parameters=_parameters(fields, TRUNCATE, PROMPT_NAME, TOP_K),
        row_limit=call.row_limit,
        encodings=dict.fromkeys(outputs, JSON),
    )
    async with call.envelope.inference(request) as inference:
        result = inference.result
        body = await inference.encode(
            lambda: orjson.dumps(_sparse_rows(result.outputs[INDICES], result.outputs[VALUES]))
        )
    return body


async def similarity(call: TaskCall, payload: object) -> bytes:
    """POST /similarity: {"inputs": {"source_sentence", "sentences"}, "parameters"} -> [float], one per sentence.

    The cosine of each sentence's embedding with the source sentence's, all embedded in one inference:
    row 0 is the source sentence, row i sentence i - 1, so the source counts against --max-embedding-inputs.
    `parameters` (optional, as TEI's): truncate, truncation_direction, prompt_name (applied to every row).
    On a two-tower model the source and the sentences may also be images, {"image": "<base64 or data: URI>"}
    (and texts {"text": ...}): the texts and the images are embedded as two inferences, scored alike.
    """
    if isinstance(payload, dict):
        for name in SIMILARITY_PARAMETERS:
            if name in payload:
                raise InvalidArgument(f'{name} goes in parameters: {{"parameters": {{"{name}": ...}}}}')
    fields = _object(payload, SIMILARITY_FIELDS)
    if "inputs" not in fields:
        raise InvalidArgument('inputs is required: {"source_sentence": str, "sentences": [str]}')
    inputs = _object(fields["inputs"], SIMILARITY_INPUTS, "inputs")
    source = item_of(inputs.get("source_sentence"), "inputs.source_sentence")
    if source is None:
        raise InvalidArgument(f"inputs.source_sentence is required: a string, or {ITEM_KINDS}")
    sentences = inputs.get("sentences")
    if not isinstance(sentences, list):
        raise InvalidArgument(f"inputs.sentences is required: a list of strings (or of {ITEM_KINDS})")
    items = [source, *_items(sentences, "inputs.sentences")]
    if len(items) == 1:
        raise InvalidArgument("inputs.sentences is empty: give at least one sentence to compare")
    options = fields.get("parameters")
    options = {} if options is None else _object(options, SIMILARITY_PARAMETERS, "parameters")
    _flag(options, TRUNCATE, True)
    model = choose_model(call.pipeline, TWO_TOWER if has_images(items) else EMBEDDER, fields.get("model"))

    def request_for(tensor: InputTensor) -> InferenceRequest:
        # The budget counts the engine's float32 embeddings, held until the cosines are written: the one real cost.
        return InferenceRequest(
            model=model.spec.name,
            inputs=(tensor,),
            outputs=(EMBEDDING,),
            parameters=_parameters(options, TRUNCATE, PROMPT_NAME) | _parameters(fields),
            row_limit=call.row_limit,
            encodings={EMBEDDING: RAW},
        )

    def place(index: int) -> str:
        return "inputs.source_sentence" if index == 0 else f"inputs.sentences[{index - 1}]"

    async with embedded(
        call.envelope, items, request_for=request_for, place=place, max_inputs=call.max_inputs
    ) as result:
        similarities = cosines_to_first(result.outputs[EMBEDDING])
        body = await result.inference.encode(lambda: orjson.dumps(similarities, option=orjson.OPT_SERIALIZE_NUMPY))
    return body


def _items(values: list, name: str) -> list[Item]:
    """A list's texts and images (strings, or objects as `item_of` reads them); InvalidArgument naming a bad one."""
    items = []
    for index, value in enumerate(values):
        item = item_of(value, f"{name}[{index}]")
        if item is None:
            raise InvalidArgument(f"{name}[{index}]: {name} must be a list of strings (or of {ITEM_KINDS})")
        items.append(item)
    return items


async def rerank(call: TaskCall, payload: object) -> bytes:
    """POST /rerank: {"query", "texts", "raw_scores", "return_text", "truncate"} -> [{"index", "score", "text"?}].

    Best first; a score is the sigmoid of the reranker's logit, or the logit itself with raw_scores.
    `instruction` (an extension) replaces the default instruction of a reranker with a pair template.
    On a two-tower embed model (chosen when images are sent, or named) the query and the texts may be images,
    {"image": "<base64 or data: URI>"}, and a score is the cosine of the served vectors (raw_scores or not);
    return_text gives an image as it was sent, as "image".
    """
    fields = _object(payload, RERANK_FIELDS)
    query = item_of(fields.get("query"), "query")
    if query is None or query == "":
        raise InvalidArgument(f"query is required: a non-empty string, or {ITEM_KINDS}")
    if "texts" not in fields:
        raise InvalidArgument("texts is required: a list of strings")
    sent = [fields["texts"]] if isinstance(fields["texts"], str) else fields["texts"]
    if not isinstance(sent, list) or not sent:
        raise InvalidArgument("texts must be a string or a non-empty list of strings")
    texts = _items(sent, "texts")
    raw, return_text = _flag(fields, "raw_scores", False), _flag(fields, "return_text", False)
    _flag(fields, TRUNCATE, True)
    model = rerank_model(call.pipeline, fields.get("model"), [query, *texts])

    def body_of(ranked: np.ndarray, _: int) -> Callable[[], object]:
        order = np.argsort(-ranked, kind="stable")

        def returned(index: int) -> dict[str, object]:
            if not return_text:
                return {}
            return {"text": texts[index]} if isinstance(texts[index], str) else {"image": sent[index]["image"]}

        return lambda: [{"index": int(i), "score": float(ranked[i]), **returned(int(i))} for i in order]

    parameters = _parameters(fields, TRUNCATE, INSTRUCTION)
    return await reranked(call, model, query, texts, parameters, raw=raw, documents_field="texts", body_of=body_of)


def _predict_inputs(value: object) -> tuple[list[list[str]], bool]:
    """TEI's predict inputs: a text, a pair ([a, b]), or a batch of those; and whether it was a batch."""
    if isinstance(value, str):
        return [[value]], False
    if isinstance(value, list) and value and all(isinstance(item, str) for item in value):
        if len(value) > 2:
            raise InvalidArgument("inputs: a list of strings is one pair [a, b]; send a batch as a list of lists")
        return [value], False
    if isinstance(value, list) and value and all(isinstance(item, list) for item in value):
        for index, item in enumerate(value):
            if not 1 <= len(item) <= 2 or not all(isinstance(text, str) for text in item):
                raise InvalidArgument(f"inputs[{index}] must be [text] or [text, text_pair]")
        return value, True
    raise InvalidArgument("inputs must be a string, a pair [a, b], or a list of [text] or [text, text_pair]")


async def predict(call: TaskCall, payload: object) -> bytes:
    """POST /predict: {"inputs", "raw_scores", "truncate"} -> [{"label", "score"}] best first; a batch: a list each."""
    fields = _object(payload, PREDICT_FIELDS)
    if "inputs" not in fields:
        raise InvalidArgument("inputs is required: a string, a pair [a, b], or a list of those")
    items, batch = _predict_inputs(fields["inputs"])
    if len({len(item) for item in items}) > 1:
        raise InvalidArgument("inputs: a batch is all single texts or all pairs")
    raw = _flag(fields, "raw_scores", False)
    _flag(fields, TRUNCATE, True)
    model = choose_model(call.pipeline, CLASSIFIER, fields.get("model"))
    inputs = (bytes_tensor(TEXT_INPUT, [item[-1] for item in items]),)
    if len(items[0]) == 2:
        inputs = (bytes_tensor(QUERY_INPUT, [item[0] for item in items]), *inputs)
    labels = model.spec.labels

    def body_of(result: InferenceResult) -> Callable[[], object]:
        table = scores(result.outputs["logits"], raw)

        def body() -> object:
            answers = [
                [{"label": labels[j], "score": float(row[j])} for j in np.argsort(-row, kind="stable")] for row in table
            ]
            return answers if batch else answers[0]

        return body

    return await answered(call, model, inputs, "logits", _parameters(fields, TRUNCATE), body_of=body_of)


async def tokenize(call: TaskCall, payload: object) -> bytes:
    """POST /tokenize: {"inputs", "add_special_tokens", "prompt_name"} -> a list of tokens per text.

    Each token is {"id", "text", "special", "start", "stop"}: its place in the text (truncated at
    the model's maximum); special tokens have none. Run inside the envelope as an inference is
    (admitted, charged its tokens, counted), no model runs: the texts are held to the limits of
    /embed (--max-embedding-inputs, --max-text-bytes, --max-request-text-bytes), the answer to
    --max-response-bytes and, until sent, to --max-answer-bytes-in-flight; a large request is
    tokenised and written on a worker, as inference is.
    """
    fields = _object(payload, TOKENIZE_FIELDS)
    if "inputs" not in fields:
        raise InvalidArgument("inputs is required: a string or a list of strings")
    texts = _strings(fields["inputs"], "inputs")
    special = _flag(fields, "add_special_tokens", True)
    model = _tokenizing_model(call.pipeline, fields.get("model"))
    request = TokenizeRequest(
        model.spec.name,
        utf8(texts),
        add_special_tokens=special,
        parameters=_parameters(fields, PROMPT_NAME),
        row_limit=call.row_limit,
    )
    async with call.envelope.inference(request) as tokenized:
        tokens = tokenized.result.tokens
        body = await tokenized.write(lambda: orjson.dumps([[_token(token) for token in row] for row in tokens]))
    return body


async def decode(call: TaskCall, payload: object) -> bytes:
    """POST /decode: {"ids": [int] | [[int]], "skip_special_tokens": true} -> [str], one text per sequence.

    Through the tokenizer /tokenize uses, inside the envelope as /tokenize. The sequences are held to
    --max-embedding-inputs (413), every id to the tokenizer's vocabulary (422), the answer to
    --max-response-bytes and, until sent, to --max-answer-bytes-in-flight; a large request is
    decoded on a worker, as /tokenize's.
    """
    fields = _object(payload, DECODE_FIELDS)
    if "ids" not in fields:
        raise InvalidArgument("ids is required: a list of token ids, or a list of such lists")
    sequences = _id_sequences(fields["ids"])
    skip = _flag(fields, "skip_special_tokens", True)
    model = _tokenizing_model(call.pipeline, fields.get("model"))
    request = DecodeRequest(model.spec.name, sequences, skip, row_limit=call.row_limit)
    async with call.envelope.inference(request) as decoded:
        texts = decoded.result.texts
        body = await decoded.write(lambda: orjson.dumps(texts))
    return body


def _id_sequences(value: object) -> list[list[int]]:
    """TEI's InputIds: one sequence of token ids ([] is one empty sequence) or a list of them."""
    if not isinstance(value, list):
        raise InvalidArgument("ids must be a list of token ids, or a list of such lists")
    sequences = value if value and all(isinstance(item, list) for item in value) else [value]
    for row, ids in enumerate(sequences):
        if not all(type(token_id) is int for token_id in ids):  # bool is an int to Python, not to JSON
            place, bad = next((i, t) for i, t in enumerate(ids) if type(t) is not int)
            where = f"ids[{row}][{place}]" if sequences is value else f"ids[{place}]"
            raise InvalidArgument(f"{where} must be a token id (an integer), got {orjson.dumps(bad).decode()}")
    return sequences


def _tokenizing_model(pipeline: Pipeline, name: object) -> ModelInfo:
    """The model whose tokenizer /tokenize uses: the one named (any task), else the embedder, else the classifier."""
    if isinstance(name, str) and name:
        return pipeline.model(name)
    if name is not None:
        raise InvalidArgument("model must be the name of a served model")
    if any(model.spec.task == "embed" for model in pipeline.models()):
        return choose_model(pipeline, EMBEDDER, None)
    return choose_model(pipeline, CLASSIFIER, None)


def _token(token: Token) -> dict[str, object]:
    """One token as TEI writes it: special tokens have no place in the text."""
    if token.special:
        return {"id": token.id, "text": token.text, "special": True, "start": None, "stop": None}
    return {"id": token.id, "text": token.text, "special": False, "start": token.start, "stop": token.stop}


def info(pipeline: Pipeline, settings: InfoSettings) -> bytes:
    """GET /info: the served model as TEI describes its own (the one embedder, else the one classifier)."""
    models = pipeline.models()
    if not models:
        raise NotFound("no model is loaded")
    embedders = [model for model in models if model.spec.task == "embed"]
    model = (embedders or models)[0]
    spec = model.spec
    if spec.task == "embed":
        model_type: dict[str, object] = {"embedding": {"pooling": spec.pooling}}
    elif spec.task == "sparse":
        model_type = {"embedding": {"pooling": "splade"}}
    else:
        id2label = {str(i): label for i, label in enumerate(spec.labels)}
        label2id = {label: i for i, label in enumerate(spec.labels)}
        kind = "reranker" if len(spec.labels) == 1 else "classifier"
        model_type = {kind: {"id2label": id2label, "label2id": label2id}}
    return orjson.dumps(
        {
            "model_id": spec.name,
            "model_sha": None,
            "model_dtype": model.instances[0].variant if model.instances else "fp32",
            "model_type": model_type,
            "max_concurrent_requests": settings.max_concurrent_requests,
            "max_input_length": spec.max_sequence_length,
            "max_batch_tokens": model.policy.max_batch_tokens,
            "max_batch_requests": model.policy.max_batch_size,
            "max_client_batch_size": settings.max_client_batch_size,
            "tokenization_workers": settings.tokenization_workers,
            "version": settings.version,
            "models": [{"id": m.spec.name, "task": m.spec.task} for m in models],
        }
    )


@dataclass(frozen=True)
class InfoSettings:
    """Server facts /info reports beside the model's."""

    max_concurrent_requests: int
    max_client_batch_size: int
    tokenization_workers: int
    version: str
