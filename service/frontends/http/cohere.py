"""The rerank API of Cohere and Jina: POST /v1/rerank, as LangChain's CohereRerank/JinaRerank and LlamaIndex call it.

`documents` are strings or {"text": ...} objects; `top_n` keeps the best ones; `return_documents`
adds each one's text. `relevance_score` is the sigmoid of the reranker's logit (in [0, 1], as
Cohere's), results best first. `model` may be left out when exactly one reranker is served.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import numpy as np

from service.errors import InvalidArgument
from service.frontends.http.tei import Answer, TaskCall, choose_model, reranked, scores
from service.pipeline.api import InferenceResult

FIELDS = ("model", "query", "documents", "top_n", "return_documents", "max_chunks_per_doc", "rank_fields")


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


async def rerank(call: TaskCall, payload: object) -> Answer:
    """POST /v1/rerank: {"model", "query", "documents", "top_n", "return_documents"} -> {"results": [...], ...}."""
    if not isinstance(payload, dict):
        raise InvalidArgument("the request body must be a JSON object")
    unknown = [name for name in payload if name not in FIELDS]
    if unknown:
        raise InvalidArgument(f"unrecognized request argument supplied: {unknown[0]} (accepted: {', '.join(FIELDS)})")
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
    model = choose_model(call.pipeline, "classify", payload.get("model"), reranker=True)

    def body_of(result: InferenceResult) -> Callable[[], object]:
        relevance = scores(result.outputs["logits"], raw=False)[:, 0]
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

    return await reranked(call, model, query, documents, {}, body_of=body_of)
