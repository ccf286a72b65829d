"""The cuda executor's fused kernels (shard.runtime.executors.torch_fusions), on the CPU: each fused
stage against onnxruntime on the unfused graph (numerics), and which runs were fused (structure)."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import run_ort
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

torch = pytest.importorskip("torch")

from shard.runtime.executors.torch_graph import TorchGraph  # noqa: E402

rng = np.random.default_rng(0)


def model_of(nodes, inputs: dict[str, list[int]], outputs: dict[str, list[int]], inits: dict[str, np.ndarray] = ()):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs.items()],
                              [onnx.numpy_helper.from_array(v, n) for n, v in dict(inits).items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    return model


def fused_and_checked(model: onnx.ModelProto, feeds: dict[str, np.ndarray], atol=1e-4) -> TorchGraph:
    """The model's TorchGraph, after checking its outputs against onnxruntime's and the unfused form's."""
    want = run_ort(model, feeds, optimize=False)
    graph = TorchGraph(model, "cpu")
    with torch.no_grad():
        got = graph(*[torch.from_numpy(feeds[n]) for n in graph.inputs])
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w, atol=atol, rtol=1e-4)
    return graph


def attention_model(heads: int, kv_heads: int, length: int, keys: int, dim: int, scale_op: str, mask: bool,
                    probs_out: bool = False):
    scale = 1 / math.sqrt(dim)
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s"])]
    last = "s"
    if scale_op:
        nodes.append(helper.make_node(scale_op, ["s", "c"], ["s2"]))
        last = "s2"
    if mask:
        nodes.append(helper.make_node("Add", [last, "m"], ["s3"]))
        last = "s3"
    nodes += [helper.make_node("Softmax", [last], ["p"], axis=-1), helper.make_node("MatMul", ["p", "v"], ["y"])]
    inputs = {"q": [1, heads, length, dim], "k": [1, kv_heads, keys, dim], "v": [1, kv_heads, keys, dim],
              **({"m": [1, 1, length, keys]} if mask else {})}
    outputs = {"y": [1, heads, length, dim], **({"p": [1, heads, length, keys]} if probs_out else {})}
    c = np.array(scale if scale_op == "Mul" else 1 / scale, np.float32)
    return model_of(nodes, inputs, outputs, {"c": c} if scale_op else {}), inputs


@settings(max_examples=20, deadline=None)
@given(heads=st.integers(1, 4), length=st.integers(1, 9), keys=st.integers(1, 9), dim=st.sampled_from([4, 8, 16]),
       scale_op=st.sampled_from(["Mul", "Div", ""]), mask=st.booleans())
def test_attention_runs_as_one_sdpa(heads, length, keys, dim, scale_op, mask):
    model, inputs = attention_model(heads, heads, length, keys, dim, scale_op, mask)
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in inputs.items()}
    if mask:   # a causal-like additive mask: large negatives where a key is hidden
        feeds["m"] = np.where(rng.random(inputs["m"]) < 0.3, -1e4, 0.0).astype(np.float32)
    graph = fused_and_checked(model, feeds)
    assert graph.fused == {"attention": 1}
    assert len(graph.steps) == 2   # the Transpose (a view) and the attention


def test_fused_attention_keeps_its_plain_form_for_the_compiled_alternative():
    """TorchGraph.unfused runs the fused attention in its own ops (the form torch.compile may fuse better on
    few rows; the cuda executor times both): the same outputs; a stage with no attention has no such form."""
    model, inputs = attention_model(4, 4, 5, 6, 8, "Div", True)
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in inputs.items()}
    graph = fused_and_checked(model, feeds)
    assert list(graph.plain_steps) == [1]   # the step after the Transpose
    with torch.no_grad():
        args = [torch.from_numpy(feeds[n]) for n in graph.inputs]
        torch.testing.assert_close(graph.unfused(*args)[0], graph(*args)[0], atol=1e-5, rtol=1e-5)
    w = rng.standard_normal((16, 24)).astype(np.float32)
    linear = model_of([helper.make_node("MatMul", ["x", "w"], ["y"])], {"x": [2, 16]}, {"y": [2, 24]}, {"w": w})
    assert not TorchGraph(linear, "cpu").plain_steps


@settings(max_examples=25, deadline=None)
@given(heads=st.integers(1, 4), length=st.integers(1, 9), keys=st.integers(1, 30), mask=st.sampled_from(
    ["none", "full", "column", "bool"]), alignment=st.sampled_from([4, 8]))
