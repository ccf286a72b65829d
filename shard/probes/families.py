"""Probe families: tiny ONNX graphs with one size parameter, the others fixed per setting.

A family is named `<op>-<axis>`; each setting fixes the other dimensions at a value real models use,
because the legal region depends on the whole shape (FACTS: Add on [1,1,1,65536] is clean, on
[1,1,2,32768] it overflows). A limit is kept per `family@setting`.

Numeric families run in the simulator: their size is the magnitude of the input.
`slow` families carry a MAC count: a point is slow when the compiler's cycle estimate per MAC
exceeds the profile's peak rate by the profile's `slow_factor`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnx
from onnx import helper

from shard.errors import ShardError
from shard.graph import small_model

@dataclass(frozen=True)
class Family:
    name: str
    what: str                                   # the graph, with the swept size as `N`
    build: Callable[[int, dict], onnx.ModelProto]
    settings: dict[str, dict]
    start: int                                  # where the doubling starts (a size that should pass)
    max_size: int
    macs: Callable[[int, dict], int] | None = None     # set: the family also looks for slow points
    numeric: bool = False                       # size is an input magnitude; runs in the simulator
    input_range: Callable[[int, dict], float] = field(default=lambda size, s: 1.0)
    sweep: bool = False                         # not monotone in N: every size from start to max_size is probed
    version: int = 1                            # bump when the builder changes: old cached points are ignored


def weights(*shape: int, seed: int = 0) -> np.ndarray:
    fan_in = shape[-2] if len(shape) > 1 else 1
    return (np.random.default_rng(seed).standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)


def elementwise(op: str):
    def build(n: int, s: dict) -> onnx.ModelProto:
        shape = [1, 1, s["h"], n]
        return small_model([helper.make_node(op, ["x", "x"], ["y"])], [("x", shape)], [("y", shape)])
    return build


def unary(op: str):
    def build(n: int, s: dict) -> onnx.ModelProto:
        shape = [1, 1, s["h"], n]
        return small_model([helper.make_node(op, ["x"], ["y"])], [("x", shape)], [("y", shape)])
    return build


def gelu(n: int, s: dict) -> onnx.ModelProto:
    """GELU as torch exports it at opset 17: x * 0.5 * (1 + erf(x / sqrt(2)))."""
    shape = [1, 1, s["h"], n]
    consts = [("sqrt2", np.array(np.sqrt(2.0), np.float32)), ("one", np.array(1.0, np.float32)),
              ("half", np.array(0.5, np.float32))]
    nodes = [helper.make_node("Div", ["x", "sqrt2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["a"]), helper.make_node("Mul", ["x", "a"], ["m"]),
             helper.make_node("Mul", ["m", "half"], ["y"])]
    return small_model(nodes, [("x", shape)], [("y", shape)], consts)


def softmax(shape: list[int]) -> onnx.ModelProto:
    return small_model([helper.make_node("Softmax", ["x"], ["y"], axis=-1)], [("x", shape)], [("y", shape)])


def transpose(n: int, s: dict) -> onnx.ModelProto:
    shape = [n if d == "N" else d for d in s["shape"]]
    out = [shape[p] for p in s["perm"]]
    return small_model([helper.make_node("Transpose", ["x"], ["y"], perm=s["perm"])], [("x", shape)], [("y", out)])


def matmul(m: int, k: int, n: int, constant_b: bool) -> onnx.ModelProto:
    node = helper.make_node("MatMul", ["a", "b"], ["y"])
    if constant_b:
        return small_model([node], [("a", [1, m, k])], [("y", [1, m, n])], [("b", weights(k, n))])
    return small_model([node], [("a", [1, m, k]), ("b", [1, k, n])], [("y", [1, m, n])])


def layernorm(rows: int, width: int) -> onnx.ModelProto:
    node = helper.make_node("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1, epsilon=1e-5)
    inits = [("g", np.ones(width, np.float32)), ("b", np.zeros(width, np.float32))]
    return small_model([node], [("x", [1, rows, width])], [("y", [1, rows, width])], inits)


def conv(cin: int, cout: int, h: int, w: int, k: int, stride: int, pad: int) -> onnx.ModelProto:
    oh, ow = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
    node = helper.make_node("Conv", ["x", "w", "bias"], ["y"], kernel_shape=[k, k], strides=[stride, stride],
                            pads=[pad] * 4)
    inits = [("w", weights(cout, cin, k, k)), ("bias", np.zeros(cout, np.float32))]
    return small_model([node], [("x", [1, cin, h, w])], [("y", [1, cout, oh, ow])], inits)


def conv_macs(cin: int, cout: int, h: int, w: int, k: int, stride: int, pad: int) -> int:
    oh, ow = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
    return oh * ow * cout * cin * k * k


def concat(n: int, s: dict) -> onnx.ModelProto:
    shape = [1, 1, s["h"], n]
    return small_model([helper.make_node("Concat", ["a", "b"], ["y"], axis=-1)], [("a", shape), ("b", shape)],
                 [("y", [1, 1, s["h"], 2 * n])])


def reshape(n: int, s: dict) -> onnx.ModelProto:
    """[1, N, C] -> [1, N, heads, C / heads]: the head split every transformer does."""
    c, heads = s["c"], s["heads"]
    out = [1, n, heads, c // heads]
    return small_model([helper.make_node("Reshape", ["x", "shape"], ["y"])], [("x", [1, n, c])], [("y", out)],
                 [("shape", np.array(out, np.int64))])


def rows(op: str):
    """Row 0 of a sequence input: [N,1,W] along axis 0, [1,N,W] along axis 1; Gather drops the row's
    axis, Slice 0:1 keeps it. (On RK3588 a [20,1,4096] input fails whatever reads it, a Sigmoid
    too, while [16,1,4096] and [24,1,4096] build: the verdict is not monotone in N.)"""
    def build(n: int, s: dict) -> onnx.ModelProto:
        axis = s["axis"]
        shape = [n, 1, s["w"]] if axis == 0 else [1, n, s["w"]]
        if op == "Gather":
            out = shape[:axis] + shape[axis + 1:]
            node = helper.make_node("Gather", ["x", "index"], ["y"], axis=axis)
            return small_model([node], [("x", shape)], [("y", out)], [("index", np.array(0, np.int64))])
        out = shape[:axis] + [1] + shape[axis + 1:]
        params = [(name, np.array([v], np.int64)) for name, v in (("starts", 0), ("ends", 1), ("axes", axis))]
        node = helper.make_node("Slice", ["x", "starts", "ends", "axes"], ["y"])
        return small_model([node], [("x", shape)], [("y", out)], params)
    return build


ROWS = {"axis0-w4096": {"axis": 0, "w": 4096}, "axis1-w4096": {"axis": 1, "w": 4096}}
HEADS = {"shape": [1, "N", 12, 64], "perm": [0, 2, 1, 3]}          # [B,T,H,D] -> [B,H,T,D]
KEYS_T = {"shape": [1, 12, "N", 64], "perm": [0, 1, 3, 2]}         # K -> K^T
TOKENS_T = {"shape": [1, "N", 768], "perm": [0, 2, 1]}             # [B,T,C] -> [B,C,T]
STRIDE_IMAGE = 256

FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("add-width", "Add(x, x) on [1,1,H,N]", elementwise("Add"),
           {"h1": {"h": 1}, "h2": {"h": 2}, "h16": {"h": 16}}, 1024, 1 << 20),
    Family("mul-width", "Mul(x, x) on [1,1,H,N]", elementwise("Mul"),
           {"h1": {"h": 1}, "h2": {"h": 2}, "h16": {"h": 16}}, 1024, 1 << 20),
    Family("sigmoid-width", "Sigmoid on [1,1,H,N]", unary("Sigmoid"), {"h1": {"h": 1}, "h16": {"h": 16}}, 1024, 1 << 20),
    Family("exp-width", "Exp on [1,1,H,N]", unary("Exp"), {"h1": {"h": 1}, "h16": {"h": 16}}, 1024, 1 << 20),
    Family("gelu-width", "GELU (erf form, as torch exports it) on [1,1,H,N]", gelu,
           {"h1": {"h": 1}, "h16": {"h": 16}}, 1024, 1 << 20),
    Family("softmax-width", "Softmax(axis=-1) on [1,1,R,N]", lambda n, s: softmax([1, 1, s["r"], n]),
           {"r1": {"r": 1}, "r64": {"r": 64}}, 1024, 1 << 20),
    Family("softmax-rows", "Softmax(axis=-1) on [1,1,N,W]", lambda n, s: softmax([1, 1, n, s["w"]]),
           {"w64": {"w": 64}, "w1024": {"w": 1024}}, 64, 1 << 18),
    Family("transpose-plane", "Transpose of the perms transformers use; N tokens", transpose,
           {"0213-h12d64": HEADS, "0132-h12d64": KEYS_T, "021-c768": TOKENS_T}, 256, 1 << 15),
    Family("matmul-m", "MatMul [1,N,768] @ [768,768]", lambda n, s: matmul(n, 768, 768, s["const"]),
           {"weights": {"const": True}}, 256, 1 << 15),
    Family("matmul-k", "MatMul [1,64,N] @ [N,64]", lambda n, s: matmul(64, n, 64, s["const"]),
           {"weights": {"const": True}, "activations": {"const": False}}, 256, 1 << 16),
    Family("matmul-n", "MatMul [1,64,768] @ [768,N]", lambda n, s: matmul(64, 768, n, s["const"]),
           {"weights": {"const": True}, "activations": {"const": False}}, 256, 1 << 15),
    Family("layernorm-width", "LayerNormalization(axis=-1) on [1,R,N]", lambda n, s: layernorm(s["r"], n),
           {"r1": {"r": 1}, "r64": {"r": 64}}, 1024, 1 << 20),
    Family("conv-width", "Conv 3x3 pad 1, 16->16 channels, on [1,16,H,N]",
           lambda n, s: conv(16, 16, s["h"], n, 3, 1, 1), {"h8": {"h": 8}}, 1024, 1 << 18),
    Family("conv-channels", "Conv 1x1, N->64 channels, on [1,N,8,8]", lambda n, s: conv(n, 64, 8, 8, 1, 1, 0),
           {"cout64": {}}, 256, 1 << 15),
    Family("concat-width", "Concat(a, b, axis=-1) of two [1,1,H,N]", concat, {"h1": {"h": 1}, "h16": {"h": 16}},
           1024, 1 << 20),
    Family("reshape-size", "Reshape [1,N,768] -> [1,N,12,64]", reshape, {"c768-h12": {"c": 768, "heads": 12}},
           256, 1 << 15),
    Family("gather-rows", "Gather(index 0) of a sequence input [N,1,W] (axis 0) or [1,N,W] (axis 1)", rows("Gather"),
           ROWS, 2, 32, sweep=True),
    Family("slice-rows", "Slice 0:1 of a sequence input [N,1,W] (axis 0) or [1,N,W] (axis 1)", rows("Slice"),
           ROWS, 2, 32, sweep=True),
    Family("conv-stride", f"Conv kernel = stride = N (patches), C->64 channels, on [1,C,{STRIDE_IMAGE},{STRIDE_IMAGE}]",
           lambda n, s: conv(s["cin"], 64, STRIDE_IMAGE, STRIDE_IMAGE, n, n, 0),
           {"cin16": {"cin": 16}, "cin64": {"cin": 64}}, 1, 32,
           macs=lambda n, s: conv_macs(s["cin"], 64, STRIDE_IMAGE, STRIDE_IMAGE, n, n, 0), sweep=True),
    # From 3: a 1x1 kernel over 16 channels is itself off the fast path (5.4x the peak rate, measured).
    Family("conv-kernel", "Conv NxN stride 1, 16->16 channels, on [1,16,64,64]",
           lambda n, s: conv(16, 16, 64, 64, n, 1, 0), {"cin16": {}}, 3, 64,
           macs=lambda n, s: conv_macs(16, 16, 64, 64, n, 1, 0)),
    Family("layernorm-magnitude", "LayerNormalization on [1,64,768], inputs uniform in [-N, N]",
           lambda n, s: layernorm(64, 768), {"r64": {}}, 1, 1 << 15, numeric=True,
           input_range=lambda n, s: float(n)),
    # fp16's range as the NPU keeps it: x + x past 65504 is inf. scale_sandwich reads this limit.
    Family("add-magnitude", "Add x + x on [1,64,768] (outputs up to 2N), inputs uniform in [-N, N]",
           lambda n, s: small_model([helper.make_node("Add", ["x", "x"], ["y"])], [("x", [1, 64, 768])],
                                    [("y", [1, 64, 768])]), {"r64": {}}, 1, 1 << 17, numeric=True,
           input_range=lambda n, s: float(n)),
    Family("softmax-magnitude", "Softmax(axis=-1) on [1,12,64,64], inputs uniform in [-N, N]",
           lambda n, s: softmax([1, 12, 64, 64]), {"h12": {}}, 1, 1 << 15, numeric=True,
           input_range=lambda n, s: float(n)),
]}

DEFAULT_FAMILIES = tuple(FAMILIES)


def limit_name(family: Family, setting: str) -> str:
    return f"{family.name}@{setting}"


def select(names: list[str] | None) -> list[Family]:
    names = names or list(DEFAULT_FAMILIES)
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        raise ShardError(f"unknown probe famil{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)}; "
                         f"families: {', '.join(FAMILIES)}")
    return [FAMILIES[n] for n in names]
