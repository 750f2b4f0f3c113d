"""The HTTP port: one ASGI app (app.py) over one table of routes (routes.py), each in its family's dialect.

OpenAI (openai.py), text-embeddings-inference (tei.py), Cohere and Jina's rerank (cohere.py) and
KServe v2 REST (kserve.py) parse their bodies into the pipeline's requests, run them inside the
request's envelope (service.envelope) and render their answers; TEI's and Cohere's task routes
share their choice of model and their inference (tasks.py). From the pipeline they use its door
alone (service.pipeline.api). Errors map to HTTP statuses and each family's error body in one
table (errors.py).
"""
