"""npu_forms: ops a chip's compiler places on the CPU at every size, rewritten into NPU ops that
compute the same function.

First case: Softmax, on a chip whose profile finds no Softmax the NPU runs (every `softmax-width`
and `softmax-rows` limit fails `cpu-fallback` at N=1: RK3566 and RK3568 with toolkit 2.5.0, where
SigLIP's 12 attention Softmaxes run as exSoftmax13 on the CPU). Along the last axis of x [N,C,H,W]:

    m = MaxPool(x, kernel 1 x W)              the row's max
    d = x - m                                 <= 0
    e = Sigmoid(d) / Sigmoid(-d)              = exp(d): the NPU has no Exp (exp-width is on the CPU
                                              on every chip probed) but runs Sigmoid and Div
    s = AveragePool(e, kernel 1 x W)          the row's mean, at least 1/W (the max's e is 1)
    y = e / s * (1/W)

Equal to Softmax up to fp32 rounding (tests run both in onnxruntime). 2-D and 3-D inputs are
reshaped to 4-D around it. Measured on rk3568: a Softmax alone (a classifier's, a gate's) runs on the
NPU this way, 0 CPU ops against the vendor's 1. Attention's Softmax is left alone: alone, the form
costs 4.07 M estimated cycles for [1,12,1024,1024] with every op on the NPU, but inside SigLIP the
exMatMul on each side then needs its output transposed, on the CPU: 25 CPU ops against 13 and 8134 M
costed cycles against 1332 M (the vendor's exSoftmax13 on the CPU takes the matmul layout as it is).
A chip whose NPU runs some Softmax is left to the compiler, and the never-worse comparison keeps the
unrewritten build of any shard where this form is not better.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from shard.passes import PassContext, register

SOFTMAX_FAMILIES = ("softmax-width@", "softmax-rows@")


def softmax_never_on_npu(profile) -> str | None:
    """The evidence, where every probed Softmax limit of the profile fails on the CPU from N=1."""
    limits = [(name, lim) for name, lim in profile.limits.items() if name.startswith(SOFTMAX_FAMILIES)]
    if limits and all(lim.failure == "cpu-fallback" and not lim.value for _, lim in limits):
        return f"{', '.join(name for name, _ in limits)}: on the CPU from N=1 ({limits[0][1].evidence[:160]})"
    return None


def rewrite_softmax(graph: gs.Graph, node: gs.Node) -> None:
    """Replace a last-axis Softmax by the MaxPool/Sigmoid/AveragePool form above; a 2-D or 3-D input
    is reshaped to [1, 1, rows, W] and back."""
    x, y = node.inputs[0], node.outputs[0]
    shape = [int(d) for d in x.shape]
    width, base = shape[-1], node.name or y.name
    four = shape if len(shape) == 4 else [1, 1, int(np.prod(shape[:-1])), width]
    pooled = [*four[:3], 1]
    t = lambda name, s=four: gs.Variable(f"{base}/npu/{name}", x.dtype, s)  # noqa: E731
    const = lambda name, value, dtype=np.float32: gs.Constant(f"{base}/npu/{name}", np.array(value, dtype))  # noqa: E731
    src, out = (x, y) if len(shape) == 4 else (t("x4"), t("y4"))
    m, s = t("max", pooled), t("mean", pooled)
    d, nd, sp, sn, e, q = (t(n) for n in ("d", "neg", "sig", "sig_neg", "exp", "q"))
    nodes = [
        gs.Node("MaxPool", f"{base}/npu/MaxPool", {"kernel_shape": [1, width]}, [src], [m]),
        gs.Node("Sub", f"{base}/npu/Sub", inputs=[src, m], outputs=[d]),
        gs.Node("Mul", f"{base}/npu/Neg", inputs=[d, const("minus1", -1.0)], outputs=[nd]),
        gs.Node("Sigmoid", f"{base}/npu/Sigmoid", inputs=[d], outputs=[sp]),
        gs.Node("Sigmoid", f"{base}/npu/SigmoidNeg", inputs=[nd], outputs=[sn]),
        gs.Node("Div", f"{base}/npu/Exp", inputs=[sp, sn], outputs=[e]),
        gs.Node("AveragePool", f"{base}/npu/AveragePool", {"kernel_shape": [1, width]}, [e], [s]),
        gs.Node("Div", f"{base}/npu/Div", inputs=[e, s], outputs=[q]),
        gs.Node("Mul", f"{base}/npu/Scale", inputs=[q, const("inv_width", 1.0 / width)], outputs=[out]),
    ]
    if len(shape) != 4:
        nodes.insert(0, gs.Node("Reshape", f"{base}/npu/to4d", inputs=[x, const("shape4", four, np.int64)],
                                outputs=[src]))
        nodes.append(gs.Node("Reshape", f"{base}/npu/back", inputs=[out, const("shape", shape, np.int64)],
                             outputs=[y]))
    node.outputs.clear()
    graph.nodes.extend(nodes)


@register("npu_forms")
def npu_forms(graph: gs.Graph, ctx: PassContext) -> tuple[gs.Graph, dict]:
    evidence = softmax_never_on_npu(ctx.profile)
    if evidence is None:
        return graph, {"changes": [], "note": "the profile finds Softmax on the NPU: left to the compiler"}
    from shard.passes.tile_attention import find_attention

    attention = {id(att.softmax) for att in find_attention(graph)}
    changes, left = [], []
    for node in [n for n in graph.nodes if n.op == "Softmax"]:
        if id(node) in attention:
            left.append({"node": node.name or node.outputs[0].name, "op": "Softmax",
                         "reason": "attention's Softmax: between two exMatMuls this form costs two CPU Transposes "
                                   "(measured on rk3568)", "action": "left to the compiler"})
            continue
        shape = node.inputs[0].shape
        rank = len(shape) if shape is not None else 0
        axis = node.attrs.get("axis", -1)
        label = node.name or node.outputs[0].name
        if not 2 <= rank <= 4 or axis % rank != rank - 1 or any(not isinstance(d, int) for d in shape):
            left.append({"node": label, "op": "Softmax", "reason": f"axis {axis} of rank {rank}: only the last "
                                                                   f"axis of a static 2-D to 4-D tensor is rewritten"})
            continue
        rewrite_softmax(graph, node)
        changes.append({"node": label, "op": "Softmax", "shape": list(shape),
                        "reason": f"Softmax runs on the CPU on this chip ({evidence})",
                        "action": "MaxPool, Sigmoid(d) / Sigmoid(-d) for exp, AveragePool and Div on the NPU"})
    return graph, {"changes": changes, "not_fixed": left}
