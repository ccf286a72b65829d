"""ONNX ops the runtime evaluates in numpy: what a model computes from its integer inputs alone
(an attention mask turned into an additive bias, token types, padding flags).

The vendor runs such ops (Cast to bool, Not, Where, Unsqueeze of an int64 mask) on the CPU inside
its graph; the compiler moves them here instead (shard.passes.host_edges), one step each:

    {"op": "onnx", "type": "Where", "inputs": [...], "outputs": [...], "attrs": {...},
     "constants": {NAME: {"dtype": "float32", "shape": [], "values": [...]}}}

Each function follows the ONNX operator's definition for the inputs it is given (numpy broadcasting
is ONNX's multidirectional broadcasting). OPS lists what the compiler may move.
"""

from __future__ import annotations

import numpy as np

DTYPES = {1: np.float32, 2: np.uint8, 3: np.int8, 5: np.int16, 6: np.int32, 7: np.int64, 9: np.bool_,
          10: np.float16, 11: np.float64, 12: np.uint32, 13: np.uint64}


def axes_of(attrs: dict, args: list, k: int) -> list[int]:
    """Axes from the attribute (older opsets) or from input k (opset 13 on)."""
    return [int(a) for a in (attrs["axes"] if "axes" in attrs else args[k])]


def unsqueeze(x, *rest, attrs):
    out_rank = x.ndim + len(axes_of(attrs, list(rest), 0))
    shape = iter(x.shape)
    axes = {a % out_rank for a in axes_of(attrs, list(rest), 0)}
    return x.reshape([1 if i in axes else next(shape) for i in range(out_rank)])


def squeeze(x, *rest, attrs):
    if "axes" not in attrs and not rest:
        return np.squeeze(x)
    return np.squeeze(x, axis=tuple(a % x.ndim for a in axes_of(attrs, list(rest), 0)))


def reshape(x, shape, attrs):
    shape = [x.shape[i] if d == 0 and not attrs.get("allowzero") else int(d) for i, d in enumerate(shape)]
    return x.reshape(shape)


def expand(x, shape, attrs):
    return np.array(np.broadcast_to(x, np.broadcast_shapes(x.shape, tuple(int(d) for d in shape))))


OPS = {
    "Cast": lambda x, attrs: x.astype(DTYPES[attrs["to"]]),
    "Not": lambda x, attrs: np.logical_not(x),
    "And": lambda a, b, attrs: np.logical_and(a, b),
    "Or": lambda a, b, attrs: np.logical_or(a, b),
    "Xor": lambda a, b, attrs: np.logical_xor(a, b),
    "Equal": lambda a, b, attrs: np.equal(a, b),
    "Less": lambda a, b, attrs: np.less(a, b),
    "LessOrEqual": lambda a, b, attrs: np.less_equal(a, b),
    "Greater": lambda a, b, attrs: np.greater(a, b),
    "GreaterOrEqual": lambda a, b, attrs: np.greater_equal(a, b),
    "Where": lambda c, a, b, attrs: np.where(c, a, b),
    "Add": lambda a, b, attrs: np.add(a, b),
    "Sub": lambda a, b, attrs: np.subtract(a, b),
    "Mul": lambda a, b, attrs: np.multiply(a, b),
    "Neg": lambda x, attrs: np.negative(x),
    "Min": lambda *xs, attrs: np.minimum.reduce(np.broadcast_arrays(*xs)),
    "Max": lambda *xs, attrs: np.maximum.reduce(np.broadcast_arrays(*xs)),
    "Unsqueeze": unsqueeze,
    "Squeeze": squeeze,
    "Reshape": reshape,
    "Expand": expand,
}


def constant(spec: dict) -> np.ndarray:
    return np.array(spec["values"], dtype=spec["dtype"]).reshape(spec["shape"])


def run_onnx_step(step: dict, tensors: dict[str, np.ndarray]) -> None:
    """One moved node: its inputs from `tensors` (or its own constants), its outputs into `tensors`."""
    consts = step.get("constants", {})
    args = [constant(consts[name]) if name in consts else tensors[name] for name in step["inputs"]]
    result = OPS[step["type"]](*args, attrs=step.get("attrs", {}))
    tensors[step["outputs"][0]] = np.asarray(result)
