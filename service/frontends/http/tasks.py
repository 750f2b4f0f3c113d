"""What the task routes of TEI (tei.py) and Cohere (cohere.py) share: the model a route goes to, one inference answered.

A task route names no model, or names one: `choose_model` picks the served model that meets the
route's need (an embedder, a reranker, ...) and refuses precisely otherwise. `answered` runs one
inference inside the request's envelope and renders its JSON answer; `reranked` runs a reranker
on (query, document) pairs, whose scores `pair_scores` reads, or scores a two-tower model's documents (texts or
images) by the cosine of their served vectors with the query's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import orjson

from service.envelope import RequestEnvelope
from service.errors import InvalidArgument, NotFound
from service.frontends.http.texts_and_images import Item, embedded, has_images
from service.pipeline.api import (
    EMBEDDING,
    INDICES,
    JSON,
    MULTIVECTOR,
    QUERY_INPUT,
    RAW,
    SCORE,
    TEXT_INPUT,
    TOKEN_STATES,
    InferenceRequest,
    InferenceResult,
    InputTensor,
    ModelInfo,
    Pipeline,
    RowLimit,
)


@dataclass(frozen=True)
class Need:
    """What a route needs of its model, and how its refusals name that."""

    singular: str
    plural: str
    serves: Callable[[ModelInfo], bool]


EMBEDDER = Need("embed model", "embed models", lambda model: EMBEDDING in model.signature.outputs)
TOKEN_VECTORS = Need(
    "embed or multi-vector model",
    "embed or multi-vector models",
    lambda model: TOKEN_STATES in model.signature.outputs or MULTIVECTOR in model.signature.outputs,
)
SPARSE_EMBEDDER = Need("sparse model", "sparse models", lambda model: INDICES in model.signature.outputs)
CLASSIFIER = Need("classify model", "classify models", lambda model: model.spec.task == "classify")
RERANKER = Need(
    "reranker (a classify model of one label, or a multi-vector model)",
    "rerankers (classify models of one label, or multi-vector models)",
    lambda model: SCORE in model.signature.outputs or (model.spec.task == "classify" and len(model.spec.labels) == 1),
)
TWO_TOWER = Need(
    "two-tower (text and image) embed model",
    "two-tower (text and image) embed models",
    lambda model: EMBEDDING in model.signature.outputs and model.signature.accepts_images,
)


def choose_model(pipeline: Pipeline, need: Need, name: object) -> ModelInfo:
    """The model a route serves: the one `name` picks, else the one served that meets its need; a precise refusal."""
    if name is not None:
        if not isinstance(name, str) or not name:
            raise InvalidArgument("model must be the name of a served model")
        model = pipeline.model(name)
        if not need.serves(model) and not (need is RERANKER and model.spec.task == "classify"):
            raise InvalidArgument(f"model {name} is a {model.spec.task} model; this route needs a {need.singular}")
        return model
    candidates = [model for model in pipeline.models() if need.serves(model)]
    if not candidates:
        raise NotFound(f"no {need.singular} is served here (served: {', '.join(pipeline.served_names()) or 'none'})")
    if len(candidates) > 1:
        names = ", ".join(model.spec.name for model in candidates)
        raise InvalidArgument(f"several {need.plural} are served ({names}): name one in the model field")
    return candidates[0]


def pair_scores(result: InferenceResult, raw: bool) -> np.ndarray:
    """One score per pair: a multi-vector model's MaxSim as it is; a reranker's logit, its sigmoid unless raw."""
    if SCORE in result.outputs:
        return result.outputs[SCORE][:, 0]
    return scores(result.outputs["logits"], raw)[:, 0]


def scores(logits: np.ndarray, raw: bool) -> np.ndarray:
    """Scores from logits [rows, labels]: raw, or sigmoid for one label and softmax over several (as TEI does)."""
    if raw:
        return logits
    if logits.shape[1] == 1:
        return 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    shifted = np.exp(logits.astype(np.float64) - logits.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def cosines_to_first(vectors: np.ndarray) -> np.ndarray:
    """The cosine of each row after the first with the first (float32), computed in float64."""
    unit = vectors.astype(np.float64)
    unit /= np.maximum(np.linalg.norm(unit, axis=1, keepdims=True), 1e-12)
    return (unit[1:] @ unit[0]).astype(np.float32)


def utf8(texts: list[str]) -> list[bytes]:
    """Texts as a BYTES input's elements."""
    # surrogatepass: a lone surrogate (legal in JSON) reaches the UTF-8 check and its message.
    return [text.encode("utf-8", "surrogatepass") for text in texts]


def bytes_tensor(name: str, texts: list[str]) -> InputTensor:
    """Texts as the BYTES input `name` of an inference."""
    elements = utf8(texts)
    return InputTensor(name, "BYTES", (len(elements),), elements, raw=False)


