"""npu_forms: ops a chip's compiler places on the CPU, rewritten into NPU ops that compute the same
function.

Softmax, on a chip whose profile finds no Softmax the NPU runs (every `softmax-width` and
`softmax-rows` limit fails `cpu-fallback` at N=1: RK3566 and RK3568 with toolkit 2.5.0, where
SigLIP's 12 attention Softmaxes run as exSoftmax13 on the CPU). Along the last axis of x [N,C,H,W]:

    m = MaxPool(x, kernel 1 x W)              the row's max
    d = x - m                                 <= 0
    e = Sigmoid(d) / Sigmoid(-d)              = exp(d): the NPU has no Exp (exp-width is on the CPU
                                              on every chip probed) but runs Sigmoid and Div
    s = AveragePool(e, kernel 1 x W)          the row's mean, at least 1/W (the max's e is 1)
    y = e / s * (1/W)

Equal to Softmax up to fp32 rounding (tests run both in onnxruntime). 2-D and 3-D inputs are
reshaped to 4-D around it. Measured on rk3568: a Softmax alone (a classifier's, a gate's) runs on the
NPU this way, 0 CPU ops against the vendor's 1. Attention's Softmax takes another form: between two
exMatMuls the keys are the channels of the compiler's layout, and MaxPool's form made the exMatMul on
each side transpose its output on the CPU (SigLIP: 25 CPU ops against 13). With every reduction a
MatMul by a constant column, no max, the row's mean taken out instead, and exp(d/2) squared after a
normalisation that keeps the squares in fp16 (rewrite_softmax_rows), SigLIP-512 has 0 CPU ops
against the vendor's 13 (simulator cosine 0.9999993); taken where the scores span at most
ROWS_SPAN on the calibration samples. A chip whose NPU runs some Softmax is left to the compiler.

Other ops (FORMS), where the one-op build of the op at its real shapes lands on the CPU (RK3588,
toolkit 2.5.0: Selu, Min, Exp, Tile, LRN and a padded AveragePool do; RK2118: LayerNorm at every
size), and a float Expand past 4-D, which builds on the NPU alone and lands on the CPU in attention:

    Selu(x)        Elu(x, alpha) * gamma
    Min(a, b, ..)  -Max(-a, -b, ..)                 (Max runs on the NPU in 4-D)
    Exp(x)         (Sigmoid(x/2) / Sigmoid(-x/2))^2
    Tile(x, r)     r copies joined by Concat, axis by axis
    Expand(x, s)   the same, each axis of x of size 1 that s widens (grouped-query attention with one
                   key/value head: its repeat_kv, [1, 1, 1, S, D] to [1, 1, R, S, D])
    Pad(x, v)      Concat of constant blocks of v, axis by axis
    LayerNorm      (x - x @ 1/C) / sqrt((d * 2^-k)^2 @ 2^2k/C + eps): the means as MatMuls with a
                   constant column (ReduceMean, Sub, Mul, ReduceMean are fused back into the CPU's
                   exNorm), the deviation scaled by the power of two nearest 1/sqrt(C) before it is
                   squared so the squares stay in fp16
    AveragePool    with padding left out of the count: the pool counting it, times k*k / count
    Resize         separable (linear, cubic, nearest): x @ A_w^T, then A_h @ that, the matrices
                   onnxruntime's own Resize of an identity (DPT's align_corners upsampling)
    LRN(x)         x / (bias + alpha/size * sum of x^2 over the channel window)^beta: the window sum a
                   1x1 Conv with a band of ones (x scaled by sqrt(alpha/size) first, so x^2 stays in
                   fp16), the power from Sqrt and Mul where 4*beta is a whole number (Pow with a
                   fractional exponent is on the CPU; 0.75, AlexNet's and GoogLeNet's, is
                   sqrt(s) * sqrt(sqrt(s)))

Three patterns, where the op that starts them lands on the CPU alone: a flatten before a linear
(rewrite_flat_linears), a reciprocal that Muls read (rewrite_reciprocals), and a linear whose
product is a graph output, such as an LM head, whose build fails or transposes its result back on
the CPU (rewrite_output_linears: the transposed product on the NPU, the Transpose on the host; a single
row as a 1x1 Conv, the Reshape on the host).
One where a small model of its context does: attention's value product, head by head
(rewrite_value_products; RK2118 transposes V on the CPU from 512 tokens). And one the vendor always
runs on the CPU: a Gather of rows at indices the host computes from the model's integer inputs (a
text encoder's pooled token, ArgMax of its ids), as a product with one-hot rows the host makes
(rewrite_row_gathers: the vendor's ArgMax, Gather and Reshape, 3 CPU ops, to none).

A one-op verdict only nominates: every rewritten shard is built beside its unrewritten twin, and the
compile keeps the rewrite only where that build is better (shard.never_worse).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from shard.calibration import calibration_samples, graph_stats, run_each, stats_cache
from shard.graph import as_model, dtype_name, is_static, small_model, tensor_spec
from shard.passes.context import PassContext
from shard.passes.fit import OpSpec, Verdict
from shard.passes.host_edges import integer_derived
from shard.passes.tile_attention import find_attention

SOFTMAX_FAMILIES = ("softmax-width@", "softmax-rows@")


def softmax_never_on_npu(profile) -> str | None:
    """The evidence, where every probed Softmax limit of the profile fails on the CPU from N=1."""
    limits = [(name, lim) for name, lim in profile.limits.items() if name.startswith(SOFTMAX_FAMILIES)]
    if limits and all(lim.failure == "cpu-fallback" and not lim.value for _, lim in limits):
        return f"{', '.join(name for name, _ in limits)}: on the CPU from N=1 ({limits[0][1].evidence[:160]})"
    return None


class Emit:
    """New tensors and nodes of one rewritten node, named under its name (`.../npu/...`), in its
    float dtype."""

    def __init__(self, graph: gs.Graph, node: gs.Node):
        self.graph, self.base = graph, node.name or node.outputs[0].name
        self.dtype = node.outputs[0].dtype
        self.float = np.dtype(dtype_name(self.dtype))

    def var(self, name: str, shape) -> gs.Variable:
        return gs.Variable(f"{self.base}/npu/{name}", self.dtype, list(shape))

    def const(self, name: str, value, dtype=None) -> gs.Constant:
        return gs.Constant(f"{self.base}/npu/{name}", np.array(value, dtype or self.float))

    def op(self, op: str, name: str, inputs: list, outputs: list, **attrs) -> None:
        self.graph.nodes.append(gs.Node(op, f"{self.base}/npu/{name}", attrs, inputs, outputs))


def rewrite_softmax(graph: gs.Graph, node: gs.Node) -> None:
    """Replace a last-axis Softmax by the MaxPool/Sigmoid/AveragePool form above; a 2-D or 3-D input
    is reshaped to [1, 1, rows, W] and back."""
    e = Emit(graph, node)
    x, y = node.inputs[0], node.outputs[0]
    shape = [int(d) for d in x.shape]
    width = shape[-1]
    four = shape if len(shape) == 4 else [1, 1, int(np.prod(shape[:-1])), width]
    pooled = [*four[:3], 1]
    src, out = (x, y) if len(shape) == 4 else (e.var("x4", four), e.var("y4", four))
    m, s = e.var("max", pooled), e.var("mean", pooled)
    d, nd, sp, sn, ex, q = (e.var(n, four) for n in ("d", "neg", "sig", "sig_neg", "exp", "q"))
    node.outputs.clear()
    if len(shape) != 4:
        e.op("Reshape", "to4d", [x, e.const("shape4", four, np.int64)], [src])
    e.op("MaxPool", "MaxPool", [src], [m], kernel_shape=[1, width])
    e.op("Sub", "Sub", [src, m], [d])
    e.op("Mul", "Neg", [d, e.const("minus1", -1.0)], [nd])
    e.op("Sigmoid", "Sigmoid", [d], [sp])
    e.op("Sigmoid", "SigmoidNeg", [nd], [sn])
    e.op("Div", "Exp", [sp, sn], [ex])
    e.op("AveragePool", "AveragePool", [ex], [s], kernel_shape=[1, width])
    e.op("Div", "Div", [ex, s], [q])
    e.op("Mul", "Scale", [q, e.const("inv_width", 1.0 / width)], [out])
    if len(shape) != 4:
        e.op("Reshape", "back", [out, e.const("shape", shape, np.int64)], [y])


def selu(e: Emit, node: gs.Node) -> None:
    x, y = node.inputs[0], node.outputs[0]
    elu = e.var("elu", x.shape)
    e.op("Elu", "Elu", [x], [elu], alpha=float(node.attrs.get("alpha", SELU_ALPHA)))
    e.op("Mul", "Gamma", [elu, e.const("gamma", node.attrs.get("gamma", SELU_GAMMA))], [y])


def minimum(e: Emit, node: gs.Node) -> None:
    negs = [e.var(f"neg{k}", t.shape) for k, t in enumerate(node.inputs)]
    for k, (t, neg) in enumerate(zip(node.inputs, negs)):
        e.op("Neg", f"Neg{k}", [t], [neg])
    top = e.var("max", node.outputs[0].shape)
    e.op("Max", "Max", negs, [top])
    e.op("Neg", "Min", [top], [node.outputs[0]])


def exp(e: Emit, node: gs.Node) -> None:
    """exp(x) = (Sigmoid(h) / Sigmoid(-h))^2 with h = x/2: Sigmoid(-x) itself leaves fp16's normal range
    (6.1e-5) from x = 9.7, Sigmoid(-x/2) stays in it up to exp's own fp16 limit (x = 11.1)."""
    x, y = node.inputs[0], node.outputs[0]
    h, sp, nh, sn, r = (e.var(n, x.shape) for n in ("half", "sig", "neg", "sig_neg", "root"))
    e.op("Mul", "Half", [x, e.const("c_half", 0.5)], [h])
    e.op("Sigmoid", "Sigmoid", [h], [sp])
    e.op("Neg", "Neg", [h], [nh])
    e.op("Sigmoid", "SigmoidNeg", [nh], [sn])
    e.op("Div", "Root", [sp, sn], [r])
    e.op("Mul", "Exp", [r, r], [y])


