"""Probes: synthetic ONNX graphs pushed through the real vendor compiler to learn a target's limits."""
