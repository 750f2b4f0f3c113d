"""The gRPC port: KServe v2 / Triton's GRPCInferenceService, its streams, health and the door."""
