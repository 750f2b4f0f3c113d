"""What the task routes of TEI (tei.py) and Cohere (cohere.py) share: the model a route goes to, one inference answered.

A task route names no model, or names one: `choose_model` picks the served model that meets the
route's need (an embedder, a reranker, ...) and refuses precisely otherwise. `answered` runs one
inference inside the request's envelope and renders its JSON answer; `reranked` runs a reranker
on (query, document) pairs, whose scores `pair_scores` reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import orjson

from service.envelope import RequestEnvelope
from service.errors import InvalidArgument, NotFound
from service.pipeline.api import (
    EMBEDDING,
    INDICES,
    JSON,
    MULTIVECTOR,
    QUERY_INPUT,
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
    query: str,
    documents: list[str],
    parameters: dict,
    *,
    body_of: Callable[[InferenceResult], Callable[[], object]],
) -> bytes:
    """The reranker run on (query, document) pairs, answered; it must give one score per pair (one label, or MaxSim)."""
    if SCORE in model.signature.outputs:
        inputs = (bytes_tensor(QUERY_INPUT, [query] * len(documents)), bytes_tensor(TEXT_INPUT, documents))
        return await answered(call, model, inputs, SCORE, parameters, body_of=body_of)
    if len(model.spec.labels) != 1:
        raise InvalidArgument(
            f"model {model.spec.name} is a classifier of {len(model.spec.labels)} labels, not a reranker"
            " (one score per pair): use /predict"
        )
    inputs = (bytes_tensor(QUERY_INPUT, [query] * len(documents)), bytes_tensor(TEXT_INPUT, documents))
    return await answered(call, model, inputs, "logits", parameters, body_of=body_of)