def test_keys_padded_to_an_aligned_count_attend_as_before(heads, length, keys, mask, alignment):
    """aligned_keys (the compiled as-ops form's attention on a GPU): the keys' count a multiple of the
    alignment, the added keys zero and -inf in the mask, the attention the same; an aligned count and a
    boolean mask are left as they are."""
    from shard.runtime.executors.torch_fusions import aligned_keys, plain

    g = torch.Generator().manual_seed(keys * 31 + length)
    q, kt, v = (torch.randn(1, heads, length, 8, generator=g), torch.randn(1, heads, 8, keys, generator=g),
                torch.randn(1, heads, keys, 4, generator=g))
    m = {"none": None, "full": torch.where(torch.rand(length, keys, generator=g) < 0.3, -1e4, 0.0),
         "column": torch.zeros(length, 1), "bool": torch.rand(length, keys, generator=g) < 0.7}[mask]
    got = aligned_keys(q, kt, v, m, alignment)
    if mask == "bool" or keys % alignment == 0:
        assert all(a is b for a, b in zip(got, (q, kt, v, m)))
        return
    padded = keys + -keys % alignment
    assert got[1].shape[-1] == got[2].shape[-2] == got[3].shape[-1] == padded
    assert torch.equal(got[1][..., :keys], kt) and not got[1][..., keys:].any() and not got[2][..., keys:, :].any()
    assert torch.isneginf(got[3][..., keys:]).all()
    torch.testing.assert_close(plain(*got, 0.3), plain(q, kt, v, m, 0.3), atol=1e-5, rtol=1e-5)


def test_the_as_ops_form_leaves_the_keys_as_they_are_on_the_cpu(monkeypatch):
    """The as-ops form of a fused attention over 6 keys: on the CPU the keys stay 6 (the padding is
    for cuBLAS's aligned kernels; nothing on the CPU reads it)."""
    from shard.runtime.executors import torch_fusions

    model, inputs = attention_model(4, 4, 5, 6, 8, "Div", True)
    feeds = {n: torch.from_numpy(rng.standard_normal(s).astype(np.float32)) for n, s in inputs.items()}
    seen, real = [], torch_fusions.plain
    monkeypatch.setattr(torch_fusions, "plain", lambda q, kt, v, mask, scale: seen.append(kt.shape[-1])
                        or real(q, kt, v, mask, scale))
    graph = TorchGraph(model, "cpu")
    with torch.no_grad():
        graph.unfused(*[feeds[n] for n in graph.inputs])
    assert seen == [6]


def test_the_as_ops_form_of_an_exported_vit_s_attention_compiles():
    """An exported ViT's attention, kt a permute of four axes of the keys as projected ([1, keys, heads,
    dim] to [1, heads, dim, keys]), no mask: the as-ops form compiled (torch.compile on the CPU) gives
    onnxruntime's outputs; with the scale after the product, inductor's attention pattern failed on it."""
    heads, length, dim = 3, 5, 8
    nodes = [helper.make_node("Transpose", ["qi"], ["q"], perm=[0, 2, 1, 3]),
             helper.make_node("Transpose", ["ki"], ["kt"], perm=[0, 2, 3, 1]),
             helper.make_node("Transpose", ["vi"], ["v"], perm=[0, 2, 1, 3]),
             helper.make_node("MatMul", ["q", "kt"], ["s"]), helper.make_node("Mul", ["s", "c"], ["s2"]),
             helper.make_node("Softmax", ["s2"], ["p"], axis=-1), helper.make_node("MatMul", ["p", "v"], ["y"])]
    inputs = {n: [1, length, heads, dim] for n in ("qi", "ki", "vi")}
    model = model_of(nodes, inputs, {"y": [1, heads, length, dim]}, {"c": np.array(dim ** -0.5, np.float32)})
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in inputs.items()}
    graph = fused_and_checked(model, feeds)
    assert graph.fused == {"attention": 1} and graph.plain_steps
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(graph.unfused, dynamic=False)(*[torch.from_numpy(feeds[n]) for n in graph.inputs])
    np.testing.assert_allclose(got[0].numpy(), run_ort(model, feeds, optimize=False)[0], atol=1e-4, rtol=1e-4)


