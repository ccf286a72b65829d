"""An ONNX stage file as a sequence of torch operations, for the cuda executor.

Written for the ops the stage files of the zoo and the corpus hold (transformer encoders and CNNs
after canonicalize, strong_types and fp8_linears), rather than taken from onnx2torch: that one has
no QuantizeLinear/DequantizeLinear, which the FP8 stages are made of, and needs torchvision. Every
shape argument (Reshape's shape, Slice's bounds, axes) is a constant in a canonicalized stage, so it
is read once here and the call does no host round trip: a call can be captured as a CUDA graph.
Nodes whose inputs are all constants (a weight's DequantizeLinear) are computed once at load.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Callable

import numpy as np
import onnx
from onnx import numpy_helper

from shard.errors import RunError
from shard.runtime.executors import torch_fusions

TORCH_DTYPES = {  # ONNX element type -> torch dtype name
    onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16", onnx.TensorProto.BFLOAT16: "bfloat16",
    onnx.TensorProto.DOUBLE: "float64", onnx.TensorProto.INT64: "int64", onnx.TensorProto.INT32: "int32",
    onnx.TensorProto.INT8: "int8", onnx.TensorProto.UINT8: "uint8", onnx.TensorProto.BOOL: "bool",
    onnx.TensorProto.FLOAT8E4M3FN: "float8_e4m3fn",
}


def torch_dtype(onnx_type: int):
    import torch

    try:
        return getattr(torch, TORCH_DTYPES[onnx_type])
    except KeyError:
        raise RunError(f"the cuda executor has no torch type for ONNX type {onnx.TensorProto.DataType.Name(onnx_type)}") from None


def to_torch(tensor: onnx.TensorProto, device):
    import torch

    if tensor.data_type == onnx.TensorProto.FLOAT8E4M3FN:
        raw = np.asarray(numpy_helper.to_array(tensor)).view(np.uint8)
        return torch.from_numpy(raw.copy()).to(device).view(torch.float8_e4m3fn)
    if tensor.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):   # one int8 a value
        wide = np.int8 if tensor.data_type == onnx.TensorProto.INT4 else np.uint8
        return torch.from_numpy(numpy_helper.to_array(tensor).astype(wide)).to(device)
    return torch.from_numpy(np.array(numpy_helper.to_array(tensor))).to(device)


class TorchGraph:
    """Call with the stage's inputs (torch tensors, in the graph's input order); returns its outputs."""

    def __init__(self, model: onnx.ModelProto, device="cpu", name: str = "stage", fuse: bool = True,
                 constants: dict | None = None):
        """`constants`: the graph's constants as torch tensors, where the model's file holds none of them
        (the cost model plans the fused form over meta tensors: shapes, no data)."""
        import torch

        self.name = name
        self.device = device
        graph = model.graph
        self.values: dict[str, object] = dict(constants) if constants is not None else \
            {t.name: to_torch(t, device) for t in graph.initializer}
        self.host: dict[str, np.ndarray] = {}   # constant ints that become shape arguments
        for t in graph.initializer:
            if t.data_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32):
                self.host[t.name] = numpy_helper.to_array(t)
        for name, value in (constants or {}).items():
            if not value.is_floating_point() and not value.is_meta:
                self.host[name] = value.numpy()
        self.inputs = [i.name for i in graph.input if i.name not in self.values]
        self.outputs = [o.name for o in graph.output]
        self.steps: list[tuple[Callable, list[str], list[str]]] = []
        self.plain_steps: dict[int, Callable] = {}   # step -> its function in plain ops, where it has one
        self.covers: list[list[onnx.NodeProto]] = []   # the nodes each step computes (a fused one: several)
        self.dropped: list[onnx.NodeProto] = []   # nodes no step needs once fused (a DequantizeLinear no one reads)
        self.fused: Counter = Counter()   # how many runs of ops each fused kernel replaced
        live, folded = [], {}
        with torch.no_grad():
            for node in graph.node:
                if all(not i or i in self.values for i in node.input):   # constant: computed once, here
                    args = [self.values.get(i) for i in node.input]
                    if any(isinstance(a, torch.Tensor) and a.is_meta for a in args):
                        args = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
                    results = self._lower(node)(*args)
                    for name, value in zip(node.output, results if isinstance(results, tuple) else (results,)):
                        self.values[name] = value
                        folded[name] = node
                        if isinstance(value, torch.Tensor) and not value.is_floating_point() and value.numel() < 4096 \
                                and not value.is_meta:
                            self.host[name] = value.cpu().numpy()
                else:
                    live.append(node)
            shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
                      for v in [*graph.input, *graph.value_info, *graph.output]
                      if all(d.HasField("dim_value") for d in v.type.tensor_type.shape.dim)}
            steps = torch_fusions.plan(live, self.values, set(self.outputs), self._lower, folded, shapes) \
                if fuse else live
        wrap = (lambda fn: fn) if self._on_gpu() else on_cpu
        for step in steps:
            if isinstance(step, torch_fusions.Fused):
                self.fused[step.kind] += 1
                if step.plain is not None:
                    self.plain_steps[len(self.steps)] = wrap(step.plain)
                self.steps.append((wrap(step.fn), step.inputs, step.outputs))
                self.covers.append(step.nodes)
            else:
                self.steps.append((wrap(self._lower(step)), list(step.input), list(step.output)))
                self.covers.append([step])
        covered = {id(n) for nodes in self.covers for n in nodes}
        self.dropped = [n for n in live if id(n) not in covered]

    def __call__(self, *args, fused: bool = True):
        """The stage's outputs; `fused` False runs each fused step that has a plain form in it (attention as
        its MatMul, Softmax, MatMul), for torch.compile to fuse in its own way."""
        env = dict(self.values)
        env.update(zip(self.inputs, args))
        for k, (fn, ins, outs) in enumerate(self.steps):
            fn = fn if fused else self.plain_steps.get(k, fn)
            results = fn(*[env[i] if i else None for i in ins])
            if isinstance(results, tuple):
                env.update(zip(outs, results))
            else:
                env[outs[0]] = results
        return [env[o] for o in self.outputs]

    def unfused(self, *args):
        """The stage with its fused steps in plain ops where they have them (__call__'s `fused`): a code
        object of its own, so torch.compile keeps it apart from the fused form."""
        return self(*args, fused=False)

    def _on_gpu(self) -> bool:
        import torch

        return torch.device(self.device).type == "cuda"

    def _ints(self, node: onnx.NodeProto, index: int) -> list[int] | None:
        """A constant int input (a shape, axes, bounds), read at load."""
        if len(node.input) <= index or not node.input[index]:
            return None
        name = node.input[index]
        if name not in self.host:
            raise RunError(f"the cuda executor needs {node.op_type} {node.name!r}'s input {name!r} constant "
                           f"(stage {self.name}); it is computed at run time")
        return [int(v) for v in np.asarray(self.host[name]).reshape(-1)]

    def _scalar(self, node: onnx.NodeProto, index: int) -> float | int | None:
        """A constant scalar input (Clip's bounds), read at load."""
        if len(node.input) <= index or not node.input[index]:
            return None
        value = self.values.get(node.input[index])
        if value is None:
            raise RunError(f"the cuda executor needs {node.op_type} {node.name!r}'s input {node.input[index]!r} "
                           f"constant (stage {self.name})")
        return value.item()

    def _lower(self, node: onnx.NodeProto) -> Callable:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        make = LOWERINGS.get(node.op_type)
        if make is None:
            raise RunError(f"the cuda executor has no torch form of ONNX op {node.op_type} ({node.name!r}, stage "
                           f"{self.name}); run this bundle with --backend cpu")
        return make(self, node, attrs)


def on_cpu(fn: Callable) -> Callable:
    """fn, with its fp16 tensors taken through fp32 where torch has no fp16 kernel on the CPU
    (avg_pool3d, for one): the CPU runs stage files only to check them."""
    def run(*args):
        import torch

        try:
            return fn(*args)
        except (NotImplementedError, RuntimeError) as exc:
            if "Half" not in str(exc):
                raise
            widened = [a.float() if isinstance(a, torch.Tensor) and a.dtype == torch.float16 else a for a in args]
            out = fn(*widened)
            narrow = lambda t: t.half() if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t  # noqa: E731
            return tuple(narrow(t) for t in out) if isinstance(out, tuple) else narrow(out)
    return run


LOWERINGS: dict[str, Callable] = {}


def lowering(*ops: str):
    def wrap(fn):
        for op in ops:
            LOWERINGS[op] = fn
        return fn
    return wrap


def _torch():
    import torch

    return torch


@lowering("Add", "Sub", "Mul", "Div", "Pow", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And",
          "Or", "Xor", "Mod")
def _binary(g, node, attrs):
    torch = _torch()
    op = {"Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Pow": torch.pow, "Equal": torch.eq,
          "Less": torch.lt, "Greater": torch.gt, "LessOrEqual": torch.le, "GreaterOrEqual": torch.ge,
          "And": torch.logical_and, "Or": torch.logical_or, "Xor": torch.logical_xor}.get(node.op_type)
    if node.op_type == "Div":
        return lambda a, b: torch.div(a, b, rounding_mode="trunc") if not a.is_floating_point() else a / b
    if node.op_type == "Mod":
        return lambda a, b: torch.fmod(a, b) if attrs.get("fmod", 0) else torch.remainder(a, b)
    return op


@lowering("Relu", "Sigmoid", "Tanh", "Erf", "Sqrt", "Exp", "Log", "Neg", "Abs", "Reciprocal", "Not", "Identity",
          "Floor", "Ceil", "Sin", "Cos", "Softplus", "Round", "Sign")
def _unary(g, node, attrs):
    torch = _torch()
    return {"Relu": torch.relu, "Sigmoid": torch.sigmoid, "Tanh": torch.tanh, "Erf": torch.erf, "Sqrt": torch.sqrt,
            "Exp": torch.exp, "Log": torch.log, "Neg": torch.neg, "Abs": torch.abs, "Reciprocal": torch.reciprocal,
            "Not": torch.logical_not, "Identity": lambda x: x, "Floor": torch.floor, "Ceil": torch.ceil,
            "Sin": torch.sin, "Cos": torch.cos, "Softplus": torch.nn.functional.softplus, "Round": torch.round,
            "Sign": torch.sign}[node.op_type]


@lowering("Gelu", "LeakyRelu", "HardSigmoid", "HardSwish", "Elu", "Clip", "Selu", "PRelu", "Shrink")
def _activation(g, node, attrs):
    F = _torch().nn.functional
    torch = _torch()
    if node.op_type == "Shrink":
        lambd, bias = attrs.get("lambd", 0.5), attrs.get("bias", 0.0)
        return lambda x: torch.where(x < -lambd, x + bias, torch.where(x > lambd, x - bias, torch.zeros_like(x)))
    if node.op_type == "PRelu":
        return lambda x, slope: torch.where(x >= 0, x, x * slope)
    if node.op_type == "Selu":
        alpha, gamma = attrs.get("alpha", 1.67326319217681884765625), attrs.get("gamma", 1.05070102214813232421875)
        return lambda x: gamma * torch.where(x > 0, x, alpha * (torch.exp(x) - 1))
    if node.op_type == "Gelu":
        return lambda x: F.gelu(x, approximate=attrs.get("approximate", b"none").decode()
                                if isinstance(attrs.get("approximate"), bytes) else attrs.get("approximate", "none"))
    if node.op_type == "LeakyRelu":
        return lambda x: F.leaky_relu(x, attrs.get("alpha", 0.01))
    if node.op_type == "HardSigmoid":
        alpha, beta = attrs.get("alpha", 0.2), attrs.get("beta", 0.5)
        return lambda x: torch.clamp(alpha * x + beta, 0, 1)
    if node.op_type == "HardSwish":
        return F.hardswish
    if node.op_type == "Elu":
        return lambda x: F.elu(x, attrs.get("alpha", 1.0))
    low, high = g._scalar(node, 1), g._scalar(node, 2)
    if "min" in attrs or "max" in attrs:   # before opset 11
        low, high = attrs.get("min"), attrs.get("max")
    return lambda x, *_: torch.clamp(x, low, high)


@lowering("Max", "Min", "Sum", "Mean")
def _variadic(g, node, attrs):
    torch = _torch()
    pair = {"Max": torch.maximum, "Min": torch.minimum, "Sum": torch.add, "Mean": torch.add}[node.op_type]

    def run(*xs):
        out = xs[0]
        for x in xs[1:]:
            out = pair(out, x)
        return out / len(xs) if node.op_type == "Mean" else out
    return run


@lowering("Where")
def _where(g, node, attrs):
    return _torch().where


@lowering("Cast")
def _cast(g, node, attrs):
    dtype = torch_dtype(attrs["to"])
    return lambda x: x.to(dtype)


@lowering("MatMul")
def _matmul(g, node, attrs):
    return _torch().matmul


@lowering("Gemm")
def _gemm(g, node, attrs):
    alpha, beta = attrs.get("alpha", 1.0), attrs.get("beta", 1.0)
    ta, tb = attrs.get("transA", 0), attrs.get("transB", 0)

    def run(a, b, c=None):
        y = (a.t() if ta else a) @ (b.t() if tb else b)
        y = y * alpha if alpha != 1.0 else y
        return y if c is None else y + (c * beta if beta != 1.0 else c)
    return run


@lowering("Conv")
def _conv(g, node, attrs):
    F = _torch().nn.functional
    if attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET", b"VALID", "VALID"):
        raise RunError(f"the cuda executor takes Conv with explicit pads only ({node.name!r}, stage {g.name})")
    pads = attrs.get("pads")
    strides, dilations, group = attrs.get("strides", 1), attrs.get("dilations", 1), attrs.get("group", 1)

    def run(x, w, b=None):
        rank = w.dim() - 2
        p = pads or [0] * (2 * rank)
        if rank == 2 and group == 1 and not any(p) and list(w.shape[2:]) == list(_pair(strides)) \
                and _pair(dilations) == [1, 1]:
            return patches(x, w, b)
        conv = (F.conv1d, F.conv2d, F.conv3d)[rank - 1]
        if p[:rank] == p[rank:]:
            return conv(x, w, b, strides, p[:rank], dilations, group)
        flat = [v for k in reversed(range(rank)) for v in (p[k], p[k + rank])]
        return conv(F.pad(x, flat), w, b, strides, 0, dilations, group)
    return run


def _pair(value) -> list[int]:
    return list(value) if isinstance(value, (list, tuple)) else [value, value]


def patches(x, w, b):
    """A convolution whose kernel is its stride (a ViT's patch embedding) as one matrix product over
    the patches: measured on an H100, cuDNN took 89.5 us for SigLIP-so400m's 14x14 stride-14 fp16
    convolution, a 1.9 GFLOP product that takes about 5."""
    n, c, height, width = x.shape
    out, _, ph, pw = w.shape
    h, v = height // ph, width // pw
    x = x[:, :, :h * ph, :v * pw].reshape(n, c, h, ph, v, pw).permute(0, 2, 4, 1, 3, 5).reshape(n * h * v, c * ph * pw)
    y = x @ w.reshape(out, c * ph * pw).t()
    if b is not None:
        y = y + b
    return y.reshape(n, h, v, out).permute(0, 3, 1, 2)


@lowering("ConvTranspose")
def _conv_transpose(g, node, attrs):
    F = _torch().nn.functional
    if attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET", b"VALID", "VALID") or "output_shape" in attrs:
        raise RunError(f"the cuda executor takes ConvTranspose with explicit pads only ({node.name!r}, stage {g.name})")
    pads = attrs.get("pads")
    strides, dilations, group = attrs.get("strides", 1), attrs.get("dilations", 1), attrs.get("group", 1)
    extra = attrs.get("output_padding", 0)

    def run(x, w, b=None):
        rank = w.dim() - 2
        p = pads or [0] * (2 * rank)
        if p[:rank] != p[rank:]:
            raise RunError(f"the cuda executor takes ConvTranspose with symmetric pads only ({node.name!r})")
        conv = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[rank - 1]
        return conv(x, w, b, strides, p[:rank], extra, group, dilations)
    return run


@lowering("InstanceNormalization")
def _instance_norm(g, node, attrs):
    F = _torch().nn.functional
    eps = attrs.get("epsilon", 1e-5)
    return lambda x, scale, bias: F.instance_norm(x, weight=scale, bias=bias, eps=eps)


@lowering("Pad")
def _pad(g, node, attrs):
    F = _torch().nn.functional
    pads = attrs.get("pads") or g._ints(node, 1)
    value = g._scalar(node, 2) if len(node.input) > 2 else attrs.get("value", 0.0)
    axes = g._ints(node, 3)
    mode = attrs.get("mode", b"constant")
    mode = {"constant": "constant", "reflect": "reflect", "edge": "replicate"}[mode.decode() if isinstance(mode, bytes)
                                                                               else mode]

    def run(x, *_):
        rank = x.dim()
        dims = [a % rank for a in axes] if axes else list(range(rank))
        begin = {d: pads[i] for i, d in enumerate(dims)}
        end = {d: pads[len(dims) + i] for i, d in enumerate(dims)}
        padded = [d for d in dims if begin[d] or end[d]]
        if not padded:
            return x
        # torch lists pads from the last dimension backwards, down to the first one padded; its reflect
        # and replicate modes want at least the dimensions after batch and channel
        low = min(padded) if mode == "constant" or rank < 3 else min(min(padded), rank - 2)
        flat = [v for d in range(rank - 1, low - 1, -1) for v in (begin.get(d, 0), end.get(d, 0))]
        if mode == "constant":
            return F.pad(x, flat, value=float(value or 0.0))
        return F.pad(x, flat, mode=mode)
    return run


@lowering("MaxPool", "AveragePool")
def _pool(g, node, attrs):
    F = _torch().nn.functional
    kernel = attrs["kernel_shape"]
    rank = len(kernel)
    pads = attrs.get("pads", [0] * 2 * rank)
    strides = attrs.get("strides", [1] * rank)
    if pads[:rank] != pads[rank:] or attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET", b"VALID", "VALID"):
        raise RunError(f"the cuda executor takes {node.op_type} with symmetric explicit pads only ({node.name!r})")
    ceil = bool(attrs.get("ceil_mode", 0))
    if node.op_type == "MaxPool":
        pool = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[rank - 1]
        return lambda x: pool(x, kernel, strides, pads[:rank], attrs.get("dilations", 1), ceil)
    pool = (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d)[rank - 1]
    return lambda x: pool(x, kernel, strides, pads[:rank], ceil, bool(attrs.get("count_include_pad", 0)))


@lowering("GlobalAveragePool", "GlobalMaxPool")
def _global_pool(g, node, attrs):
    torch = _torch()
    if node.op_type == "GlobalAveragePool":
        return lambda x: torch.mean(x, dim=tuple(range(2, x.dim())), keepdim=True)
    return lambda x: torch.amax(x, dim=tuple(range(2, x.dim())), keepdim=True)


@lowering("BatchNormalization")
def _batchnorm(g, node, attrs):
    F = _torch().nn.functional
    eps = attrs.get("epsilon", 1e-5)
    return lambda x, scale, bias, mean, var: F.batch_norm(x, mean, var, scale, bias, False, 0.0, eps)


@lowering("LayerNormalization")
def _layernorm(g, node, attrs):
    F = _torch().nn.functional
    axis, eps = attrs.get("axis", -1), attrs.get("epsilon", 1e-5)

    def run(x, scale, bias=None):
        shape = x.shape[axis:] if axis != -1 else x.shape[-1:]
        return F.layer_norm(x, tuple(shape), scale, bias, eps)
    return run


@lowering("Softmax", "LogSoftmax")
def _softmax(g, node, attrs):
    torch = _torch()
    axis = attrs.get("axis", -1)
    fn = torch.softmax if node.op_type == "Softmax" else torch.log_softmax
    return lambda x: fn(x, axis)


@lowering("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd")
def _reduce(g, node, attrs):
    torch = _torch()
    axes = attrs.get("axes") or g._ints(node, 1)
    keep = bool(attrs.get("keepdims", 1))
    fn = {"ReduceMean": torch.mean, "ReduceSum": torch.sum, "ReduceMax": torch.amax, "ReduceMin": torch.amin}.get(
        node.op_type)

    def run(x, *_):
        dims = tuple(axes) if axes else tuple(range(x.dim()))
        if fn is None:   # ReduceProd
            out = x
            for d in sorted((d % x.dim() for d in dims), reverse=True):
                out = torch.prod(out, d, keepdim=keep)
            return out
        return fn(x, dim=dims, keepdim=keep)
    return run


@lowering("Reshape")
def _reshape(g, node, attrs):
    shape = g._ints(node, 1)
    allowzero = attrs.get("allowzero", 0)

    def run(x, _):
        dims = [x.shape[k] if d == 0 and not allowzero else d for k, d in enumerate(shape)]
        return x.reshape(dims)
    return run


@lowering("Flatten")
def _flatten(g, node, attrs):
    axis = attrs.get("axis", 1)

    def run(x):
        at = axis if axis >= 0 else axis + x.dim()
        return x.reshape(math.prod(x.shape[:at]), -1)
    return run


@lowering("Transpose")
def _transpose(g, node, attrs):
    perm = attrs.get("perm")
    return lambda x: x.permute(perm if perm is not None else list(reversed(range(x.dim()))))


@lowering("Unsqueeze")
def _unsqueeze(g, node, attrs):
    axes = attrs.get("axes") or g._ints(node, 1)

    def run(x, *_):
        rank = x.dim() + len(axes)
        for axis in sorted(a % rank for a in axes):
            x = x.unsqueeze(axis)
        return x
    return run


@lowering("Squeeze")
def _squeeze(g, node, attrs):
    axes = attrs.get("axes") or g._ints(node, 1)

    def run(x, *_):
        dims = [a % x.dim() for a in axes] if axes else [k for k, d in enumerate(x.shape) if d == 1]
        return x.reshape([d for k, d in enumerate(x.shape) if k not in dims])
    return run


@lowering("Concat")
def _concat(g, node, attrs):
    torch = _torch()
    return lambda *xs: torch.cat(xs, attrs["axis"])


@lowering("Split")
def _split(g, node, attrs):
    torch = _torch()
    axis = attrs.get("axis", 0)
    sizes = attrs.get("split") or g._ints(node, 1)
    parts = attrs.get("num_outputs", len(node.output))

    def run(x, *_):
        if sizes:
            return tuple(torch.split(x, list(sizes), axis))
        return tuple(torch.tensor_split(x, parts, axis)) if x.shape[axis] % parts else tuple(torch.chunk(x, parts, axis))
    return run


@lowering("Slice")
def _slice(g, node, attrs):
    starts, ends = g._ints(node, 1), g._ints(node, 2)
    axes, steps = g._ints(node, 3), g._ints(node, 4)
    if steps and any(s < 0 for s in steps):
        raise RunError(f"the cuda executor takes Slice with positive steps only ({node.name!r}, stage {g.name})")

    def run(x, *_):
        index = [slice(None)] * x.dim()
        for k, axis in enumerate(axes if axes is not None else range(len(starts))):
            dim = x.shape[axis]
            lo, hi = starts[k], ends[k]
            lo = max(0, min(dim, lo + dim if lo < 0 else lo))
            hi = max(0, min(dim, hi + dim if hi < 0 else hi))
            index[axis] = slice(lo, hi, steps[k] if steps else 1)
        return x[tuple(index)]
    return run


@lowering("Gather")
def _gather(g, node, attrs):
    axis = attrs.get("axis", 0)

    def run(x, idx):
        dim = axis % x.dim()
        flat = idx.reshape(-1).long()
        flat = flat.remainder(x.shape[dim]) if flat.numel() else flat   # negative indices count from the end
        out = x.index_select(dim, flat)
        return out.reshape((*x.shape[:dim], *idx.shape, *x.shape[dim + 1:]))   # a tuple: () when the result is a scalar
    return run


@lowering("GatherElements")
def _gather_elements(g, node, attrs):
    torch = _torch()
    axis = attrs.get("axis", 0)

    def run(x, idx):
        dim = axis % x.dim()
        return torch.gather(x, dim, idx.long().remainder(x.shape[dim]))   # negative indices count from the end
    return run


@lowering("Expand")
def _expand(g, node, attrs):
    torch = _torch()
    shape = tuple(g._ints(node, 1))
    return lambda x, _: x.expand(torch.broadcast_shapes(tuple(x.shape), shape))


@lowering("Tile")
def _tile(g, node, attrs):
    repeats = g._ints(node, 1)
    return lambda x, _: x.repeat(*repeats)


@lowering("Shape")
def _shape(g, node, attrs):
    torch = _torch()
    start, end = attrs.get("start", 0), attrs.get("end")
    return lambda x: torch.tensor(list(x.shape)[start:end], dtype=torch.int64, device=g.device)


@lowering("ConstantOfShape")
def _constant_of_shape(g, node, attrs):
    torch = _torch()
    shape = g._ints(node, 0)
    value = attrs.get("value")
    fill = numpy_helper.to_array(value).reshape(-1)[0].item() if value is not None else 0.0
    dtype = torch_dtype(value.data_type) if value is not None else torch.float32
    return lambda *_: torch.full(shape, fill, dtype=dtype, device=g.device)


@lowering("Constant")
def _constant(g, node, attrs):
    tensor = attrs.get("value")
    if tensor is None:
        raise RunError(f"the cuda executor takes Constant nodes with a tensor value only ({node.name!r})")
    return lambda: to_torch(tensor, g.device)


@lowering("Range")
def _range(g, node, attrs):
    torch = _torch()
    return lambda start, limit, delta: torch.arange(start.item(), limit.item(), delta.item(), dtype=start.dtype)


@lowering("QuantizeLinear")
def _quantize(g, node, attrs):
    torch = _torch()
    axis = attrs.get("axis", 1)

    def run(x, scale, zero=None):
        dtype = zero.dtype if zero is not None else torch.uint8
        s = scale if scale.dim() == 0 else scale.reshape([-1 if k == axis % x.dim() else 1 for k in range(x.dim())])
        y = x.float() / s.float()
        if dtype == torch.float8_e4m3fn:   # saturating, as QuantizeLinear's default
            return y.clamp(-448.0, 448.0).to(dtype)
        info = torch.iinfo(dtype)
        z = 0 if zero is None else zero.reshape(s.shape).to(torch.int32)
        return (torch.round(y) + z).clamp(info.min, info.max).to(dtype)
    return run


@lowering("DequantizeLinear")
def _dequantize(g, node, attrs):
    torch = _torch()
    axis, block = attrs.get("axis", 1), attrs.get("block_size", 0)

    def blocks(x, q):   # a blocked scale or zero point [.., K / block, ..] to q's shape: each row `block` times
        return x.repeat_interleave(block, dim=axis % q.dim())[tuple(slice(0, n) for n in q.shape)]

    def run(q, scale, zero=None):
        if block:
            scale, zero = blocks(scale, q), (None if zero is None else blocks(zero, q))
        s = scale if scale.dim() in (0, q.dim()) else \
            scale.reshape([-1 if k == axis % q.dim() else 1 for k in range(q.dim())])
        if q.dtype == torch.float8_e4m3fn:
            return (q.float() * s.float()).to(scale.dtype)
        z = 0 if zero is None else zero.reshape(s.shape).to(torch.int32)
        return ((q.to(torch.int32) - z).float() * s.float()).to(scale.dtype)
    return run


@lowering("Resize")
def _resize(g, node, attrs):
    F = _torch().nn.functional
    text = lambda key, default: (lambda v: v.decode() if isinstance(v, bytes) else v)(attrs.get(key, default))  # noqa: E731
    mode, transform = text("mode", "nearest"), text("coordinate_transformation_mode", "half_pixel")
    nearest = text("nearest_mode", "round_prefer_floor")
    sizes = g._ints(node, 3)
    scales = g.values.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    factors = [float(v) for v in scales.float().cpu()][2:] if scales is not None and scales.numel() else None
    if mode == "nearest":
        torch_mode = {("asymmetric", "floor"): "nearest", ("half_pixel", "round_prefer_ceil"): "nearest-exact",
                      ("pytorch_half_pixel", "round_prefer_ceil"): "nearest-exact"}.get((transform, nearest))
        align = None
    else:
        torch_mode = {"linear": "bilinear", "cubic": "bicubic"}.get(mode)
        align = {"align_corners": True, "half_pixel": False, "pytorch_half_pixel": False}.get(transform)
        if mode == "cubic" and attrs.get("cubic_coeff_a", -0.75) != -0.75:
            torch_mode = None
    if torch_mode is None or (mode != "nearest" and align is None):
        raise RunError(f"the cuda executor has no torch form of Resize mode {mode}, {transform}, {nearest} "
                       f"({node.name!r}, stage {g.name}); run this bundle with --backend cpu")

    def run(x, *_):
        kwargs = {"size": sizes[2:]} if sizes else {"scale_factor": factors}
        if torch_mode == "bilinear" and x.dim() == 3:
            return F.interpolate(x, mode="linear", align_corners=align, **kwargs)
        return F.interpolate(x, mode=torch_mode, align_corners=align, **kwargs)
    return run


@lowering("CumSum")
def _cumsum(g, node, attrs):
    torch = _torch()
    axis = g._ints(node, 1)[0]
    exclusive, reverse = attrs.get("exclusive", 0), attrs.get("reverse", 0)

    def run(x, _):
        y = torch.flip(x, [axis]) if reverse else x
        y = torch.cumsum(y, axis)
        if exclusive:
            y = y - (torch.flip(x, [axis]) if reverse else x)
        return torch.flip(y, [axis]) if reverse else y
    return run
