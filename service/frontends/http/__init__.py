"""The HTTP port: OpenAI's embeddings API and KServe v2 REST, over the same engine as gRPC.

Each API parses its wire format into the codec's InferenceRequest, makes the one engine call
(`ServedModel.infer`) and maps the same typed errors to HTTP statuses (service.frontends.http.errors).
"""
