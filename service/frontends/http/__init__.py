"""The HTTP port: one ASGI app (app.py) and its route families, each in its body dialect.

OpenAI (openai.py), text-embeddings-inference (tei.py), Cohere and Jina's rerank (cohere.py) and
KServe v2 REST (kserve.py) parse their bodies into the engine's InferenceRequest, run it inside the
request's envelope (service.envelope) and render its answer; errors map to HTTP statuses and each
family's error body in one table (errors.py).
"""