def tile_uncovered(node: gs.Node) -> str | None:
    repeats = node.inputs[1]
    if not isinstance(repeats, gs.Constant):
        return "repeats computed in the graph"
    if (repeats.values < 1).any():
        return f"repeats {repeats.values.tolist()}: a zero repeat makes an empty tensor"
    return None


def tile(e: Emit, node: gs.Node) -> None:
    copies(e, node.inputs[0], node.outputs[0], [int(r) for r in node.inputs[1].values])


def copies(e: Emit, x: gs.Tensor, y: gs.Tensor, repeats: list[int]) -> None:
    """y: `repeats[axis]` copies of x joined by Concat along each axis, one axis after another."""
    axes = [axis for axis, r in enumerate(repeats) if r > 1]
    shape, current = list(x.shape), x
    for k, axis in enumerate(axes):
        shape[axis] *= repeats[axis]
        out = y if k == len(axes) - 1 else e.var(f"tile{axis}", shape)
        e.op("Concat", f"Concat{axis}", [current] * repeats[axis], [out], axis=axis)
        current = out
    if not axes:
        e.op("Identity", "Identity", [x], [y])


def expand_uncovered(node: gs.Node) -> str | None:
    x, y = node.inputs[0], node.outputs[0]
    if not is_static(y.shape) or not is_static(x.shape):
        return "shapes not known at compile"
    if any(d not in (1, n) for d, n in zip(expanded_shape(x, y), y.shape)):
        return f"{list(x.shape)} does not broadcast to {list(y.shape)}"
    return None


def expanded_shape(x: gs.Tensor, y: gs.Tensor) -> list[int]:
    """x's shape with the leading 1s that broadcasting to y's rank adds."""
    return [1] * (len(y.shape) - len(x.shape)) + list(x.shape)


