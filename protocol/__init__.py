"""KServe v2 / Triton protocol stubs generated from protos/ by protos/generate.py (do not edit)."""
