"""ONNX ops the runtime evaluates in numpy: what a model computes from its integer inputs alone
(an attention mask turned into an additive bias, position ids, token types, the embedding lookups
of all of them), and a model's last Softmax where its input leaves fp16 (shard.passes.scale_sandwich).

The vendor runs such ops (Gather of an embedding table, Cast to bool, Not, Where, CumSum of an
int64 mask) on the CPU inside its graph; the compiler moves them here instead
(shard.passes.host_edges), one step each:

    {"op": "onnx", "type": "Where", "inputs": [...], "outputs": [...], "attrs": {...},
     "constants": {NAME: {"dtype": "float32", "shape": [], "values": [...]}
                         or {"file": "host/NAME.npy"}}}    (an embedding table, a large mask)

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


def flatten(x, attrs):
    axis = attrs.get("axis", 1) % (x.ndim + 1) if x.ndim else 0
    return x.reshape(int(np.prod(x.shape[:axis], dtype=np.int64)), -1)


def slice_(x, starts, ends, axes=None, steps=None, attrs=None):
    index = [slice(None)] * x.ndim
    axes = range(len(starts)) if axes is None else axes
    steps = [1] * len(starts) if steps is None else steps
    for start, end, axis, step in zip(starts, ends, axes, steps):
        index[int(axis) % x.ndim] = slice(int(start), int(end), int(step))  # numpy clamps as ONNX does
    return x[tuple(index)]


def cumsum(x, axis, attrs):
    axis = int(np.asarray(axis).ravel()[0])
    if attrs.get("reverse"):
        x = np.flip(x, axis)
    out = np.cumsum(x, axis=axis, dtype=x.dtype)
    if attrs.get("exclusive"):
        out = np.concatenate([np.zeros_like(np.take(out, [0], axis=axis)), np.delete(out, -1, axis=axis)], axis=axis)
    return np.flip(out, axis) if attrs.get("reverse") else out


def gather(data, indices, attrs):
    axis = attrs.get("axis", 0) % data.ndim
    return np.take(data, np.where(indices < 0, indices + data.shape[axis], indices), axis=axis)


def arg_extreme(fn):
    """ArgMax/ArgMin: int64 indices along the axis; select_last_index takes the last of equal ones."""
    def op(x, attrs):
        axis = attrs.get("axis", 0) % x.ndim
        keep = bool(attrs.get("keepdims", 1))
        if attrs.get("select_last_index"):
            return (x.shape[axis] - 1 - fn(np.flip(x, axis), axis=axis, keepdims=keep)).astype(np.int64)
        return fn(x, axis=axis, keepdims=keep).astype(np.int64)
    return op


def gather_elements(data, indices, attrs):
    axis = attrs.get("axis", 0) % data.ndim
    return np.take_along_axis(data, np.where(indices < 0, indices + data.shape[axis], indices), axis=axis)


def reduce(fn):
    """ReduceSum/Mean/Max/Min: axes from the attribute (older opsets) or the optional input."""
    def op(x, axes=None, attrs=None):
        axes = attrs["axes"] if "axes" in attrs else axes
        if axes is None or np.asarray(axes).size == 0:
            if attrs.get("noop_with_empty_axes"):
                return x
            axes = None
        else:
            axes = tuple(int(a) % x.ndim for a in np.asarray(axes).ravel())
        return fn(x, axis=axes, keepdims=bool(attrs.get("keepdims", 1))).astype(x.dtype)
    return op


def clip(x, low=None, high=None, attrs=None):
    low = attrs.get("min", low)   # attributes before opset 11
    high = attrs.get("max", high)
    return np.clip(x, low, high).astype(x.dtype)


def div(a, b, attrs):
    if a.dtype.kind in "iu" and np.asarray(b).dtype.kind in "iu":   # ONNX truncates integer division
        return np.trunc(a / b).astype(np.result_type(a, b))
    return np.divide(a, b)


def softmax(x, attrs, log=False):
    """Softmax (opset 13: along one axis) in float64, cast back; log: LogSoftmax."""
    shifted = x.astype(np.float64) - x.max(axis=attrs.get("axis", -1), keepdims=True)
    total = np.exp(shifted).sum(axis=attrs.get("axis", -1), keepdims=True)
    return (shifted - np.log(total) if log else np.exp(shifted) / total).astype(x.dtype)


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
    "Div": div,
    "Neg": lambda x, attrs: np.negative(x),
    "Cos": lambda x, attrs: np.cos(x),
    "Sin": lambda x, attrs: np.sin(x),
    "Min": lambda *xs, attrs: np.minimum.reduce(np.broadcast_arrays(*xs)),
    "Max": lambda *xs, attrs: np.maximum.reduce(np.broadcast_arrays(*xs)),
    "Unsqueeze": unsqueeze,
    "Squeeze": squeeze,
    "Reshape": reshape,
    "Expand": expand,
    "CumSum": cumsum,
    "Flatten": flatten,
    "Slice": lambda *args, attrs: slice_(*args, attrs=attrs),
    "Concat": lambda *xs, attrs: np.concatenate(xs, axis=attrs["axis"]),
    "Transpose": lambda x, attrs: np.transpose(x, attrs.get("perm")),
    "Gather": gather,
    "GatherElements": gather_elements,
    "ArgMax": arg_extreme(np.argmax),
    "ArgMin": arg_extreme(np.argmin),
    "ReduceSum": reduce(np.sum),
    "ReduceMean": reduce(np.mean),
    "ReduceMax": reduce(np.max),
    "ReduceMin": reduce(np.min),
    "Clip": clip,
    "Softmax": softmax,
    "LogSoftmax": lambda x, attrs: softmax(x, attrs, log=True),
}


def constant(spec: dict, files: dict[str, np.ndarray]) -> np.ndarray:
    if "file" in spec:
        return files[spec["file"]]
    return np.array(spec["values"], dtype=spec["dtype"]).reshape(spec["shape"])


def run_onnx_step(step: dict, tensors: dict[str, np.ndarray], files: dict[str, np.ndarray]) -> None:
    """One moved node: its inputs from `tensors` (or its own constants; `files` holds those kept in
    the bundle, see shard.runtime.host.load_tables), its outputs into `tensors`."""
    consts = step.get("constants", {})
    args = [constant(consts[name], files) if name in consts else tensors[name] if name else None  # "": omitted
            for name in step["inputs"]]
    result = OPS[step["type"]](*args, attrs=step.get("attrs", {}))
    tensors[step["outputs"][0]] = np.asarray(result)