@dataclass(frozen=True)
class TaskCall:
    """What every task route runs with: the request's envelope, the front end's bound on inputs."""

    envelope: RequestEnvelope
    max_inputs: int
    """--max-embedding-inputs: the most texts (or pairs) one request may carry."""

    @property
    def pipeline(self) -> Pipeline:
        """The engine the envelope runs inferences on."""
        return self.envelope.pipeline

    @property
    def row_limit(self) -> RowLimit:
        """The bound on a request's rows, as its refusals name it."""
        return RowLimit(self.max_inputs, "--max-embedding-inputs")


async def answered(
    call: TaskCall,
    model: ModelInfo,
    inputs: tuple[InputTensor, ...],
    output: str,
    parameters: dict,
    *,
    body_of: Callable[[InferenceResult], Callable[[], object]],
    encoding: str = JSON,
) -> bytes:
    """One inference of a task route, answered: `body_of(result)` gives what the JSON answer is made from.

    `encoding`: what the answer budget counts the output's values as (answers.JSON: the output is the answer).
    """
    request = InferenceRequest(
        model=model.spec.name,
        inputs=inputs,
        outputs=(output,),
        parameters=parameters,
        row_limit=call.row_limit,
        encodings={output: encoding},
    )
    async with call.envelope.inference(request) as inference:
        make = body_of(inference.result)
        body = await inference.encode(lambda: orjson.dumps(make(), option=orjson.OPT_SERIALIZE_NUMPY))
    return body


async def reranked(
    call: TaskCall,
    model: ModelInfo,
    query: Item,
    documents: list[Item],
    parameters: dict,
    *,
    raw: bool,
    documents_field: str,
    body_of: Callable[[np.ndarray, int], Callable[[], object]],
) -> bytes:
    """The documents scored against the query and answered: `body_of(scores, prompt_tokens)` gives the JSON answer.

    A reranker (one label, or MaxSim) scores (query, document) pairs: its logit's sigmoid, or the logit when `raw`.
    A two-tower embed model scores the cosine of the query's served vector with each document's, a text or an
    image; the query is one more row against --max-embedding-inputs, and a refused item is named `query` or
    `documents_field[i]`.
    """
    if TWO_TOWER.serves(model):
        return await _cosine_ranked(
            call, model, [query, *documents], parameters, documents_field=documents_field, body_of=body_of
        )
    if isinstance(query, bytes) or has_images(documents):
        raise InvalidArgument(
            f"model {model.spec.name} reranks texts: images need a two-tower (text and image) embed model"
        )
    if SCORE not in model.signature.outputs and len(model.spec.labels) != 1:
        raise InvalidArgument(
            f"model {model.spec.name} is a classifier of {len(model.spec.labels)} labels, not a reranker"
            " (one score per pair): use /predict"
        )
    texts = [document for document in documents if isinstance(document, str)]
    inputs = (bytes_tensor(QUERY_INPUT, [query] * len(texts)), bytes_tensor(TEXT_INPUT, texts))
    output = SCORE if SCORE in model.signature.outputs else "logits"
    return await answered(
        call,
        model,
        inputs,
        output,
        parameters,
        body_of=lambda result: body_of(pair_scores(result, raw), result.prompt_tokens),
    )


async def _cosine_ranked(
    call: TaskCall,
    model: ModelInfo,
    items: list[Item],
    parameters: dict,
    *,
    documents_field: str,
    body_of: Callable[[np.ndarray, int], Callable[[], object]],
) -> bytes:
    """Each item after the first scored by the cosine of its served vector with the first's, answered."""

    def request_for(tensor: InputTensor) -> InferenceRequest:
        return InferenceRequest(
            model=model.spec.name,
            inputs=(tensor,),
            outputs=(EMBEDDING,),
            parameters=parameters,
            row_limit=call.row_limit,
            encodings={EMBEDDING: RAW},
        )

    def place(index: int) -> str:
        return "query" if index == 0 else f"{documents_field}[{index - 1}]"

    async with embedded(
        call.envelope, items, request_for=request_for, place=place, max_inputs=call.max_inputs
    ) as result:
        make = body_of(cosines_to_first(result.outputs[EMBEDDING]), result.prompt_tokens)
        body = await result.inference.encode(lambda: orjson.dumps(make(), option=orjson.OPT_SERIALIZE_NUMPY))
    return body


def rerank_model(pipeline: Pipeline, name: object, items: list[Item]) -> ModelInfo:
    """The model a rerank route scores with: a two-tower embed model (cosines) where images are sent or it is named.

    Else the reranker `name` picks, or the one served.
    """
    if has_images(items):
        return choose_model(pipeline, TWO_TOWER, name)
    if isinstance(name, str) and name and TWO_TOWER.serves(pipeline.model(name)):
        return pipeline.model(name)
    return choose_model(pipeline, RERANKER, name)