def expand(e: Emit, node: gs.Node) -> None:
    x, y = node.inputs[0], node.outputs[0]
    shape = expanded_shape(x, y)
    if len(shape) > len(x.shape):
        ranked = e.var("ranked", shape)
        e.op("Reshape", "Rank", [x, e.const("rank_shape", shape, np.int64)], [ranked])
        x = ranked
    copies(e, x, y, [n // d for d, n in zip(shape, y.shape)])


def lrn_uncovered(node: gs.Node) -> str | None:
    beta = float(node.attrs.get("beta", 0.75))
    if len(node.inputs[0].shape) != 4:
        return f"rank {len(node.inputs[0].shape)}: only 4-D LRN is rewritten"
    if not (abs(4 * beta - round(4 * beta)) < 1e-6 and 1 <= round(4 * beta) <= 8):
        return f"beta {beta}: only multiples of 1/4 up to 2 are made from Sqrt and Mul"
    return None


def lrn(e: Emit, node: gs.Node) -> None:
    """x / (bias + alpha/size * window sum of x^2)^beta, ONNX's window: channels c - floor((size-1)/2)
    to c + ceil((size-1)/2)."""
    x, y = node.inputs[0], node.outputs[0]
    shape = list(x.shape)
    channels, size = shape[1], int(node.attrs["size"])
    alpha, beta, bias = (float(node.attrs.get(k, v)) for k, v in (("alpha", 1e-4), ("beta", 0.75), ("bias", 1.0)))
    lo, hi = (size - 1) // 2, size // 2
    c = np.arange(channels)
    band = ((c[None, :] >= c[:, None] - lo) & (c[None, :] <= c[:, None] + hi)).astype(e.float)
    t, sq, s = (e.var(n, shape) for n in ("scaled", "square", "sum"))
    e.op("Mul", "Scale", [x, e.const("sqrt_alpha", np.sqrt(alpha / size))], [t])
    e.op("Mul", "Square", [t, t], [sq])
    e.op("Conv", "Window", [sq, e.const("band", band[:, :, None, None]), e.const("bias", np.full(channels, bias))],
         [s], kernel_shape=[1, 1])
    quarters = round(4 * beta)
    factors = [s] * (quarters // 4)
    if quarters % 4:
        half = e.var("sqrt", shape)
        e.op("Sqrt", "Sqrt", [s], [half])
        if quarters % 4 >= 2:
            factors.append(half)
        if quarters % 2:
            quarter = e.var("sqrt_sqrt", shape)
            e.op("Sqrt", "SqrtSqrt", [half], [quarter])
            factors.append(quarter)
    power = factors[0]
    for k, f in enumerate(factors[1:]):
        product = e.var(f"power{k}", shape)
        e.op("Mul", f"Power{k}", [power, f], [product])
        power = product
    e.op("Div", "Div", [x, power], [y])


def average_pool_uncovered(node: gs.Node) -> str | None:
    attrs = node.attrs
    if len(node.inputs[0].shape) != 4:
        return f"rank {len(node.inputs[0].shape)}: only 2-D pooling of a 4-D tensor is rewritten"
    if attrs.get("count_include_pad", 0) or not any(attrs.get("pads", [0])) or attrs.get("auto_pad", "NOTSET") != "NOTSET":
        return "no explicit padding left out of the count: this is not the case the form covers"
    if attrs.get("ceil_mode", 0) or any(d != 1 for d in attrs.get("dilations", [1, 1])):
        return "ceil_mode or dilations: windows past the padding are not covered"
    return None


def average_pool(e: Emit, node: gs.Node) -> None:
    """AveragePool leaving its padding out of the count = the same pool counting it, times k*k over
    each output's count of real inputs (a constant [1, 1, Ho, Wo] map)."""
    x, y = node.inputs[0], node.outputs[0]
    kernel, pads = node.attrs["kernel_shape"], node.attrs["pads"]
    strides = node.attrs.get("strides", [1, 1])
    valid = np.pad(np.ones(x.shape[2:]), [(pads[0], pads[2]), (pads[1], pads[3])])
    height, width = y.shape[2:]
    count = np.array([[valid[i * strides[0]:i * strides[0] + kernel[0], j * strides[1]:j * strides[1] + kernel[1]].sum()
                       for j in range(width)] for i in range(height)])
    pooled = e.var("inclusive", y.shape)
    e.op("AveragePool", "AveragePool", [x], [pooled], **{**node.attrs, "count_include_pad": 1})
    e.op("Mul", "Count", [pooled, e.const("per_count", (kernel[0] * kernel[1] / count)[None, None])], [y])


def pad_uncovered(node: gs.Node) -> str | None:
    if node.attrs.get("mode", "constant") not in ("constant", b"constant"):
        return f"mode {node.attrs['mode']}: only a constant pad is rewritten"
    if len(node.inputs) < 2 or not isinstance(node.inputs[1], gs.Constant) or \
            len(node.inputs) > 3 and node.inputs[3].name:
        return "pads computed in the graph, or given axes: not covered"
    if len(node.inputs) > 2 and node.inputs[2].name and not isinstance(node.inputs[2], gs.Constant):
        return "a value computed in the graph: not covered"
    if any(int(p) < 0 for p in node.inputs[1].values):
        return "negative pads (a crop): not covered"
    if not any(int(p) for p in node.inputs[1].values):
        return "no padding: nothing to rewrite"
    return None


def pad(e: Emit, node: gs.Node) -> None:
    """A constant pad as a Concat of constant blocks of its value, axis by axis: the vendor runs some
    pads on the CPU (toolkit 2.5.0: `Pad: mode constant unsupport pads[5] = 2`, two slots after a
    token sequence)."""
    x, y = node.inputs[0], node.outputs[0]
    pads = [int(p) for p in node.inputs[1].values]
    rank = len(x.shape)
    value = float(node.inputs[2].values.reshape(-1)[0]) if len(node.inputs) > 2 and node.inputs[2].name else 0.0
    shape, current = [int(d) for d in x.shape], x
    axes = [k for k in range(rank) if pads[k] or pads[k + rank]]
    for n, k in enumerate(axes):
        parts = []
        for side, width in (("before", pads[k]), ("after", pads[k + rank])):
            if width:
                block = [width if a == k else d for a, d in enumerate(shape)]
                parts.append((side, e.const(f"{side}{k}", np.full(block, value))))
        shape[k] += pads[k] + pads[k + rank]
        out = y if n == len(axes) - 1 else e.var(f"padded{k}", shape)
        inputs = [c for side, c in parts if side == "before"] + [current] + [c for side, c in parts if side == "after"]
        e.op("Concat", f"Concat{k}", inputs, [out], axis=k)
        current = out


def resize_uncovered(node: gs.Node) -> str | None:
    x, y = node.inputs[0], node.outputs[0]
    if len(x.shape) != 4 or list(x.shape[:2]) != list(y.shape[:2]):
        return "only a resize of the last two axes of a 4-D tensor is rewritten"
    if node.attrs.get("coordinate_transformation_mode") == "tf_crop_and_resize" \
            or {"axes", "antialias", "keep_aspect_ratio_policy"} & set(node.attrs):
        return "crop-and-resize, and opset 18's axes, antialias and aspect-ratio policies, are not covered"
    if not all(isinstance(t, gs.Constant) or not t.name for t in node.inputs[1:]):
        return "scales or sizes computed in the graph"
    return None


def axis_matrix(node: gs.Node, axis: int) -> np.ndarray:
    """The resize along one axis as a matrix [n_out, n_in], from onnxruntime itself: the same Resize
    (attributes, and scales or sizes for that axis alone) applied to an identity."""
    from onnx import helper

    n_in, n_out = node.inputs[0].shape[axis], node.outputs[0].shape[axis]
    scales = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2].name else None
    shape = [1, 1, n_in, n_in]
    if scales is not None and scales.values.size:
        factor = np.ones(4, np.float32)
        factor[axis] = scales.values[axis]
        inputs, given = ["eye", "", "scales"], ("scales", factor)
    else:
        sizes = list(shape)
        sizes[axis] = n_out
        inputs, given = ["eye", "", "", "sizes"], ("sizes", np.array(sizes, np.int64))
    out_shape = list(shape)
    out_shape[axis] = n_out
    model = small_model([helper.make_node("Resize", inputs, ["out"], **node.attrs)], [("eye", shape)],
                        [("out", out_shape)], [given])
    eye = np.eye(n_in, dtype=np.float32)[None, None]
    out = next(run_each(model, [{"eye": eye}], ["out"], optimize=False))["out"][0, 0]
    return out if axis == 2 else out.T   # rows: output positions


def resize(e: Emit, node: gs.Node) -> None:
    """A separable resize (linear, cubic, nearest; per axis, as ONNX defines it) as two MatMuls with its
    interpolation matrices: x @ A_w^T, then A_h @ that."""
    x, y = node.inputs[0], node.outputs[0]
    n, c, h, w = x.shape
    height, width = axis_matrix(node, 2), axis_matrix(node, 3)
    resizes_height = height.shape != (h, h) or not np.array_equal(height, np.eye(h))
    current = x
    if width.shape != (w, w) or not np.array_equal(width, np.eye(w)):
        current_out = e.var("width", [n, c, h, width.shape[0]]) if resizes_height else y
        e.op("MatMul", "Width", [current, e.const("width_matrix", width.T.copy())], [current_out])
        current = current_out
    if resizes_height:
        e.op("MatMul", "Height", [e.const("height_matrix", height), current], [y])
    elif current is x:   # a resize to the same size
        e.op("Identity", "Identity", [x], [y])


def layernorm_uncovered(node: gs.Node) -> str | None:
    rank = len(node.inputs[0].shape)
    if node.attrs.get("axis", -1) % rank != rank - 1:
        return f"axis {node.attrs.get('axis')}: only a LayerNorm over the last axis is rewritten"
    if any(not isinstance(t, gs.Constant) for t in node.inputs[1:] if t.name) or len(node.outputs) > 1:
        return "a scale or bias computed in the graph, or the mean and deviation as outputs"
    return None


FP16_TINY = 2.0 ** -24   # fp16's smallest step: an epsilon below it would be 0 there (a constant row: 0 / 0)


def layernorm(e: Emit, node: gs.Node) -> None:
    """(x - mean) / sqrt(var + eps) * scale + bias over the last axis C, the means as MatMuls with a
    constant column (the compiler fuses ReduceMean, Sub, Mul, ReduceMean back into its CPU exNorm).
    The deviation is scaled by the power of two nearest 1 / sqrt(C) before it is squared, so the
    squares stay in fp16 for deviations up to 255 sqrt(C); an epsilon under fp16's smallest step
    is raised to it."""
    x, y = node.inputs[0], node.outputs[0]
    shape = [int(d) for d in x.shape]
    c = shape[-1]
    step = 2.0 ** -round(np.log2(np.sqrt(c)))
    eps = max(float(node.attrs.get("epsilon", 1e-5)), FP16_TINY)
    column = [*shape[:-1], 1]
    m, v, ve, root = (e.var(n, column) for n in ("mean", "variance", "variance_eps", "deviation"))
    d, t, sq = (e.var(n, shape) for n in ("centred", "scaled", "squares"))
    e.op("MatMul", "Mean", [x, e.const("mean_column", np.full((c, 1), 1.0 / c))], [m])
    e.op("Sub", "Centre", [x, m], [d])
    e.op("Mul", "Scale", [d, e.const("step", step)], [t])
    e.op("Mul", "Square", [t, t], [sq])
    e.op("MatMul", "Variance", [sq, e.const("variance_column", np.full((c, 1), 1.0 / (c * step * step)))], [v])
    e.op("Add", "Epsilon", [v, e.const("epsilon", eps)], [ve])
    e.op("Sqrt", "Sqrt", [ve], [root])
    extras = [t for t in node.inputs[1:] if t.name]
    normal = e.var("normal", shape) if extras else y
    e.op("Div", "Normalize", [d, root], [normal])
    if len(extras) == 2:
        scaled = e.var("times_scale", shape)
        e.op("Mul", "ScaleBy", [normal, extras[0]], [scaled])
        e.op("Add", "Bias", [scaled, extras[1]], [y])
    elif extras:
        e.op("Mul", "ScaleBy", [normal, extras[0]], [y])


SELU_ALPHA, SELU_GAMMA = 1.67326319217681884765625, 1.05070102214813232421875


@dataclass(frozen=True)
class Form:
    rewrite: Callable[[Emit, gs.Node], None]
    action: str
    uncovered: Callable[[gs.Node], str | None] = lambda node: None   # why this node is not rewritten


FORMS = {
    "Selu": Form(selu, "Elu and Mul on the NPU"),
    "Min": Form(minimum, "Neg, Max and Neg on the NPU"),
    "Exp": Form(exp, "(Sigmoid(x/2) / Sigmoid(-x/2))^2 on the NPU"),
    "Tile": Form(tile, "Concat of the copies on the NPU", tile_uncovered),
    "Expand": Form(expand, "Concat of the copies on the NPU", expand_uncovered),
    "AveragePool": Form(average_pool, "the pool counting its padding, times k*k / count (a constant map), on the NPU",
                        average_pool_uncovered),
    "Resize": Form(resize, "two MatMuls with its interpolation matrices (onnxruntime's own) on the NPU",
                   resize_uncovered),
    "LRN": Form(lrn, "the window sum as a 1x1 Conv, the power from Sqrt and Mul, and Div on the NPU", lrn_uncovered),
    "Pad": Form(pad, "a Concat of constant blocks of its value, axis by axis, on the NPU", pad_uncovered),
    "LayerNormalization": Form(layernorm, "mean and variance as MatMuls with a constant column, Sub, Mul, Sqrt and "
                                          "Div on the NPU", layernorm_uncovered),
}


ROWS_SPAN = 22.0   # the row form's input span it holds in fp16: exp(span / 2) < 65504


def rewrite_softmax_rows(graph: gs.Graph, node: gs.Node) -> None:
    """Attention's Softmax along the last axis W with every reduction a MatMul by a constant column,
    which the compiler runs in the exMatMul's own layout (the keys as channels) where MaxPool needs
    them as columns and costs two CPU Transposes:

        d = x - x @ 1/W                    the row's mean out: d <= span of the row
        r = Sigmoid(d/2) / Sigmoid(-d/2)   = exp(d/2), in fp16 for d < 22
        a = r / (r @ 1/sqrt(W))            so that sum(a^2) lies in [1, W]: a flat row's a^2 is 1/W
        y = a^2 / (a^2 @ 1)                = exp(d) / sum(exp(d))

    Equal to Softmax up to fp32 rounding where the row's max minus its mean stays under ROWS_SPAN."""
    e = Emit(graph, node)
    x, y = node.inputs[0], node.outputs[0]
    shape = [int(d) for d in x.shape]
    width, row = shape[-1], [*shape[:-1], 1]
    mean, norm, total = (e.var(n, row) for n in ("mean", "norm", "sum"))
    d, half, neg, sp, sn, r, a, a2 = (e.var(n, shape) for n in ("d", "half", "neg", "sig", "sig_neg", "exp_half",
                                                                 "scaled", "square"))
    column = lambda name, value: e.const(name, np.full((width, 1), value))  # noqa: E731
    node.outputs.clear()
    e.op("MatMul", "Mean", [x, column("mean_column", 1.0 / width)], [mean])
    e.op("Sub", "Sub", [x, mean], [d])
    e.op("Mul", "Half", [d, e.const("c_half", 0.5)], [half])
    e.op("Mul", "NegHalf", [d, e.const("c_neg_half", -0.5)], [neg])
    e.op("Sigmoid", "Sigmoid", [half], [sp])
    e.op("Sigmoid", "SigmoidNeg", [neg], [sn])
    e.op("Div", "ExpHalf", [sp, sn], [r])
    e.op("MatMul", "Norm", [r, column("norm_column", 1.0 / np.sqrt(width))], [norm])
    e.op("Div", "Scaled", [r, norm], [a])
    e.op("Mul", "Square", [a, a], [a2])
    e.op("MatMul", "Sum", [a2, column("ones", 1.0)], [total])
    e.op("Div", "Div", [a2, total], [y])


def input_spans(graph: gs.Graph, ctx: PassContext, nodes: list[gs.Node]) -> dict[str, float]:
    """max - min of each node's first input over the calibration samples (seeded random without
    --calib); empty where onnxruntime cannot run the model."""
    samples = calibration_samples(ctx, [tensor_spec(t) for t in graph.inputs])
    try:
        stats = graph_stats(graph, samples, [n.inputs[0].name for n in nodes], cache=stats_cache(ctx))
    except Exception:  # noqa: BLE001 - onnxruntime raises its own exception types
        return {}
    return {name: s.max - s.min for name, s in stats.items()}


def rewrite_softmaxes(graph: gs.Graph, evidence: str, ctx: PassContext) -> tuple[list[dict], list[dict]]:

    attention = {id(att.softmax): att.softmax for att in find_attention(graph)}
    spans = input_spans(graph, ctx, list(attention.values())) if attention else {}
    changes, left = [], []
    for node in [n for n in graph.nodes if n.op == "Softmax"]:
        if id(node) in attention:
            label, shape = node.name or node.outputs[0].name, node.inputs[0].shape
            span = spans.get(node.inputs[0].name)
            why = ("a dynamic shape" if not is_static(shape) else
                   "not along its last axis" if node.attrs.get("axis", -1) % len(shape) != len(shape) - 1 else
                   "no calibration range of its input" if span is None else
                   f"its input spans {span:.3g} on the calibration samples, past {ROWS_SPAN:g}" if span > ROWS_SPAN
                   else None)
            if why is None:
                rewrite_softmax_rows(graph, node)
                changes.append({"node": label, "op": "Softmax", "shape": list(shape),
                                "reason": f"attention's Softmax runs on the CPU on this chip ({evidence})",
                                "action": "its sums as MatMuls by a constant column, exp from Sigmoid and Div, on the NPU "
                                          f"(its input spans {span:.3g} on the calibration samples)"})
                continue
            left.append({"node": label, "op": "Softmax",
                         # (the two Transposes: measured on the RK3568)
                         "reason": f"attention's Softmax: {why}; MaxPool's form costs two CPU Transposes between "
                                   "the exMatMuls", "action": "left to the compiler"})
            continue
        shape = node.inputs[0].shape
        rank = len(shape) if shape is not None else 0
        axis = node.attrs.get("axis", -1)
        label = node.name or node.outputs[0].name
        if not 2 <= rank <= 4 or axis % rank != rank - 1 or not is_static(shape):
            left.append({"node": label, "op": "Softmax", "reason": f"axis {axis} of rank {rank}: only the last "
                                                                   f"axis of a static 2-D to 4-D tensor is rewritten",
                         "action": "left to the compiler"})
            continue
        rewrite_softmax(graph, node)
        changes.append({"node": label, "op": "Softmax", "shape": list(shape),
                        "reason": f"Softmax runs on the CPU on this chip ({evidence})",
                        "action": "MaxPool, Sigmoid(d) / Sigmoid(-d) for exp, AveragePool and Div on the NPU"})
    return changes, left


def on_cpu(node: gs.Node, legality) -> Verdict | None:
    """The one-op verdict of a float op at static shapes where it places the op on the CPU, else None:
    what nominates a rewrite here."""
    tensors = [t for t in (*node.inputs, *node.outputs) if t.name]   # not an omitted optional input
    if not all(is_static(t.shape) for t in tensors) or \
            dtype_name(node.outputs[0].dtype) not in ("float32", "float16"):
        return None
    verdict = legality.check(OpSpec.of(node))
    return verdict if verdict.failure == "cpu-fallback" else None


def in_context(node: gs.Node) -> Verdict | None:
    """A float Expand past 4-D (repeat_kv's [1, kv, 1, S, D] to [1, kv, R, S, D]) builds on the NPU
    alone and lands on the CPU in its attention (a one-head-of-keys Qwen2: both Expands): nominated
    without the one-op build; the shard's build beside its twin decides."""
    if node.op != "Expand" or len(node.outputs[0].shape or ()) <= 4 or \
            dtype_name(node.outputs[0].dtype) not in ("float32", "float16"):
        return None
    return Verdict(ok=False, failure="cpu-fallback", reason=f"a {len(node.outputs[0].shape)}-D Expand, which the "
                   f"vendor runs on the CPU inside attention")


def rewrite_forms(graph: gs.Graph, legality) -> tuple[list[dict], list[dict]]:
    """Each op of FORMS that its one-op build at its real shapes places on the CPU, rewritten."""
    changes, left = [], []
    for node in [n for n in graph.nodes if n.op in FORMS]:
        if (verdict := on_cpu(node, legality) or in_context(node)) is None:
            continue
        form, label = FORMS[node.op], node.name or node.outputs[0].name
        why_not = form.uncovered(node)
        if why_not:
            left.append({"node": label, "op": node.op, "reason": f"{verdict.reason}; {why_not}",
                         "action": "left to the compiler"})
            continue
        form.rewrite(Emit(graph, node), node)
        node.outputs.clear()
        changes.append({"node": label, "op": node.op, "shape": list(node.inputs[0].shape),
                        "reason": verdict.reason, "action": form.action})
    return changes, left


def flat_linear(node: gs.Node) -> tuple[gs.Node, np.ndarray, np.ndarray | None] | None:
    """(the linear, its weights as [out, C*H*W], its bias) where `node` flattens a static 4-D
    [N, C, H, W] to [N, C*H*W] for one Gemm or MatMul with constant weights, else None."""
    x, flat = node.inputs[0], node.outputs[0]
    shapes = (x.shape, flat.shape)
    if not all(is_static(s) for s in shapes) or len(x.shape) != 4 \
            or list(flat.shape) != [x.shape[0], int(np.prod(x.shape[1:]))] or len(flat.outputs) != 1:
        return None
    linear = flat.outputs[0]
    if linear.op not in ("Gemm", "MatMul") or linear.inputs[0] is not flat or len(linear.inputs) < 2 \
            or not isinstance(linear.inputs[1], gs.Constant):
        return None
    w = linear.inputs[1].values
    if linear.op == "MatMul":
        return (linear, w.T, None) if w.ndim == 2 else None
    if linear.attrs.get("transA", 0):
        return None
    w = (w if linear.attrs.get("transB", 0) else w.T) * w.dtype.type(linear.attrs.get("alpha", 1.0))
    bias = linear.inputs[2] if len(linear.inputs) > 2 else None
    if bias is not None and not isinstance(bias, gs.Constant):
        return None
    if bias is not None:
        b = bias.values * bias.values.dtype.type(linear.attrs.get("beta", 1.0))
        if b.size not in (1, w.shape[0]):
            return None   # a bias per sample, not per output
        bias = np.broadcast_to(b.reshape(-1), (w.shape[0],)).astype(w.dtype)
    return linear, w, bias


def rewrite_flat_linears(graph: gs.Graph, legality) -> list[dict]:
    """A flatten of [N, C, H, W] feeding a linear (a CNN's first classifier layer), where the flatten
    lands on the CPU (the vendor transposes its channel-interleaved layout there), becomes one Conv
    whose kernel is the whole H x W (the linear's weights reshaped), then a free [N, out, 1, 1] ->
    [N, out] reshape. AlexNet-shaped [1, 256, 6, 6] -> 4096: 1 CPU op -> 0, 3.197 M -> 3.198 M
    estimated cycles."""
    changes = []
    for node in [n for n in graph.nodes if n.op in ("Reshape", "Flatten")]:
        found = flat_linear(node)
        if found is None or any(node.outputs[0] is t for t in graph.outputs) or (verdict := on_cpu(node, legality)) is None:
            continue
        linear, w, bias = found
        x, y = node.inputs[0], linear.outputs[0]
        n, c, h, width = x.shape
        e = Emit(graph, linear)
        conv = e.var("conv", [n, w.shape[0], 1, 1])
        inputs = [x, e.const("kernel", w.reshape(w.shape[0], c, h, width))]
        if bias is not None:
            inputs.append(e.const("bias", bias))
        e.op("Conv", "Conv", inputs, [conv], kernel_shape=[h, width])
        e.op("Reshape", "flat", [conv, e.const("shape", [n, w.shape[0]], np.int64)], [y])
        linear.outputs.clear()
        node.outputs.clear()
        changes.append({"node": linear.name or y.name, "op": linear.op, "shape": [n, c, h, width],
                        "reason": f"the flatten before it: {verdict.reason}",
                        "action": f"one Conv with a {h}x{width} kernel (the linear's weights), then a [N, out, 1, 1] "
                                  f"reshape on the NPU"})
    return changes


def reciprocal(node: gs.Node) -> tuple[gs.Tensor, float] | None:
    """(s, c) where `node` makes c / s (Reciprocal, or a Div with a one-value constant numerator)."""
    if node.op == "Reciprocal":
        return node.inputs[0], 1.0
    if node.op == "Div" and isinstance(node.inputs[0], gs.Constant) and node.inputs[0].values.size == 1:
        return node.inputs[1], float(node.inputs[0].values.ravel()[0])
    return None


def rewrite_reciprocals(graph: gs.Graph, legality) -> list[dict]:
    """c / s that only Muls read, where its one-op build lands on the CPU (a Div with a constant
    numerator does on RK3588: T5's RMS norm, hidden * (1 / sqrt(variance + eps))): each x * (c / s)
    becomes x / s (times c), a Div of two tensors, which the NPU runs."""
    changes = []
    for node in [n for n in graph.nodes if n.op in ("Div", "Reciprocal")]:
        found, r = reciprocal(node), node.outputs[0]
        users = list(r.outputs)
        if found is None or not users or r in graph.outputs or any(
                u.op != "Mul" or len(u.inputs) != 2 or u.inputs[0] is u.inputs[1] or
                isinstance(next(t for t in u.inputs if t is not r), gs.Constant) for u in users) \
                or (verdict := on_cpu(node, legality)) is None:
            continue
        s, c = found
        for user in users:
            e, x, y = Emit(graph, user), next(t for t in user.inputs if t is not r), user.outputs[0]
            quotient = y if c == 1.0 else e.var("quotient", y.shape)
            e.op("Div", "Div", [x, s], [quotient])
            if c != 1.0:
                e.op("Mul", "Numerator", [quotient, e.const("numerator", c)], [y])
            user.outputs.clear()
        changes.append({"node": node.name or r.name, "op": node.op, "shape": list(s.shape),
                        "reason": verdict.reason, "action": f"each of its {len(users)} Mul readers x * (c / s) as "
                                                            f"x / s{'' if c == 1.0 else ' * c'}, on the NPU"})
    return changes


def output_linear(node: gs.Node, graph: gs.Graph) -> np.ndarray | None:
    """The weights [K, N] where `node` is a MatMul of a static activation [..., M, K] by them whose
    product is a graph output, else None."""
    if node.op != "MatMul" or not node.outputs or len(node.inputs) != 2 or not isinstance(node.inputs[1], gs.Constant) \
            or isinstance(node.inputs[0], gs.Constant) or not any(node.outputs[0] is t for t in graph.outputs):
        return None
    w, shape = node.inputs[1].values, node.inputs[0].shape
    return w if w.ndim == 2 and is_static(shape) and len(shape) >= 2 else None


def rewrite_output_linears(graph: gs.Graph, legality, host: set[str]) -> tuple[list[dict], list[dict]]:
    """A linear whose product is a graph output and whose one-op build fails or lands on the CPU
    becomes the transposed product, W^T @ x^T, and a Transpose back that runs on the host after the
    last shard (host_edges). An LM head is one: the compiler lowers x [1, M, K] @ W [K, N] to a Conv
    whose result is [1, N, 1, M] and transposes that back on the CPU, N = 50257 rows (gpt2) or
    151936 (Qwen2) wide; the transposed product ends with the Conv's own layout (gpt2's head on
    RK3588 against its unrewritten twin: 0 CPU ops and 0 `E` lines against 1 and 5, 5.1 M costed
    cycles against 5.4 M). A single row (a decode step's head) takes row_form instead."""
    changes, left = [], []
    for node in [n for n in graph.nodes if n.op == "MatMul"]:
        w = output_linear(node, graph)
        if w is None:
            continue
        verdict = legality.check(OpSpec.of(node))
        if verdict.ok and verdict.failure != "cpu-fallback":
            continue
        label, shape = node.name or node.outputs[0].name, list(node.outputs[0].shape)
        form = row_form if int(np.prod(node.inputs[0].shape[:-1])) == 1 else transposed_form
        placed, described = form(graph, node, w, legality, host)
        if not placed:
            left.append({"node": label, "op": "MatMul", "reason": f"{verdict.reason}; {described}",
                         "action": "left to the compiler"})
            continue
        changes.append({"node": label, "op": "MatMul", "shape": shape, "reason": verdict.reason,
                        "action": described})
    return changes, left


def transposed_form(graph: gs.Graph, node: gs.Node, w: np.ndarray, legality, host: set[str]) -> tuple[bool, str]:
    """x [..., M, K] @ W as W^T @ x^T on the NPU and a Transpose back on the host; (placed, what)."""
    e, x, y = Emit(graph, node), node.inputs[0], node.outputs[0]
    rank, (m, k), n = len(x.shape), x.shape[-2:], w.shape[1]
    perm = [*range(rank - 2), rank - 1, rank - 2]
    xt, yt = e.var("x_t", [*x.shape[:-2], k, m]), e.var("y_t", [*x.shape[:-2], n, m])
    product = gs.Node("MatMul", f"{e.base}/npu/MatMul", {}, [e.const("weights_t", w.T.copy()), xt], [yt])
    fits = legality.check(OpSpec.of(product))
    if not fits.ok or fits.failure == "cpu-fallback":
        return False, f"the transposed product too: {fits.reason}"
    node.outputs.clear()
    e.op("Transpose", "Transpose_in", [x], [xt], perm=perm)
    graph.nodes.append(product)
    e.op("Transpose", "Transpose_out", [yt], [y], perm=perm)
    host.add(graph.nodes[-1].name)
    return True, f"the transposed product W^T @ x^T ({[*x.shape[:-2], n, m]}) on the NPU, transposed back on the host"


def row_form(graph: gs.Graph, node: gs.Node, w: np.ndarray, legality, host: set[str]) -> tuple[bool, str]:
    """One row, x [1.., 1, K] @ W (a decode step's LM head), as a 1x1 Conv of x [1, K, 1, 1] with
    W^T [N, K, 1, 1] on the NPU and a Reshape of its [1, N, 1, 1] on the host: the same bytes in the
    same order. The compiler's own lowering of the MatMul ends in that Reshape on the CPU, and the
    transposed product of one row stalls its op fusion (rknn-toolkit2 2.5.0: no answer in 120 s on a
    [97, 64] x [64, 1] product that it builds in 1 s at two rows)."""
    e, x, y = Emit(graph, node), node.inputs[0], node.outputs[0]
    k, n = w.shape
    x4, y4 = e.var("x_1k11", [1, k, 1, 1]), e.var("y_1n11", [1, n, 1, 1])
    conv = gs.Node("Conv", f"{e.base}/npu/Conv", {"kernel_shape": [1, 1]},
                   [x4, e.const("weights_t", w.T.reshape(n, k, 1, 1).copy())], [y4])
    fits = legality.check(OpSpec.of(conv))
    if not fits.ok or fits.failure == "cpu-fallback":
        return False, f"the 1x1 Conv of the row too: {fits.reason}"
    node.outputs.clear()
    e.op("Reshape", "Reshape_in", [x, e.const("shape_in", [1, k, 1, 1], np.int64)], [x4])
    graph.nodes.append(conv)
    e.op("Reshape", "Reshape_out", [y4, e.const("shape_out", y.shape, np.int64)], [y])
    host.add(graph.nodes[-1].name)
    return True, f"the row as a 1x1 Conv ([1, {n}, 1, 1]) on the NPU, reshaped on the host"


def value_product(node: gs.Node) -> tuple[gs.Node, gs.Node] | None:
    """(the Transpose before it, the Transpose after it) where `node` is attention's value product as
    transformers export it: P [B, H, S, S'] @ Transpose(V [B, S', H, D], 0213), read only by a
    Transpose 0213 back to [B, S, H, D], with more than one head and static shapes."""
    if node.op != "MatMul" or not node.outputs or len(node.outputs[0].outputs) != 1 or not node.inputs[1].inputs:
        return None
    before, after = node.inputs[1].inputs[0], node.outputs[0].outputs[0]
    if any(t.op != "Transpose" or list(t.attrs.get("perm", [])) != [0, 2, 1, 3] for t in (before, after)):
        return None
    shapes = [node.inputs[0].shape, before.inputs[0].shape, after.outputs[0].shape]
    if len(node.inputs[1].outputs) != 1 or not all(s is not None and len(s) == 4 and is_static(s) for s in shapes):
        return None
    return (before, after) if shapes[1][2] > 1 else None


def split_heads(graph: gs.Graph, node: gs.Node, before: gs.Node, after: gs.Node) -> None:
    """The value product head by head: each head's V sliced, transposed and multiplied by its slice
    of P, transposed back, and the heads joined along the head axis of [B, S, H, D]. Exact."""
    e = Emit(graph, node)
    p, v, y = node.inputs[0], before.inputs[0], after.outputs[0]
    batch, keys, heads, depth = (int(d) for d in v.shape)
    rows = int(p.shape[2])
    head_axis_p, head_axis_v = e.const("axis_p", [1], np.int64), e.const("axis_v", [2], np.int64)
    joined = []
    for h in range(heads):
        start, end = e.const(f"h{h}/start", [h], np.int64), e.const(f"h{h}/end", [h + 1], np.int64)
        vh, vt = e.var(f"h{h}/v", [batch, keys, 1, depth]), e.var(f"h{h}/v_t", [batch, 1, keys, depth])
        ph, oh = e.var(f"h{h}/p", [batch, 1, rows, keys]), e.var(f"h{h}/o", [batch, 1, rows, depth])
        ot = e.var(f"h{h}/o_t", [batch, rows, 1, depth])
        e.op("Slice", f"h{h}/SliceV", [v, start, end, head_axis_v], [vh])
        e.op("Transpose", f"h{h}/TransposeV", [vh], [vt], perm=[0, 2, 1, 3])
        e.op("Slice", f"h{h}/SliceP", [p, start, end, head_axis_p], [ph])
        e.op("MatMul", f"h{h}/MatMul", [ph, vt], [oh])
        e.op("Transpose", f"h{h}/TransposeOut", [oh], [ot], perm=[0, 2, 1, 3])
        joined.append(ot)
    for n in (before, node, after):
        n.outputs.clear()
    e.op("Concat", "Concat", joined, [y], axis=2)


def value_context(p_shape: list[int], v_shape: list[int], per_head: bool) -> onnx.ModelProto:
    """The value path alone as a transformer has it, at the real shapes: V from a linear, reshaped to
    heads, the product with P, and the heads back into a linear; per head or as exported."""
    batch, keys, heads, depth = v_shape
    width, rows = heads * depth, p_shape[2]
    rng = np.random.default_rng(0)
    weight = lambda name: gs.Constant(name, (rng.standard_normal((width, width)) / width ** 0.5).astype(np.float32))  # noqa: E731
    var = lambda name, shape: gs.Variable(name, np.float32, shape)  # noqa: E731
    p, x, y = var("p", p_shape), var("x", [batch, keys, width]), var("y", [batch, rows, width])
    v, v4, vt, o, ot, o3 = (var(n, s) for n, s in (("v", [batch, keys, width]), ("v4", v_shape),
                                                    ("v_t", [batch, heads, keys, depth]), ("o", [batch, heads, rows, depth]),
                                                    ("o_t", [batch, rows, heads, depth]), ("o3", [batch, rows, width])))
    before = gs.Node("Transpose", "before", {"perm": [0, 2, 1, 3]}, [v4], [vt])
    product = gs.Node("MatMul", "product", {}, [p, vt], [o])
    after = gs.Node("Transpose", "after", {"perm": [0, 2, 1, 3]}, [o], [ot])
    graph = gs.Graph(nodes=[gs.Node("MatMul", "v_proj", {}, [x, weight("w_v")], [v]),
                            gs.Node("Reshape", "heads", {}, [v, gs.Constant("shape4", np.array(v_shape, np.int64))], [v4]),
                            before, product, after,
                            gs.Node("Reshape", "join", {}, [ot, gs.Constant("shape3", np.array([batch, rows, width], np.int64))], [o3]),
                            gs.Node("MatMul", "out_proj", {}, [o3, weight("w_o")], [y])],
                     inputs=[p, x], outputs=[y], opset=17)
    if per_head:
        split_heads(graph, product, before, after)
    return as_model(graph.cleanup().toposort())


def rewrite_value_products(graph: gs.Graph, legality) -> list[dict]:
    """Attention's value product, head by head, where in context the whole one puts a layer on the
    CPU and the heads put fewer. RK2118 at 512 tokens and more: the compiler's exMatMul wants V with
    the keys as channels and transposes [12, 64, 1, N] to [12, N, 1, 64] on the CPU; each head's
    [1, 64, 1, N] it transposes on the NPU (SigLIP-512: 12 CPU ops; the value path alone at 1024
    tokens: 1 CPU op, 0 per head, the same estimated cycles). Built in context, not alone: the
    product alone has layout Transposes at its edges that the graph does not."""
    changes, seen = [], {}
    for node in [n for n in graph.nodes if n.op == "MatMul"]:
        pair = value_product(node)
        if pair is None or dtype_name(node.outputs[0].dtype) not in ("float32", "float16"):
            continue
        shapes = ([int(d) for d in node.inputs[0].shape], [int(d) for d in pair[0].inputs[0].shape])
        key = repr(shapes)
        if key not in seen:
            whole = legality.cpu_layers(value_context(*shapes, per_head=False))
            heads = legality.cpu_layers(value_context(*shapes, per_head=True)) if whole else None
            seen[key] = (whole, heads)
        whole, heads = seen[key]
        if not whole or heads is None or heads >= whole:
            continue
        split_heads(graph, node, *pair)
        changes.append({"node": node.name or node.outputs[0].name, "op": "MatMul", "shape": shapes[0],
                        "reason": f"the value path built in context puts {whole} layer(s) on the CPU, head by head {heads}",
                        "action": f"{shapes[1][2]} value products, one per head, on the NPU"})
    return changes


def host_row_gather(node: gs.Node, derived: set[str]) -> bool:
    """A Gather of rows of an NPU tensor (its second-last axis) at indices the host computes from the
    model's integer inputs (a text encoder's pooled token, ArgMax of its ids)."""
    if node.op != "Gather" or len(node.inputs) != 2:
        return False
    data, indices = node.inputs
    return isinstance(data, gs.Variable) and isinstance(indices, gs.Variable) and data.name not in derived \
        and indices.name in derived and is_static(data.shape) and is_static(indices.shape) \
        and len(data.shape) >= 2 and node.attrs.get("axis", 0) % len(data.shape) == len(data.shape) - 2 \
        and data.dtype is not None and np.dtype(dtype_name(data.dtype)).kind == "f"


def rewrite_row_gathers(graph: gs.Graph) -> list[dict]:
    """Gather(x, i) of rows at host-computed indices as a product with their one-hot rows: the host
    makes onehot[k, n] = (i_k == n) (host_edges moves it there: Equal, Cast), the NPU takes
    onehot @ x, which picks each row exactly. The vendor runs a Gather with variable indices on the
    CPU. Negative indices count from the end, as Gather's do."""
    derived = integer_derived(graph)
    changes = []
    for node in [n for n in graph.nodes if host_row_gather(n, derived)]:
        data, indices = node.inputs
        out = node.outputs[0]
        shape, rows = [int(d) for d in data.shape], int(data.shape[-2])
        picks = int(np.prod(indices.shape, dtype=np.int64))
        e = Emit(graph, node)
        column = lambda name, dtype: gs.Variable(f"{e.base}/npu/{name}", dtype, [picks, 1])  # noqa: E731
        flat, wrapped, index = (column(n, indices.dtype) for n in ("flat", "wrapped", "index"))
        negative, hit = column("negative", np.bool_), gs.Variable(f"{e.base}/npu/hit", np.bool_, [picks, rows])
        onehot, product = e.var("onehot", [picks, rows]), e.var("product", [*shape[:-2], picks, shape[-1]])
        node.outputs.clear()
        int_type = np.dtype(dtype_name(indices.dtype))
        e.op("Reshape", "flat", [indices, e.const("column", [picks, 1], np.int64)], [flat])
        e.op("Less", "negative", [flat, e.const("zero", 0, int_type)], [negative])
        e.op("Add", "wrapped", [flat, e.const("rows", rows, int_type)], [wrapped])
        e.op("Where", "index", [negative, wrapped, flat], [index])
        e.op("Equal", "hit", [index, e.const("positions", np.arange(rows), int_type)], [hit])
        e.op("Cast", "onehot", [hit], [onehot], to=onnx.helper.np_dtype_to_tensor_dtype(e.float))
        e.op("MatMul", "pick", [onehot, data], [product])
        e.op("Reshape", "back", [product, e.const("shape", [int(d) for d in out.shape], np.int64)], [out])
        changes.append({"node": node.name, "op": "Gather", "form": "one-hot rows",
                        "reason": f"rows of {data.name} at indices the host computes ({indices.name})",
                        "action": f"one-hot [{picks}, {rows}] on the host, a MatMul on the NPU"})
    return changes


def npu_forms(graph: gs.Graph, ctx: PassContext) -> tuple[gs.Graph, dict]:
    evidence = softmax_never_on_npu(ctx.profile)
    changes, left = rewrite_softmaxes(graph, evidence, ctx) if evidence else ([], [])
    if ctx.legality is not None:
        more, others = rewrite_forms(graph, ctx.legality)
        changes = changes + more + rewrite_flat_linears(graph, ctx.legality) + rewrite_reciprocals(graph, ctx.legality)
        changes += rewrite_value_products(graph, ctx.legality)
        heads, unfit = rewrite_output_linears(graph, ctx.legality, ctx.host_candidates)   # after: a flatten's is a Conv
        changes, left = changes + heads + rewrite_row_gathers(graph), left + others + unfit
    report = {"changes": changes, "not_fixed": left}
    if evidence is None:
        report["note"] = "the profile finds Softmax on the NPU: Softmax left to the compiler"
    return graph, report