def test_attention_whose_probabilities_are_an_output_is_not_fused():
    model, inputs = attention_model(2, 2, 5, 6, 8, "Mul", False, probs_out=True)
    graph = fused_and_checked(model, {n: rng.standard_normal(s).astype(np.float32) for n, s in inputs.items()})
    assert not graph.fused


def test_attention_over_one_shared_key_head_broadcasts():
    """Grouped keys broadcast by MatMul (one key head for four query heads): sdpa does not broadcast heads,
    the fused step computes it the plain way."""
    model, inputs = attention_model(4, 1, 5, 6, 8, "Mul", True)
    graph = fused_and_checked(model, {n: rng.standard_normal(s).astype(np.float32) for n, s in inputs.items()})
    assert graph.fused == {"attention": 1}


def repeated_heads_model(heads: int, kv_heads: int, length: int, keys: int, dim: int, mask: bool, repeat: str,
                         read_elsewhere: bool = False) -> tuple[onnx.ModelProto, dict]:
    """Attention whose keys and values have one head for every heads // kv_heads query heads, repeated as
    torch's repeat_interleave exports it (Unsqueeze at axis 2, Tile or Expand, Reshape), shapes inferred
    as a compiled stage records them. `read_elsewhere`: the repeated values are an output too."""
    groups = heads // kv_heads
    wide = {"tile": [1, 1, groups, 1, 1], "expand": [1, kv_heads, groups, keys, dim], "expand ones": [1, 1, groups, 1, 1]}
    nodes = []
    for x in ("k", "v"):
        nodes += [helper.make_node("Unsqueeze", [x, "axis"], [f"{x}1"]),
                  helper.make_node("Tile" if repeat == "tile" else "Expand", [f"{x}1", "wide"], [f"{x}2"]),
                  helper.make_node("Reshape", [f"{x}2", "merged"], [f"{x}r"])]
    nodes += [helper.make_node("Transpose", ["kr"], ["kt"], perm=[0, 1, 3, 2]),
              helper.make_node("MatMul", ["q", "kt"], ["s"]), helper.make_node("Mul", ["s", "c"], ["s2"])]
    if mask:
        nodes.append(helper.make_node("Add", ["s2", "m"], ["s3"]))
    nodes += [helper.make_node("Softmax", ["s3" if mask else "s2"], ["p"], axis=-1),
              helper.make_node("MatMul", ["p", "vr"], ["y"])]
    inputs = {"q": [1, heads, length, dim], "k": [1, kv_heads, keys, dim], "v": [1, kv_heads, keys, dim],
              **({"m": [length, keys]} if mask else {})}
    outputs = {"y": [1, heads, length, dim], **({"vr": [1, heads, keys, dim]} if read_elsewhere else {})}
    inits = {"axis": np.array([2], np.int64), "wide": np.array(wide[repeat], np.int64),
             "merged": np.array([1, heads, keys, dim], np.int64), "c": np.array(dim ** -0.5, np.float32)}
    return onnx.shape_inference.infer_shapes(model_of(nodes, inputs, outputs, inits)), inputs


@settings(max_examples=25, deadline=None)
@given(kv_heads=st.integers(1, 2), groups=st.sampled_from([2, 4, 8]), length=st.integers(1, 9),
       keys=st.integers(1, 30), mask=st.booleans(), repeat=st.sampled_from(["tile", "expand", "expand ones"]))
