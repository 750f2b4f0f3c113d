"""Every task's requests and results, for the clients' tasks (client.base).

A task's call is: build its requests here, send them (the clients' part), read the answers here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from client.images import ImageItem, encoded_image, image_batches
from client.protocol import IMAGE_INPUT, Parameter, batches, image_request, output_values, text_request
from protocol import grpc_service_pb2 as pb

EMBEDDING_TYPES = ("float", "int8", "uint8", "binary", "ubinary")
"""The forms of a dense embedding (sentence-transformers' `precision` names); each is the output `embedding[_type]`."""
SPARSE_OUTPUTS = ("sparse_indices", "sparse_values")
TOKEN_OUTPUTS = ("token_ids", "token_offsets", "token_counts")
"""The texts' tokens as the model reads them; the server answers them without running the model."""


def embedding_output(embedding_type: str) -> str:
    """The output that answers an embedding type."""
    if embedding_type not in EMBEDDING_TYPES:
        raise ValueError(f"embedding_type must be one of {', '.join(EMBEDDING_TYPES)}, got {embedding_type!r}")
    return "embedding" if embedding_type == "float" else f"embedding_{embedding_type}"


@dataclass(frozen=True)
class EmbedOptions:
    """How texts are embedded; None leaves the model's default."""

    prompt_name: str | None = None
    """One of the model's prompts (e.g. e5's `query`), put before each text."""
    dimensions: int | None = None
    """A Matryoshka width the model declares."""
    truncate: bool | None = None
    """False: a text longer than the model is embedded whole, in windows (embedders), or refused (pairs)."""
    top_k: int | None = None
    """Sparse embeddings: keep each text's k largest terms."""
    task: str | None = None
    """One of the model's task adapters (jina-embeddings-v3's `retrieval.query`...), with its prompt of that name."""
    priority: int | None = None
    """The priority the rows wait at, 1 the highest (`model_info(...).priority_levels`); None: the server's default."""

    def parameters(self) -> dict[str, Parameter]:
        """The request parameters these options set."""
        named = {"prompt_name": self.prompt_name, "dimensions": self.dimensions, "truncate": self.truncate}
        named |= {"top_k": self.top_k, "task": self.task, "priority": self.priority}
        return {key: value for key, value in named.items() if value is not None}

    def image_parameters(self) -> dict[str, Parameter]:
        """The request parameters these options set for images: a width and a priority (the rest is for texts)."""
        named = {"dimensions": self.dimensions, "priority": self.priority}
        return {key: value for key, value in named.items() if value is not None}


def text_requests(
    model: str, texts: Sequence[str], outputs: Sequence[str], options: EmbedOptions, batch_size: int
) -> list[pb.ModelInferRequest]:
    """The requests that embed texts, batch_size texts each."""
    if isinstance(texts, str) or not texts:
        raise ValueError("give a non-empty list of texts")
    parameters = options.parameters()
    return [text_request(model, chunk, outputs, parameters=parameters) for chunk in batches(texts, batch_size)]


@dataclass(frozen=True)
class PlacedRequest:
    """A request and where each of its rows is among the call's inputs."""

    request: pb.ModelInferRequest
    places: tuple[int, ...]


def embed_requests(
    model: str, inputs: Sequence[str | ImageItem], outputs: Sequence[str], options: EmbedOptions, batch_size: int
) -> list[PlacedRequest]:
    """The requests that embed texts and images, each with its rows' places among the inputs.

    A request carries texts or images, not both (the server takes one kind a request): texts batch_size a request,
    images batch_size and IMAGE_REQUEST_BYTES a request at most (a larger image alone). The text options (prompt,
    truncation, task) apply to the texts; a width and a priority to both.
    """
    if isinstance(inputs, str | bytes) or not inputs:
        raise ValueError("give a non-empty list of texts or images")
    text_places = [place for place, item in enumerate(inputs) if isinstance(item, str)]
    image_places = [place for place, item in enumerate(inputs) if not isinstance(item, str)]
    images = [encoded_image(inputs[place], place) for place in image_places]
    placed = []
    if text_places:
        texts = [inputs[place] for place in text_places]
        requests = text_requests(model, texts, outputs, options, batch_size)
        starts = range(0, len(texts), batch_size)
        for request, start in zip(requests, starts, strict=True):
            placed.append(PlacedRequest(request, tuple(text_places[start : start + batch_size])))
    parameters = options.image_parameters()
    for batch in image_batches([len(image) for image in images], batch_size):
        request = image_request(model, images[batch.start : batch.stop], outputs, parameters=parameters)
        placed.append(PlacedRequest(request, tuple(image_places[batch.start : batch.stop])))
    return placed


def stacked(responses: Sequence[pb.ModelInferResponse], name: str) -> np.ndarray:
    """One output of every response, rows concatenated in order."""
    return np.concatenate([output_values(response, name) for response in responses])


def placed_rows(responses: Sequence[pb.ModelInferResponse], places: Sequence[Sequence[int]], name: str) -> np.ndarray:
    """One output of every response, each response's rows put at its places (responses[i]'s at places[i])."""
    parts = [output_values(response, name) for response in responses]
    rows = np.empty((sum(len(part) for part in parts), *parts[0].shape[1:]), dtype=parts[0].dtype)
    for part, where in zip(parts, places, strict=True):
        rows[list(where)] = part
    return rows


@dataclass(frozen=True, eq=False)
class SparseEmbeddings:
    """Sparse embeddings: row i's terms are indices[i, :counts[i]] with values[i, :counts[i]], largest first."""

    indices: np.ndarray
    """int64 [texts, k], padded with -1."""
    values: np.ndarray
    """float32 [texts, k], padded with 0."""

    @property
    def counts(self) -> np.ndarray:
        """Each text's number of terms."""
        return (self.indices >= 0).sum(axis=1)

    def row(self, index: int) -> dict[int, float]:
        """One text's terms as {token id: weight}."""
        keep = self.indices[index] >= 0
        return dict(zip(self.indices[index][keep].tolist(), self.values[index][keep].tolist(), strict=True))


def sparse(responses: Sequence[pb.ModelInferResponse]) -> SparseEmbeddings:
    """Sparse terms of every response, padded to the widest one."""
    parts = [(output_values(r, SPARSE_OUTPUTS[0]), output_values(r, SPARSE_OUTPUTS[1])) for r in responses]
    width = max(indices.shape[1] for indices, _ in parts)
    indices = np.concatenate([np.pad(i, ((0, 0), (0, width - i.shape[1])), constant_values=-1) for i, _ in parts])
    values = np.concatenate([np.pad(v, ((0, 0), (0, width - v.shape[1]))) for _, v in parts])
    return SparseEmbeddings(indices, values)


@dataclass(frozen=True, eq=False)
class Tokens:
    """One text's tokens as the model reads it (its prompt's prefix put before it, truncated at its maximum)."""

    ids: np.ndarray
    """int64 [tokens]: the token ids."""
    offsets: np.ndarray
    """int64 [tokens, 2]: each token's [start, stop) in the text as the model read it (characters, the prompt's
    prefix included); (-1, -1) for special tokens."""

    @property
    def special(self) -> np.ndarray:
        """Which tokens are the model's special tokens ([CLS], </s>...): bool [tokens]."""
        return self.offsets[:, 0] < 0

    def __len__(self) -> int:
        return len(self.ids)


def tokenize_requests(
    model: str,
    texts: Sequence[str],
    options: EmbedOptions,
    add_special_tokens: bool | None,
    batch_size: int,
) -> list[pb.ModelInferRequest]:
    """The requests that ask the texts' tokens, batch_size texts each."""
    if isinstance(texts, str) or not texts:
        raise ValueError("give a non-empty list of texts")
    parameters = options.parameters()
    if add_special_tokens is not None:
        parameters["add_special_tokens"] = add_special_tokens
    return [text_request(model, chunk, TOKEN_OUTPUTS, parameters=parameters) for chunk in batches(texts, batch_size)]


def tokens(responses: Sequence[pb.ModelInferResponse]) -> list[Tokens]:
    """Each text's tokens, in order."""
    texts = []
    for response in responses:
        ids, offsets, counts = (output_values(response, name) for name in TOKEN_OUTPUTS)
        texts += [Tokens(ids[row, :count], offsets[row, :count]) for row, count in enumerate(counts[:, 0])]
    return texts


@dataclass(frozen=True)
class ModelInfo:
    """What a served model is, from ModelMetadata (outputs and widths) and ModelConfig (task, prompts, labels)."""

    name: str
    versions: tuple[str, ...]
    task: str
    """embed, classify, sparse or multivector."""
    outputs: dict[str, str]
    """Every output it answers, with its KServe datatype."""
    dimension: int | None
    """An embedder's vector width."""
    matryoshka_dimensions: tuple[int, ...] = ()
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str = ""
    labels: tuple[str, ...] = ()
    """A classifier's labels, in logits order (one label: a reranker)."""
    tasks: tuple[str, ...] = ()
    """Its task adapters (the `task` an embed call may name); empty: none."""
    max_sequence_length: int | None = None
    max_batch_size: int = 0
    """Texts one request may carry (0: no limit)."""
    priority_levels: int = 1
    """Priorities a request may ask for: 1 (the highest) to this (the lowest: bulk work)."""
    takes_images: bool = False
    """Whether it has an image tower (CLIP, SigLIP): it embeds images, and reranks by the cosine of its vectors."""

    @property
    def embedding_types(self) -> tuple[str, ...]:
        """The embedding forms it answers."""
        return tuple(kind for kind in EMBEDDING_TYPES if embedding_output(kind) in self.outputs)


def model_info(metadata: pb.ModelMetadataResponse, config: pb.ModelConfigResponse) -> ModelInfo:
    """A model's description from its metadata and its configuration as served."""
    parameters = {key: value.string_value for key, value in config.config.parameters.items()}
    outputs = {output.name: output.datatype for output in metadata.outputs}
    widths = {output.name: list(output.shape) for output in metadata.outputs}
    dimension = widths.get("embedding", [None])[-1]
    length = parameters.get("max_sequence_length")
    return ModelInfo(
        name=metadata.name,
        versions=tuple(metadata.versions),
        task=parameters.get("task", "embed"),
        outputs=outputs,
        dimension=dimension,
        matryoshka_dimensions=tuple(json.loads(parameters.get("matryoshka_dimensions") or "[]")),
        prompts=json.loads(parameters.get("prompts") or "{}"),
        default_prompt_name=parameters.get("default_prompt_name", ""),
        labels=tuple(json.loads(parameters.get("labels") or "[]")),
        tasks=tuple(json.loads(parameters.get("adapter_tasks") or "[]")),
        max_sequence_length=int(length) if length else None,
        max_batch_size=config.config.max_batch_size,
        priority_levels=max(1, config.config.dynamic_batching.priority_levels),
        takes_images=any(tensor.name == IMAGE_INPUT for tensor in metadata.inputs),
    )


@dataclass(frozen=True, eq=False)
class Ranking:
    """Documents ranked for a query: best first."""

    indices: np.ndarray
    """int64: the documents' positions in the list given, best first (top_n of them when asked)."""
    scores: np.ndarray
    """float32, in the same order: the reranker's probability (sigmoid of its logit), its raw logit when
    raw_scores, a multi-vector model's MaxSim score, or a two-tower model's cosine of the vectors."""


def rerank_requests(
    info: ModelInfo,
    query: str,
    documents: Sequence[str],
    truncate: bool | None,
    batch_size: int,
    *,
    instruction: str | None = None,
) -> list[pb.ModelInferRequest]:
    """Pairs (query, document) in batches, asking the model's score output.

    instruction: a reranker with a pair template's instruction (Qwen3-Reranker's), in place of its default.
    """
    if isinstance(documents, str) or not documents:
        raise ValueError("give a non-empty list of documents")
    if not isinstance(query, str) or not all(isinstance(document, str) for document in documents):
        raise ValueError(f"model {info.name} reranks texts: images need a two-tower (text and image) embed model")
    if info.task == "classify" and len(info.labels) != 1:
        raise ValueError(f"model {info.name} has {len(info.labels)} labels, not a reranker: use classify")
    if info.task not in ("classify", "multivector") and "score" not in info.outputs:
        raise ValueError(f"model {info.name} is a {info.task} model and cannot rerank")
    output = "logits" if info.task == "classify" else "score"
    named = {"truncate": truncate, "instruction": instruction}
    parameters = {key: value for key, value in named.items() if value is not None}
    return [
        text_request(info.name, chunk, [output], queries=[query] * len(chunk), parameters=parameters)
        for chunk in batches(documents, batch_size)
    ]


def ranking(
    info: ModelInfo, responses: Sequence[pb.ModelInferResponse], top_n: int | None, raw_scores: bool
) -> Ranking:
    """The documents' scores, sorted best first (ties in document order), cut at top_n."""
    output = "logits" if info.task == "classify" else "score"
    scores = stacked(responses, output)[:, 0]
    if info.task == "classify" and not raw_scores:
        scores = _sigmoid(scores)
    order = np.argsort(-scores, kind="stable")[:top_n]
    return Ranking(order.astype(np.int64), scores[order].astype(np.float32))


def cosine_rerank_requests(
    info: ModelInfo,
    query: str | ImageItem,
    documents: Sequence[str | ImageItem],
    truncate: bool | None,
    batch_size: int,
) -> list[PlacedRequest]:
    """A two-tower model's requests for the vectors of the query and the documents (texts or images).

    Placed as [query, *documents]: a refusal names the query inputs[0], document i inputs[i + 1].
    """
    if isinstance(documents, str) or not documents:
        raise ValueError("give a non-empty list of documents")
    items = [query, *documents]
    return embed_requests(info.name, items, [embedding_output("float")], EmbedOptions(truncate=truncate), batch_size)


def cosine_ranking(vectors: np.ndarray, top_n: int | None) -> Ranking:
    """The documents (vectors[1:]) by the cosine of each one's vector with the query's (vectors[0]), in float64.

    As the server's /rerank scores a two-tower model's query and documents: best first, ties in document order.
    """
    unit = vectors.astype(np.float64)
    unit /= np.maximum(np.linalg.norm(unit, axis=1, keepdims=True), 1e-12)
    scores = (unit[1:] @ unit[0]).astype(np.float32)
    order = np.argsort(-scores, kind="stable")[:top_n]
    return Ranking(order.astype(np.int64), scores[order])


@dataclass(frozen=True, eq=False)
class Classification:
    """Each text's (or pair's) scores over the model's labels."""

    label_names: tuple[str, ...]
    scores: np.ndarray
    """float32 [texts, labels]: softmax over several labels, sigmoid for one; raw logits when raw_scores."""

    @property
    def labels(self) -> list[str]:
        """Each text's best label."""
        return [self.label_names[index] for index in np.argmax(self.scores, axis=1)]


def classify_requests(
    info: ModelInfo, texts: Sequence[str], pairs_with: Sequence[str] | None, truncate: bool | None, batch_size: int
) -> list[pb.ModelInferRequest]:
    """Texts (or pairs, `pairs_with` holding each one's first member) in batches, asking the logits."""
    if info.task != "classify":
        raise ValueError(f"model {info.name} is a {info.task} model, not a classifier")
    if isinstance(texts, str) or not texts:
        raise ValueError("give a non-empty list of texts")
    if pairs_with is not None and len(pairs_with) != len(texts):
        raise ValueError(f"{len(pairs_with)} first members for {len(texts)} texts")
    parameters = {} if truncate is None else {"truncate": truncate}
    starts = range(0, len(texts), batch_size)
    return [
        text_request(
            info.name,
            texts[start : start + batch_size],
            ["logits"],
            queries=None if pairs_with is None else pairs_with[start : start + batch_size],
            parameters=parameters,
        )
        for start in starts
    ]


def classification(info: ModelInfo, responses: Sequence[pb.ModelInferResponse], raw_scores: bool) -> Classification:
    """Scores over the labels, as CrossEncoder and TEI make them from logits."""
    logits = stacked(responses, "logits")
    if raw_scores:
        scores = logits
    elif logits.shape[1] == 1:
        scores = _sigmoid(logits)
    else:
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        scores = shifted / shifted.sum(axis=1, keepdims=True)
    return Classification(info.labels, scores.astype(np.float32))


def _sigmoid(values: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-values.astype(np.float64)))
