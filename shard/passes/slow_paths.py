"""slow_paths: rewrite ops the profile marks `slow` into an equivalent form the compiler runs fast.

First case: a Conv whose kernel equals its stride (non-overlapping patches, the ViT/SigLIP patch
embedding) with a stride the profile marks slow (`conv-stride@...`, class slow: past the fastest, or,
where the probe swept the strides, outside the passing set). RK3588 lowers
it to a stride-4 Conv over the whole image plus a subsampling Conv (SigLIP-base-512: 193 M
estimated cycles). The same function is patches @ W + b: the patches are a reshape and transpose
of the input, which the runtime does on the host when the Conv reads a graph input (in the graph,
that transpose is an exWindow op that overflows registers on a 512x512 image; a per-channel
normalisation in between, (x - mean) / std, is folded into W and b first), and the MatMul costs
about 1.2 M cycles. Both forms are built alone in the toolkit and the cheaper clean one is kept;
the report carries their cycle estimates.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from shard.graph import as_model
from shard.passes.context import PassContext
from shard.passes.fit import OpSpec


def stride_limits(profile) -> dict:
    """The profile's patch-Conv stride limits that found slow strides ({name: Limit})."""
    return {name: lim for name, lim in profile.limits.items() if name.startswith("conv-stride@") and lim.failure == "slow"}


def why_slow(limits: dict, stride: int) -> str | None:
    """Why a patch Conv of this stride is off the fast path, by the first limit that says so (a swept
    limit: the stride is not among its passing sizes; else it is past the largest); None: fast."""
    for name, lim in limits.items():
        if not lim.allows(stride):
            return (f"Conv kernel = stride = {stride}: not among the fast strides of {name} (slow)" if lim.passing is not None
                    else f"Conv kernel = stride = {stride} > {lim.value}, the fastest stride ({name}, slow)")
    return None


def patch_conv(node: gs.Node, graph_inputs: set[str]) -> tuple[int, int] | None:
    """(kernel, stride) if node is a patch Conv on a graph input (or on its per-channel
    normalisation, see input_affine) this pass can rewrite."""
    if node.op != "Conv" or not isinstance(node.inputs[1], gs.Constant) or len(node.inputs[0].shape) != 4:
        return None  # Conv1d and Conv3d are not patch embeddings of images
    source = input_affine(node.inputs[0], int(node.inputs[0].shape[1]))
    if source is None or source[0].name not in graph_inputs:
        return None
    k, s = list(node.attrs.get("kernel_shape", [])), list(node.attrs.get("strides", [1, 1]))
    n, c, h, w = (int(d) for d in node.inputs[0].shape)
    if len(k) != 2 or k != s or k[0] != k[1] or k[0] < 2 or any(node.attrs.get("pads", [0] * 4)) \
            or any(d != 1 for d in node.attrs.get("dilations", [1, 1])) or node.attrs.get("group", 1) != 1 \
            or h % k[0] or w % k[0]:
        return None
    return k[0], s[0]


AFFINE = ("Add", "Sub", "Mul", "Div")


def input_affine(x: gs.Tensor, channels: int) -> tuple[gs.Tensor, np.ndarray, np.ndarray] | None:
    """x = scale[c] * source + shift[c] through a chain of Add/Sub/Mul/Div by per-channel constants
    (image normalisation inside the model) back to a tensor nothing produces: (source, scale, shift),
    or None. No chain: (x, 1, 0)."""
    scale, shift = np.ones(channels), np.zeros(channels)
    while x.inputs:
        op = x.inputs[0]
        if op.op not in AFFINE or len(op.inputs) != 2:
            return None
        a, b = op.inputs
        const_first = isinstance(a, gs.Constant)
        var, k = (b, a) if const_first else (a, b)
        if not isinstance(k, gs.Constant) or isinstance(var, gs.Constant) or len(var.outputs) != 1 \
                or (const_first and op.op == "Div"):
            return None
        try:
            kv = np.broadcast_to(k.values.astype(np.float64), [1, channels, 1, 1]).reshape(channels)
        except ValueError:
            return None  # not one value per channel
        s1, c1 = {"Add": (1.0, kv), "Sub": (-1.0, kv) if const_first else (1.0, -kv),
                  "Mul": (kv, 0.0), "Div": (1.0 / kv, 0.0)}[op.op]
        scale, shift, x = scale * s1, shift + scale * c1, var
    return x, scale, shift


def fold_input_affine(node: gs.Node) -> None:
    """Read the Conv's input before its per-channel normalisation, folded into the weights and bias:
    exact, since a patch Conv has no padding (every tap sees a real pixel)."""
    source, scale, shift = input_affine(node.inputs[0], int(node.inputs[0].shape[1]))
    if source is node.inputs[0]:
        return
    weight = node.inputs[1].values.astype(np.float64)
    bias = node.inputs[2].values.astype(np.float64) if len(node.inputs) > 2 else np.zeros(weight.shape[0])
    dtype = node.inputs[1].values.dtype
    folded_bias = bias + np.einsum("ocij,c->o", weight, shift)
    node.inputs[0] = source
    node.inputs[1] = gs.Constant(f"{node.name}/folded_W", (weight * scale[None, :, None, None]).astype(dtype))
    folded = gs.Constant(f"{node.name}/folded_b", folded_bias.astype(dtype))
    if len(node.inputs) > 2:
        node.inputs[2] = folded
    else:
        node.inputs.append(folded)


