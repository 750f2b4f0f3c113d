"""Blocks shared by the families: rotary angles, grouped attention, pooling, task adapters."""
