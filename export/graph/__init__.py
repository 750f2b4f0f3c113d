"""The ONNX graph: export, the CPU and CUDA forms, int8 quantisation, calibration ranges."""