def npu_part(node: gs.Node, k: int, out: gs.Variable) -> tuple[list[gs.Node], gs.Variable]:
    """patches [N, T, C*k*k] @ W + b, back to the Conv's output `out` [N, O, H/k, W/k]."""
    x, weight = node.inputs[0], node.inputs[1].values
    bias = node.inputs[2].values if len(node.inputs) > 2 else np.zeros(weight.shape[0], weight.dtype)
    n, c, h, w = (int(d) for d in x.shape)
    o, hp, wp = weight.shape[0], h // k, w // k
    base = f"{node.name}/patches"
    patches = gs.Variable(f"{base}/tokens_in", dtype=x.dtype, shape=[n, hp * wp, c * k * k])
    mm = gs.Variable(f"{base}/matmul", dtype=x.dtype, shape=[n, hp * wp, o])
    biased = gs.Variable(f"{base}/bias", dtype=x.dtype, shape=[n, hp * wp, o])
    chan = gs.Variable(f"{base}/channels_first", dtype=x.dtype, shape=[n, o, hp * wp])
    nodes = [
        gs.Node("MatMul", f"{base}/MatMul", inputs=[patches, gs.Constant(f"{base}/W", weight.reshape(o, -1).T.copy())],
                outputs=[mm]),
        gs.Node("Add", f"{base}/Add", inputs=[mm, gs.Constant(f"{base}/b", bias)], outputs=[biased]),
        gs.Node("Transpose", f"{base}/Transpose", {"perm": [0, 2, 1]}, [biased], [chan]),
        gs.Node("Reshape", f"{base}/Reshape", inputs=[chan, gs.Constant(f"{base}/shape", np.array([n, o, hp, wp], np.int64))],
                outputs=[out]),
    ]
    return nodes, patches


def host_part(node: gs.Node, k: int, patches: gs.Variable) -> list[gs.Node]:
    """Input [N, C, H, W] -> [N, C, H/k, k, W/k, k] -> [N, H/k, W/k, C, k, k] -> patches [N, T, C*k*k]."""
    x = node.inputs[0]
    n, c, h, w = (int(d) for d in x.shape)
    base = f"{node.name}/patches"
    six = gs.Variable(f"{base}/blocks", dtype=x.dtype, shape=[n, c, h // k, k, w // k, k])
    moved = gs.Variable(f"{base}/blocks_t", dtype=x.dtype, shape=[n, h // k, w // k, c, k, k])
    return [
        gs.Node("Reshape", f"{base}/host_reshape", inputs=[x, gs.Constant(f"{base}/s6", np.array(six.shape, np.int64))],
                outputs=[six]),
        gs.Node("Transpose", f"{base}/host_transpose", {"perm": [0, 2, 4, 1, 3, 5]}, [six], [moved]),
        gs.Node("Reshape", f"{base}/host_tokens", inputs=[moved, gs.Constant(f"{base}/s3", np.array(patches.shape, np.int64))],
                outputs=[patches]),
    ]


def region_model(node: gs.Node, k: int):
    """The NPU part alone, on tensors of its own, as a model the toolkit can build."""
    out = node.outputs[0]
    alone = gs.Variable("out", dtype=out.dtype, shape=list(out.shape))
    nodes, patches = npu_part(node, k, alone)
    return as_model(gs.Graph(nodes=nodes, inputs=[patches], outputs=[alone], opset=17))


def slow_paths(graph: gs.Graph, ctx: PassContext) -> tuple[gs.Graph, dict]:
    limits = stride_limits(ctx.profile)
    changes, kept = [], []
    if not limits:
        return graph, {"changes": changes, "note": "the profile marks no slow Conv stride"}
    graph_inputs = {t.name for t in graph.inputs}
    for node in list(graph.nodes):
        found = patch_conv(node, graph_inputs)
        reason = found and why_slow(limits, found[1])
        if not reason:
            continue
        k, stride = found
        entry = {"node": node.name, "op": "Conv", "reason": reason}
        if ctx.ops is not None:  # judge both forms by the compiler's own estimate
            before = ctx.ops.build(OpSpec.of(node).model())
            after = ctx.ops.build(region_model(node, k))
            before_cost, _, rate = ctx.ops.cost(before)
            after_cost, unestimated, _ = ctx.ops.cost(after, rate)
            entry.update(before_cycles=before.figures.get("estimated_cycles"), after_cycles=after.figures.get("estimated_cycles"),
                         before_cost=before_cost, after_cost=after_cost, unestimated_cycles=unestimated,
                         ddr_cycles_per_kb=rate and round(rate, 1), after_class=after.failure)
            if not after.ok or after_cost >= before_cost:
                kept.append({**entry, "action": "left as is: the patch MatMul form is not cheaper or not clean"})
                continue
        folded = node.inputs[0].name not in graph_inputs
        fold_input_affine(node)
        out = node.outputs[0]
        node.outputs.clear()
        nodes, patches = npu_part(node, k, out)
        host = host_part(node, k, patches)
        graph.nodes.extend(host + nodes)
        ctx.host_candidates.update(n.name for n in host)
        changes.append({**entry, "action": "patches on the host (reshape, transpose) + MatMul + bias on the NPU"
                        + (" (the input's per-channel normalisation folded into the weights)" if folded else "")})
    return graph, {"changes": changes, "not_fixed": kept}