def test_key_heads_repeated_for_their_query_heads_are_read_once(kv_heads, groups, length, keys, mask, repeat):
    """A key and value head repeated for its query heads (Pi0's step, a GQA decoder): the attention is one
    step reading the heads as they were before the repeat, its eager form and its as-ops form (each key
    head's query heads in one product, on a GPU with the keys padded to 8) onnxruntime's attention."""
    from shard.runtime.executors.torch_fusions import aligned_keys, grouped, plain

    model, inputs = repeated_heads_model(kv_heads * groups, kv_heads, length, keys, 8, mask, repeat)
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in inputs.items()}
    if mask:
        feeds["m"] = np.where(rng.random(inputs["m"]) < 0.3, -1e4, 0.0).astype(np.float32)
    graph = fused_and_checked(model, feeds)
    assert graph.fused == {"attention": 1} and len(graph.steps) == 1
    assert graph.steps[0][1][:3] == ["q", "k", "v"]   # the heads before their repeat
    args = {n: torch.from_numpy(f) for n, f in feeds.items()}
    want = run_ort(model, feeds, optimize=False)[0]
    with torch.no_grad():
        np.testing.assert_allclose(graph.unfused(*[args[n] for n in graph.inputs])[0].numpy(), want,
                                   atol=1e-4, rtol=1e-4)
        kt, m = args["k"].transpose(-1, -2), args.get("m")
        padded = grouped(*aligned_keys(args["q"], kt, args["v"], m), 8 ** -0.5, groups)
        repeated = plain(args["q"], kt.repeat_interleave(groups, 1), args["v"].repeat_interleave(groups, 1), m,
                         8 ** -0.5)
    np.testing.assert_allclose(padded.numpy(), want, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(repeated.numpy(), want, atol=1e-4, rtol=1e-4)


def test_repeated_heads_read_elsewhere_stay_repeated():
    """The repeated values are an output of the stage too: the attention reads them as repeated."""
    model, inputs = repeated_heads_model(4, 1, 5, 6, 8, True, "tile", read_elsewhere=True)
    graph = fused_and_checked(model, {n: rng.standard_normal(s).astype(np.float32) for n, s in inputs.items()})
    assert graph.fused == {"attention": 1}
    attention = next(ins for fn, ins, outs in graph.steps if outs == ["y"])
    assert attention[1:3] == ["kt", "vr"]


def test_linear_with_its_bias():
    w, b = rng.standard_normal((16, 24)).astype(np.float32), rng.standard_normal(24).astype(np.float32)
    model = model_of([helper.make_node("MatMul", ["x", "w"], ["t"]), helper.make_node("Add", ["b", "t"], ["y"])],
                     {"x": [2, 5, 16]}, {"y": [2, 5, 24]}, {"w": w, "b": b})
    graph = fused_and_checked(model, {"x": rng.standard_normal((2, 5, 16)).astype(np.float32)})
    assert graph.fused == {"linear": 1} and len(graph.steps) == 1
    assert "w" not in graph.values   # the weight is held once, in the fused step's layout


def test_sibling_linears_of_one_activation_run_as_one_product():
    # q, k and v of one x (k with its bias), each read before the next sibling in the stage's order (as
    # an exporter writes a decoder's projections): one product, the step in the first one's place.
    w = {n: rng.standard_normal((16, width)).astype(np.float32) for n, width in (("wq", 8), ("wk", 12), ("wv", 8))}
    nodes = [helper.make_node("MatMul", ["x", "wq"], ["q"]), helper.make_node("Relu", ["q"], ["qr"]),
             helper.make_node("MatMul", ["x", "wk"], ["k0"]), helper.make_node("Add", ["k0", "bk"], ["k"]),
             helper.make_node("Sigmoid", ["k"], ["ks"]),
             helper.make_node("MatMul", ["x", "wv"], ["v"]), helper.make_node("Neg", ["x"], ["y"])]
    model = model_of(nodes, {"x": [2, 5, 16]}, {"qr": [2, 5, 8], "ks": [2, 5, 12], "v": [2, 5, 8], "y": [2, 5, 16]},
                     {**w, "bk": rng.standard_normal(12).astype(np.float32)})
    graph = fused_and_checked(model, {"x": rng.standard_normal((2, 5, 16)).astype(np.float32)})
    assert graph.fused == {"linears": 1}
    assert [(ins, outs) for _, ins, outs in graph.steps] == [(["x"], ["q", "k", "v"]), (["q"], ["qr"]), (["k"], ["ks"]),
                                                             (["x"], ["y"])]
    assert [len(nodes) for nodes in graph.covers] == [4, 1, 1, 1]   # 3 MatMuls and k's bias Add in the first
    assert not {"wq", "wk", "wv", "bk"} & set(graph.values)   # held once, side by side


@settings(max_examples=20, deadline=None)
@given(widths=st.lists(st.integers(1, 24), min_size=2, max_size=4), biased=st.lists(st.booleans(), min_size=4, max_size=4),
       read_between=st.booleans())
def test_sibling_linears_of_any_widths_and_biases_compute_what_they_replace(widths, biased, read_between):
    nodes, inits, outputs = [], {}, {}
    for k, width in enumerate(widths):
        inits[f"w{k}"] = rng.standard_normal((8, width)).astype(np.float32)
        product = f"m{k}" if biased[k] else f"y{k}"
        nodes.append(helper.make_node("MatMul", ["x", f"w{k}"], [product]))
        if biased[k]:
            inits[f"b{k}"] = rng.standard_normal(width).astype(np.float32)
            nodes.append(helper.make_node("Add", [product, f"b{k}"], [f"y{k}"]))
        if read_between:   # each sibling's reader before the next sibling
            nodes.append(helper.make_node("Tanh", [f"y{k}"], [f"t{k}"]))
        outputs[f"t{k}" if read_between else f"y{k}"] = [3, width]
    graph = fused_and_checked(model_of(nodes, {"x": [3, 8]}, outputs, inits),
                              {"x": rng.standard_normal((3, 8)).astype(np.float32)})
    assert graph.fused == {"linears": 1} and len(graph.covers[0]) == len(widths) + sum(biased[:len(widths)])


def test_one_linear_of_an_activation_stays_alone():
    model = model_of([helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("MatMul", ["x", "x2"], ["z"])],
                     {"x": [4, 4], "x2": [4, 4]}, {"y": [4, 6], "z": [4, 4]},
                     {"w": rng.standard_normal((4, 6)).astype(np.float32)})
    graph = fused_and_checked(model, {n: rng.standard_normal((4, 4)).astype(np.float32) for n in ("x", "x2")})
    assert graph.fused == {}


def fp8_linear_model(bias: bool, width: int = 48, whole: bool = False) -> onnx.ModelProto:
    """x (fp16) through QuantizeLinear/DequantizeLinear to E4M3 at one scale, times an E4M3 weight
    dequantized per output column (or with one scale, `whole`), plus a bias: the forms fp8_linears
    writes."""
    import ml_dtypes

    w = rng.standard_normal((32, width)).astype(np.float32)
    scales = (np.abs(w).max() if whole else np.abs(w).max(0)) / np.float32(448)
    scales = np.asarray(scales).astype(np.float16)
    fp8 = lambda name, v: numpy_helper.from_array(v.astype(ml_dtypes.float8_e4m3fn), name)  # noqa: E731
    inits = [fp8("w8", w / scales.astype(np.float32)), numpy_helper.from_array(scales, "ws"), fp8("z", np.zeros(())),
             numpy_helper.from_array(np.array(3.0 / 448, np.float16), "xs"),
             numpy_helper.from_array(rng.standard_normal(width).astype(np.float16), "b")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "z"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "xs"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w8", "ws"], ["wd"], axis=1),
             helper.make_node("MatMul", ["xd", "wd"], ["t" if bias else "y"])]
    nodes += [helper.make_node("Add", ["t", "b"], ["y"])] if bias else []
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 5, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, 5, width])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    return onnx.shape_inference.infer_shapes(model)


