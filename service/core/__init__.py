"""The core: batching rows, running the model (ONNX Runtime), and the engine process's side."""
