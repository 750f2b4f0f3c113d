"""Run time: serves a model repository over gRPC (KServe v2 / Triton protocol) with ONNX Runtime."""