@pytest.mark.parametrize("bias, whole", [(True, False), (False, False), (True, True), (False, True)])
def test_an_fp8_linear_runs_as_one_scaled_product(bias, whole):
    from shard.runtime.executors import torch_fusions

    model = fp8_linear_model(bias, whole=whole)
    x = rng.uniform(-3, 3, (2, 5, 32)).astype(np.float16)
    want = run_ort(model, {"x": x}, optimize=False)[0].astype(np.float32)
    graph = TorchGraph(model, "cpu")
    assert graph.fused == {"fp8_linear": 1} and len(graph.steps) == 2   # the quantize, then one product
    assert not {"w8", "wd", "xd"} & set(graph.values)   # the weight kept once, in the product's layout
    unfused = TorchGraph(model, "cpu", fuse=False)
    with torch.no_grad():
        got = graph(torch.from_numpy(x))[0].float().numpy()
        plain = unfused(torch.from_numpy(x))[0].float().numpy()
    # the ONNX form rounds the dequantized weight to fp16 before its product; the fused one does not
    np.testing.assert_allclose(got, want, atol=0.05, rtol=0.01)
    np.testing.assert_allclose(plain, want, atol=0.05, rtol=0.01)
    # one scale for the whole weight and the rest after the product: the form for torch builds without
    # a scale per row and column in fp16
    w8, ws = (torch.from_numpy(numpy_helper.to_array(t).astype(np.float32)) for t in model.graph.initializer[:2])
    bias_values = torch.from_numpy(numpy_helper.to_array(model.graph.initializer[4])) if bias else None
    scale = float(np.float16(3.0 / 448))
    q = (torch.from_numpy(x).float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    for rows in (10, None):   # with one weight scale, the rows are not needed
        run = torch_fusions.scaled_product(w8.to(torch.float8_e4m3fn), ws.reshape(1, -1), scale, bias_values, rows)
        np.testing.assert_allclose(run(q).float().numpy(), got, atol=2e-2, rtol=2e-3)


def elementwise(kind: str):
    """GELU (erf and tanh forms) and SiLU as exporters spell them."""
    c = lambda name, v: helper.make_node("Constant", [], [name], value=onnx.numpy_helper.from_array(np.array(v, np.float32)))  # noqa: E731
    n = helper.make_node
    if kind == "gelu":
        return [c("r2", math.sqrt(2)), c("one", 1.0), c("half", 0.5), n("Div", ["x", "r2"], ["a"]), n("Erf", ["a"], ["e"]),
                n("Add", ["e", "one"], ["f"]), n("Mul", ["x", "f"], ["g"]), n("Mul", ["g", "half"], ["y"])]
    if kind == "gelu_tanh":
        return [c("k", 0.044715), c("s", math.sqrt(2 / math.pi)), c("one", 1.0), c("half", 0.5), c("three", 3.0),
                n("Pow", ["x", "three"], ["p"]), n("Mul", ["k", "p"], ["kp"]), n("Add", ["x", "kp"], ["a"]),
                n("Mul", ["a", "s"], ["b"]), n("Tanh", ["b"], ["t"]), n("Add", ["one", "t"], ["u"]),
                n("Mul", ["half", "x"], ["h"]), n("Mul", ["h", "u"], ["y"])]
    if kind == "silu":
        return [n("Sigmoid", ["x"], ["s"]), n("Mul", ["x", "s"], ["y"])]
    return [n("Tanh", ["x"], ["t"]), n("Mul", ["x", "t"], ["y"])]   # x tanh(x): no torch function


@pytest.mark.parametrize("kind", ["gelu", "gelu_tanh", "silu", "x_tanh_x"])
def test_an_elementwise_function_is_known_by_its_values(kind):
    model = model_of(elementwise(kind), {"x": [3, 40]}, {"y": [3, 40]})
    graph = fused_and_checked(model, {"x": (4 * rng.standard_normal((3, 40))).astype(np.float32)})
    assert graph.fused == ({kind: 1} if kind != "x_tanh_x" else {})
    if kind != "x_tanh_x":
        assert len(graph.steps) == 1


def test_a_function_whose_inner_value_is_used_elsewhere_stays_unfused():
    nodes = elementwise("silu") + [helper.make_node("Add", ["s", "y"], ["z"])]   # the sigmoid read twice
    model = model_of(nodes, {"x": [3, 8]}, {"z": [3, 8]})
    graph = fused_and_checked(model, {"x": rng.standard_normal((3, 8)).astype(np.float32)})
    assert not graph.fused


def test_a_transformer_block_in_fp16_fuses_every_run():
    """A stage as the GPU pipeline writes it (a zoo encoder's two layers, strongly typed fp16): every
    attention, linear and GELU fused, the output as the unfused stage's to fp16 rounding."""
    from shard.compilation import compile_model
    from shard.options import CompileOptions
    from shard.zoo import export_model

    with tempfile.TemporaryDirectory() as tmp:
        model = export_model("siglip-base-512", Path(tmp) / "s.onnx", layers=2, image_size=64)
        result = compile_model(model, "thor", Path(tmp) / "s.shard", CompileOptions(shards=1))
        stage = onnx.load(str(result.bundle / result.manifest.shards[0].onnx))
    x = torch.from_numpy(rng.standard_normal((1, 3, 64, 64)).astype(np.float32))
    fused, plain = TorchGraph(stage, "cpu"), TorchGraph(stage, "cpu", fuse=False)
    assert fused.fused == {"attention": 2, "linears": 2, "linear": 6, "gelu_tanh": 2}   # q, k, v: one product
    with torch.no_grad():
        a, b = fused(x)[0].float(), plain(x)[0].float()
    assert float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)) > 0.9999


def test_attention_with_a_constant_causal_mask_is_fused():
    model, inputs = attention_model(2, 2, 6, 6, 8, "Mul", True)
    causal = np.triu(np.full((6, 6), -1e4, np.float32), 1)[None, None]
    graph_inputs = [i for i in model.graph.input if i.name != "m"]
    del model.graph.input[:]
    model.graph.input.extend(graph_inputs)
    model.graph.initializer.append(numpy_helper.from_array(causal, "m"))
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in inputs.items() if n != "m"}
    graph = fused_and_checked(model, feeds)
    assert graph.fused == {"attention": 1}
