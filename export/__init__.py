"""Build time: a PyTorch transformer encoder, its ONNX export and variants, the parity gate."""
