"""The real-model corpus: models nobody on the team wrote, shard and the vendor alone side by side.

    python bench/corpus.py [--set all|onnx|transformers|packaged|ci] [--only NAME,...] [--json FILE] [--jobs 2]
                           [--target rk3588|rk3576|...] [--ray ADDRESS|local [--ray-cpus N]]

Models run one after another, each compile's builds --jobs at a time. With --ray, each model is a Ray
task of one CPU (its builds one at a time, on the node that runs it), retried where its worker dies,
as many at once as the cluster has CPUs (`local`: a cluster started here with --ray-cpus), rows
printed as they finish and the RESULT line over all of them.

Models: the onnx package's own backend test data (`pytorch-converted`, `pytorch-operator`: each a
conformance case for one PyTorch module or op, most at opset 6; and `simple`), small graphs that
reproduce what real exported models did to shard (REPRODUCERS below), transformer architectures
built offline by `transformers` from their configs (bench/architectures.py), and trained models
shipped as ONNX inside packages of the index (PACKAGED below: PP-OCR's detector, recogniser and
classifier from rapidocr-onnxruntime, fetched with `pip download`), and trained transformers exported
from packages of the index with their real inputs (TRAINED below: SmolLM2-135M-Instruct's chat forward,
all-mpnet-base-v2's and all-MiniLM-L6-v2's sentence embeddings; `--set trained` is these and PP-OCR).
For each model:
  shard:  `shard compile --check-fidelity --vendor-alone whole --allow-low-fidelity` (which builds the
          model as it came with the vendor alone beside it, on any machine, keeps the vendor's build
          where shard's would be worse, and writes a bundle under the fidelity floor all the same, so
          its cosine is shown) and `shard verify` on the simulator;
  vendor: the same compile's build of the model as it came (what `--vendor-only` bundles) and its
          simulator run beside shard's, the same seeded inputs; where the compile stopped before
          that build, `--vendor-only` on its own.
Clean: it builds, 0 REGTASK lines, 0 ops on the CPU inside the rknn graphs, simulator cosine
>= 0.9999. Worse: shard's build figures are worse than the vendor's (shard.never_worse.AXES, in
order), or its cosine is more than 1e-4 under the vendor's; better the other way round. A model shard
cannot take must end in one ShardError line; a Python traceback is counted apart (`tracebacks`), the
summary `shard compile` prints included (each compile's is printed, and thrown away).

Ends with: RESULT target=T models=N shard_clean=A vendor_clean=B better=C worse=D cpu_ops_shard=E cpu_ops_vendor=F
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

MIN_COSINE = 0.9999
ONNX_DATA = Path(onnx.__file__).parent / "backend" / "test" / "data"
# A fast subset over different families, for CI: old opset, Conv1d, pooling, embedding (int64 input), split,
# transpose, reduction, pixel shuffle, a linear on a 2-D input, ops the vendor puts on the CPU (Selu on a 3-D
# tensor, Tile), the reproducers, a small BERT (embeddings and the attention mask on the host) and a decoder
# layer with one key/value head (repeat_kv's Expand).
CI = ["test_Conv2d", "test_Conv1d", "test_MaxPool2d", "test_Embedding", "test_operator_chunk", "test_operator_permute2",
      "test_operator_reduced_mean", "test_PixelShuffle", "test_Linear", "test_SELU", "test_operator_repeat", "head40",
      "bool_mask", "embed_linear", "bert-tiny", "fused_qkv", "two_heads", "rate_switch", "euler_loop",
      "eos_pool", "float_mask", "value_pad", "yolo_head", "qwen2-mqa", "sequence_row", "clip-text"]


@dataclass
class Side:
    """One way of compiling a model: what its builds said and how it matched onnxruntime."""

    error: str | None = None          # a ShardError's line
    traceback: str | None = None      # anything else: a bug
    builds: bool = False
    regtask: int = 0
    cpu_ops: int = 0
    single_core: int = 0
    mcycles: float = 0.0
    cosine: float | None = None
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)
    rules: list[str] = field(default_factory=list)   # the vendor rules shard turned off after they crashed

    @property
    def clean(self) -> bool:
        return self.builds and self.regtask == 0 and self.cpu_ops == 0 and (self.cosine or 0) >= MIN_COSINE


@dataclass
class Row:
    name: str
    family: str
    shard: Side
    vendor: Side
    verdict: str = "equal"


def onnx_models(folders: list[str]) -> list[tuple[str, str, Path]]:
    """Each case of the onnx package's test data folders: a folder holding model.onnx, or (in `light`,
    the model zoo's classic networks as Caffe2 exported them, weights made by ConstantOfShape) a file."""
    return [(d.name, folder, d / "model.onnx") if d.is_dir() else (d.stem, folder, d) for folder in folders
            for d in sorted((ONNX_DATA / folder).iterdir()) if (d / "model.onnx").exists() or d.suffix == ".onnx"]


def head40(path: Path) -> Path:
    """A detection-head shape from a real model: Add and Softmax on [1,40,6625] log `E RKNN` when
    built alone, and build clean inside the model; split, they put Reshape joins on the CPU."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((64, 6625)) / 8).astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal(6625).astype(np.float32), "b"),
             numpy_helper.from_array((rng.standard_normal((6625, 64)) / 80).astype(np.float32), "W2")]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="fc"),
             helper.make_node("Add", ["h", "b"], ["hb"], name="bias"),
             helper.make_node("Softmax", ["hb"], ["p"], axis=-1, name="softmax"),
             helper.make_node("MatMul", ["p", "W2"], ["y"], name="fc2")]
    return save(path, nodes, [("x", [1, 40, 64])], [("y", [1, 40, 64])], inits)


def bool_mask(path: Path) -> Path:
    """A BERT-style additive mask from integer ids: Cast to bool, Not, Where; then a float op."""
    nodes = [helper.make_node("Cast", ["ids"], ["m"], to=onnx.TensorProto.BOOL, name="to_bool"),
             helper.make_node("Not", ["m"], ["pad"], name="not"),
             helper.make_node("Where", ["pad", "neg", "zero"], ["bias"], name="where"),
             helper.make_node("Add", ["x", "bias"], ["y"], name="add_mask")]
    inits = [numpy_helper.from_array(np.array(-30.0, np.float32), "neg"),
             numpy_helper.from_array(np.array(0.0, np.float32), "zero")]
    graph = helper.make_graph(nodes, "mask", [helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [1, 1, 64]),
                                              helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 1, 64])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 1, 64])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def save(path: Path, nodes, inputs, outputs, inits) -> Path:
    vi = lambda n, s: helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, s)  # noqa: E731
    model = helper.make_model(helper.make_graph(nodes, path.stem, [vi(*i) for i in inputs],
                                                [vi(*o) for o in outputs], inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def embed_linear(path: Path) -> Path:
    """Token ids into an embedding table, then a linear: the vendor runs the Gather on the CPU."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((1000, 64)).astype(np.float32), "table"),
             numpy_helper.from_array((rng.standard_normal((64, 64)) / 8).astype(np.float32), "w")]
    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"], name="embed"),
             helper.make_node("MatMul", ["e", "w"], ["y"], name="fc")]
    graph = helper.make_graph(nodes, "embed", [helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [1, 16])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 16, 64])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def fused_qkv(path: Path, tokens: int = 16, width: int = 64, heads: int = 4) -> Path:
    """One projection to q, k and v with a zero bias added before it (Add(bias, product)), Reshape
    [1, N, 3, heads, hd], Transpose, Split: the vendor's `seperate_exmatmul_rs_split` crashes on it
    ("cannot reshape array of size 1 into shape (1,newaxis,3,1,1)": it shrinks the zeros to one)."""
    hd = width // heads
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((width, 3 * width)) / 8).astype(np.float32), "W"),
             numpy_helper.from_array(np.zeros(3 * width, np.float32), "b"),
             numpy_helper.from_array(np.array([1, tokens, 3, heads, hd], np.int64), "shape"),
             numpy_helper.from_array(np.array([1, tokens, width], np.int64), "back"),
             numpy_helper.from_array(np.array([0], np.int64), "first")]
    n = helper.make_node
    nodes = [n("MatMul", ["x", "W"], ["h"], name="qkv"), n("Add", ["b", "h"], ["hb"], name="qkv_bias"),
             n("Reshape", ["hb", "shape"], ["r"], name="split_heads"),
             n("Transpose", ["r"], ["t"], perm=[2, 0, 3, 1, 4], name="heads_first"),
             n("Split", ["t"], ["q5", "k5", "v5"], axis=0, name="qkv_split"),
             *[n("Squeeze", [f"{x}5", "first"], [x], name=f"squeeze_{x}") for x in "qkv"],
             n("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2], name="keys"), n("MatMul", ["q", "kt"], ["s"], name="scores"),
             n("Softmax", ["s"], ["p"], axis=-1, name="softmax"), n("MatMul", ["p", "v"], ["o"], name="context"),
             n("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3], name="merge"),
             n("Reshape", ["ot", "back"], ["y"], name="merge_heads")]
    return save(path, nodes, [("x", [1, tokens, width])], [("y", [1, tokens, width])], inits)


def two_heads(path: Path, width: int = 64, classes: int = 10) -> Path:
    """Two linear heads on one pooled vector, added and halved (a distilled classifier's head and its
    distillation head): the vendor's `fuse_conv_conv_add` crashes ("'NoneType' object is unsliceable")."""
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array((rng.standard_normal((classes, width)) / 8).astype(np.float32), "W1"),
             numpy_helper.from_array(rng.standard_normal(classes).astype(np.float32), "b1"),
             numpy_helper.from_array((rng.standard_normal((classes, width)) / 8).astype(np.float32), "W2"),
             numpy_helper.from_array(rng.standard_normal(classes).astype(np.float32), "b2"),
             numpy_helper.from_array(np.array(2.0, np.float32), "two")]
    nodes = [helper.make_node("GlobalAveragePool", ["x"], ["g"], name="pool"),
             helper.make_node("Flatten", ["g"], ["f"], axis=1, name="flatten"),
             helper.make_node("Gemm", ["f", "W1", "b1"], ["h1"], transB=1, name="head"),
             helper.make_node("Gemm", ["f", "W2", "b2"], ["h2"], transB=1, name="head_dist"),
             helper.make_node("Add", ["h1", "h2"], ["s"], name="sum"),
             helper.make_node("Div", ["s", "two"], ["y"], name="half")]
    return save(path, nodes, [("x", [1, width, 7, 7])], [("y", [1, classes])], inits)


def rate_switch(path: Path, width: int = 64) -> Path:
    """The whole body in a top-level If chosen by a scalar input (a voice-activity model's sample-rate
    switch): the vendor cannot build it; compiled with --input-value sr=16000 (INPUT_VALUES)."""
    def branch(name: str, seed: int) -> onnx.GraphProto:
        w = (np.random.default_rng(seed).standard_normal((width, width)) / 8).astype(np.float32)
        nodes = [helper.make_node("MatMul", ["x", f"{name}_w"], [f"{name}_h"], name=f"{name}_fc"),
                 helper.make_node("Relu", [f"{name}_h"], [f"{name}_y"], name=f"{name}_relu")]
        return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(f"{name}_y", onnx.TensorProto.FLOAT,
                                                                                 [1, width])],
                                 [numpy_helper.from_array(w, f"{name}_w")])
    nodes = [helper.make_node("Equal", ["sr", "k16"], ["is16"], name="rate"),
             helper.make_node("If", ["is16"], ["y"], then_branch=branch("at16k", 3), else_branch=branch("at8k", 4),
                              name="switch")]
    graph = helper.make_graph(nodes, "vad", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, width]),
                                             helper.make_tensor_value_info("sr", onnx.TensorProto.INT64, [])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, width])],
                              [numpy_helper.from_array(np.array(16000, np.int64), "k16")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def euler_loop(path: Path, steps: int = 8, width: int = 64, trips: str | None = None) -> Path:
    """A denoising loop as a Loop node: `steps` Euler steps x <- x + dt * v(x, t), the velocity a
    small MLP of x and the step's time (from the iteration number), its weights from the outer
    graph; the trajectory a scan output. The vendor cannot build a Loop. `trips`: the trip count as
    that graph input instead of a constant (a loop decided at run time)."""
    rng = np.random.default_rng(5)
    f = onnx.TensorProto.FLOAT
    body = helper.make_graph(
        [helper.make_node("Cast", ["k"], ["kf"], to=f, name="step_time"),
         helper.make_node("Mul", ["kf", "dt"], ["t"], name="time"),
         helper.make_node("MatMul", ["x_in", "w1"], ["a"], name="fc1"),
         helper.make_node("Mul", ["t", "tvec"], ["te"], name="time_embed"),
         helper.make_node("Add", ["a", "te"], ["b"], name="add_time"),
         helper.make_node("Tanh", ["b"], ["h"], name="act"),
         helper.make_node("MatMul", ["h", "w2"], ["v"], name="fc2"),
         helper.make_node("Mul", ["v", "dt"], ["dx"], name="scale"),
         helper.make_node("Add", ["x_in", "dx"], ["x_out"], name="euler"),
         helper.make_node("Identity", ["x_out"], ["x_seen"], name="trajectory"),
         helper.make_node("Identity", ["c_in"], ["c_out"], name="go_on")],
        "step", [helper.make_tensor_value_info("k", onnx.TensorProto.INT64, []),
                 helper.make_tensor_value_info("c_in", onnx.TensorProto.BOOL, []),
                 helper.make_tensor_value_info("x_in", f, [1, width])],
        [helper.make_tensor_value_info("c_out", onnx.TensorProto.BOOL, []),
         helper.make_tensor_value_info("x_out", f, [1, width]),
         helper.make_tensor_value_info("x_seen", f, [1, width])])
    inits = [numpy_helper.from_array((rng.standard_normal((width, width)) / 8).astype(np.float32), "w1"),
             numpy_helper.from_array((rng.standard_normal((width, width)) / 8).astype(np.float32), "w2"),
             numpy_helper.from_array(rng.standard_normal(width).astype(np.float32), "tvec"),
             numpy_helper.from_array(np.array(1.0 / steps, np.float32), "dt"),
             numpy_helper.from_array(np.array(True), "go")]
    inputs = [helper.make_tensor_value_info("x", f, [1, width])]
    if trips is None:
        inits.append(numpy_helper.from_array(np.array(steps, np.int64), "steps"))
    else:
        inputs.append(helper.make_tensor_value_info(trips, onnx.TensorProto.INT64, []))
    loop = helper.make_node("Loop", [trips or "steps", "go", "x"], ["y", "path"], body=body, name="denoise")
    graph = helper.make_graph([loop], "flow", inputs,
                              [helper.make_tensor_value_info("y", f, [1, width]),
                               helper.make_tensor_value_info("path", f, [steps, 1, width])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def eos_pool(path: Path, tokens: int = 16, width: int = 64) -> Path:
    """A text encoder's pooled output: the hidden state at the highest token id (CLIP's end token),
    ArgMax over the ids then Gather of that row; the vendor runs both (and a Reshape) on the CPU."""
    nodes = [helper.make_node("ArgMax", ["ids"], ["pos"], axis=1, keepdims=0, name="eos"),
             helper.make_node("Gather", ["h", "pos"], ["g"], axis=1, name="pick"),
             helper.make_node("Reshape", ["g", "shape"], ["y"], name="pooled")]
    graph = helper.make_graph(nodes, "pool", [helper.make_tensor_value_info("h", onnx.TensorProto.FLOAT, [1, tokens, width]),
                                              helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [1, tokens])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, width])],
                              [numpy_helper.from_array(np.array([1, width], np.int64), "shape")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def float_mask(path: Path, tokens: int = 16) -> Path:
    """A mask given as floats, Greater then Cast of the booleans to float, scaled into an additive
    bias: the vendor runs the Greater on the CPU."""
    nodes = [helper.make_node("Greater", ["m", "half"], ["b"], name="gt"),
             helper.make_node("Cast", ["b"], ["f"], to=onnx.TensorProto.FLOAT, name="to_float"),
             helper.make_node("Mul", ["f", "neg"], ["bias"], name="scale"),
             helper.make_node("Add", ["x", "bias"], ["y"], name="add_mask")]
    inits = [numpy_helper.from_array(np.array(0.5, np.float32), "half"),
             numpy_helper.from_array(np.array(-1e4, np.float32), "neg")]
    return save(path, nodes, [("x", [1, 1, tokens, tokens]), ("m", [1, 1, tokens, tokens])],
                [("y", [1, 1, tokens, tokens])], inits)


def value_pad(path: Path, tokens: int = 49, width: int = 96) -> Path:
    """Two slots of 1.0 appended to a token sequence, then a linear: the vendor runs the Pad on the CPU
    (toolkit 2.5.0: "Pad: mode constant unsupport pads[5] = 2")."""
    inits = [numpy_helper.from_array(np.array([0, 0, 0, 0, 2, 0], np.int64), "pads"),
             numpy_helper.from_array(np.array(1.0, np.float32), "one"),
             numpy_helper.from_array((np.random.default_rng(0).standard_normal((width, 64)) / 8).astype(np.float32), "w")]
    nodes = [helper.make_node("Pad", ["x", "pads", "one"], ["p"], mode="constant", name="slots"),
             helper.make_node("MatMul", ["p", "w"], ["y"], name="fc")]
    return save(path, nodes, [("x", [1, tokens, width])], [("y", [1, tokens + 2, 64])], inits)


def yolo_head(path: Path, anchors: int = 3, classes: int = 85, side: int = 20, width: int = 64) -> Path:
    """A detection head: 1x1 Conv, view [1, A, C, H, W], channels last, Reshape [1, A*H*W, C]; the
    vendor runs a Reshape of it on the CPU at 20 x 20."""
    inits = [numpy_helper.from_array((np.random.default_rng(0).standard_normal((anchors * classes, width, 1, 1)) / 8)
                                     .astype(np.float32), "w"),
             numpy_helper.from_array(np.array([1, anchors, classes, side, side], np.int64), "five"),
             numpy_helper.from_array(np.array([1, side * side * anchors, classes], np.int64), "rows")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["o"], kernel_shape=[1, 1], name="head"),
             helper.make_node("Reshape", ["o", "five"], ["r"], name="per_anchor"),
             helper.make_node("Transpose", ["r"], ["t"], perm=[0, 1, 3, 4, 2], name="channels_last"),
             helper.make_node("Reshape", ["t", "rows"], ["y"], name="boxes")]
    return save(path, nodes, [("x", [1, width, side, side])], [("y", [1, side * side * anchors, classes])], inits)


def sequence_row(path: Path) -> Path:
    """Row 0 of a [20, 1, 4096] sequence input (Gather 0, axis 0): the vendor logs 15 REGTASK lines."""
    from shard.probes.families import rows

    onnx.save(rows("Gather")(20, {"axis": 0, "w": 4096}), path)
    return path


def two_lstms(path: Path, steps: int = 20, width: int = 4096, hidden: int = 256) -> Path:
    """Two LSTM layers unrolled over 20 steps of a [20, 1, 4096] sequence as torch exports them (the
    input projection of all steps at once, then per step its row, the recurrent product, the gates),
    seeded weights: the vendor logs REGTASK lines on the sequence input."""
    import torch

    class Unrolled(torch.nn.Module):
        def __init__(self, inp: int):
            super().__init__()
            self.ih, self.hh = torch.nn.Linear(inp, 4 * hidden), torch.nn.Linear(hidden, 4 * hidden, bias=False)

        def forward(self, x):
            gates, h, c, out = self.ih(x), x.new_zeros(1, hidden), x.new_zeros(1, hidden), []
            for t in range(steps):
                i, f, g, o = (gates[t] + self.hh(h)).chunk(4, dim=-1)
                c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                h = torch.sigmoid(o) * torch.tanh(c)
                out.append(h)
            return torch.stack(out)

    torch.manual_seed(0)
    model = torch.nn.Sequential(Unrolled(width), Unrolled(hidden)).eval()
    torch.onnx.export(model, (torch.randn(steps, 1, width),), str(path), opset_version=17, input_names=["x"],
                      output_names=["y"], dynamo=False)
    return path


# Inputs a model is compiled with fixed (--input-value): what its control flow chooses by.
INPUT_VALUES = {"rate_switch": {"sr": [16000]}}

REPRODUCERS = {"head40": head40, "bool_mask": bool_mask, "embed_linear": embed_linear, "fused_qkv": fused_qkv,
               "two_heads": two_heads, "rate_switch": rate_switch, "euler_loop": euler_loop, "eos_pool": eos_pool, "float_mask": float_mask,
               "value_pad": value_pad, "yolo_head": yolo_head, "sequence_row": sequence_row, "two_lstms": two_lstms}


def side(work: Path, model: Path, options, target: str = "rk3588") -> Side:
    """Compile `model` with `options`; its simulator cosine from the compile's fidelity check where it
    made one, else from `shard verify`."""
    import shard
    from shard.compare import worst_of
    from shard.errors import ShardError

    result, started = Side(), time.monotonic()
    try:
        compiled = shard.compile(model, target, work / "bundle.shard", options)
        summary(compiled)
        totals = compiled.report["totals"]
        result.builds, result.regtask = True, totals["overflow_lines"]
        result.cpu_ops, result.single_core = totals["cpu_ops"], totals["fallbacks"]
        result.mcycles = totals["estimated_cycles"] / 1e6
        result.rules = sorted({r for s in compiled.report["shards"] for r in s["diagnostics"].get("disabled_rules", [])})
        result.figures = compiled.report.get("versus_vendor") or {}
        fidelity = result.figures.get("fidelity")
        if fidelity:
            result.cosine = fidelity["vendor" if result.figures["bundle"] == "vendor alone" else "shard"]
        else:
            report = shard.verify(compiled.bundle, model, backend="sim", min_cosine=MIN_COSINE)
            result.cosine = worst_of(report.outputs).cosine
    except ShardError as exc:
        result.error = str(exc).splitlines()[0]
    except Exception:  # noqa: BLE001 - a bug: kept, counted, and the corpus goes on
        result.traceback = traceback.format_exc()
    result.seconds = round(time.monotonic() - started, 1)
    return result


def summary(compiled) -> None:
    """The summary `shard compile` prints, printed where nothing shows it: a printer that fails on a
    report (a CLIP text encoder's ended in KeyError: 'action') counts as a traceback."""
    from shard.cli.common import console
    from shard.cli.compile import print_compile_result

    with console.capture():
        print_compile_result(compiled)


def vendor_side(ours: Side) -> Side:
    """The vendor alone, as shard's compile built it beside its own shards (the same build that
    `--vendor-only` makes) and, with --check-fidelity, ran it on the simulator."""
    versus = ours.figures
    v = versus["vendor"]
    fidelity = versus.get("fidelity") or {}
    cosine = fidelity.get("vendor", ours.cosine if versus["bundle"] == "vendor alone" else None)
    return Side(builds=v["builds"], regtask=v["overflow_lines"], cpu_ops=v["cpu_ops"],
                single_core=v["fallbacks"], mcycles=v["estimated_cycles"] / 1e6,
                cosine=cosine if v["builds"] else None, error=None if v["builds"] else "the vendor build failed")


def judge(ours: Side, theirs: Side) -> str:
    from shard.never_worse import AXES, Figures, fidelity_worse, verdict

    if ours.figures.get("shard") and ours.figures.get("vendor"):   # on the axes the compile judged by
        by_build = verdict(Figures(**ours.figures["shard"]), Figures(**ours.figures["vendor"]),
                           tuple(ours.figures.get("judged_on", AXES)))
    else:
        by_build = "equal" if ours.builds == theirs.builds else "better" if ours.builds else "worse"
    if by_build != "equal":
        return by_build
    if ours.cosine is not None and theirs.cosine is not None:
        if fidelity_worse(ours.cosine, theirs.cosine):
            return "worse"
        if fidelity_worse(theirs.cosine, ours.cosine):
            return "better"
    return "equal"


def evaluate(name: str, family: str, model: Path, jobs: int = 2, target: str = "rk3588") -> Row:
    from shard.options import CompileOptions

    shapes = PACKAGED[name][2] if name in PACKAGED else {}
    values = INPUT_VALUES.get(name, {})
    calib = model.with_suffix(".calib.npz")
    calib = str(calib) if calib.is_file() else None   # a trained model's real samples
    with tempfile.TemporaryDirectory(prefix=f"corpus-{name}-") as work:
        work = Path(work)
        (work / "shard").mkdir()
        (work / "vendor").mkdir()
        # Under the fidelity floor the bundle is written all the same: the row shows its cosine.
        ours = side(work / "shard", model, CompileOptions(jobs=jobs, check_fidelity=True, vendor_alone="whole",
                                                          input_shapes=shapes, input_values=values, calib=calib,
                                                          allow_low_fidelity=True), target)
        # Where shard's compile ended before building the vendor alone, the vendor alone on its own.
        theirs = vendor_side(ours) if ours.figures.get("vendor") else \
            side(work / "vendor", model, CompileOptions(jobs=jobs, vendor_only=True, input_shapes=shapes, calib=calib),
                 target)
    return Row(name, family, ours, theirs, judge(ours, theirs))


# Trained models shipped as ONNX inside packages of the index: (package==version, file in the wheel,
# input shapes; their inputs are dynamic). Fetched with `pip download` into the corpus's folder.
PACKAGED = {
    "ppocr-v4-det": ("rapidocr-onnxruntime==1.4.4", "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
                     {"x": (1, 3, 640, 640)}),
    "ppocr-v4-rec": ("rapidocr-onnxruntime==1.4.4", "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
                     {"x": (1, 3, 48, 320)}),
    "ppocr-mobile-cls": ("rapidocr-onnxruntime==1.4.4",
                         "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx", {"x": (1, 3, 48, 192)}),
}


def packaged(name: str, folder: Path) -> Path:
    """A trained model out of its package's wheel (downloaded once per corpus run)."""
    import subprocess
    import zipfile

    requirement, member, _ = PACKAGED[name]
    wheels = folder / "wheels"
    if not list(wheels.glob(f"{requirement.split('==')[0].replace('-', '_')}-*.whl")):
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels), requirement],
                       check=True, capture_output=True)
    wheel = next(wheels.glob(f"{requirement.split('==')[0].replace('-', '_')}-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        path = folder / f"{name}.onnx"
        path.write_bytes(archive.read(member))
    return path


def trained(name: str, folder: Path) -> Path:
    """A trained transformer from bench/trained.py, its real samples beside it (NAME.calib.npz), which
    the compile calibrates and compares fidelity on."""
    import trained as models

    path = folder / f"{name}.onnx"
    if name == "smollm2-135m":
        path, samples = models.smollm2(path)
    else:
        path, samples, _ = models.sentence_encoder(name, path)
    np.savez(path.with_suffix(".calib.npz"), **{k: v[:4] for k, v in samples.items()})
    return path


# Trained transformers with real activations (a decoder's massive residual channels, a causal mask),
# exported from packages of the index with their real inputs (bench/trained.py).
TRAINED = ("smollm2-135m", "all-mpnet-base-v2", "all-MiniLM-L6-v2")


def corpus(which: str, only: list[str] | None, folder: Path) -> list[tuple[str, str, Callable[[], Path]]]:
    """(name, family, a function that writes the model and returns its path) for each model of the set."""
    import architectures

    folders = {"onnx": ["pytorch-converted", "pytorch-operator"], "ci": ["pytorch-converted", "pytorch-operator"],
               "light": ["light"], "transformers": [], "packaged": [], "trained": [],
               "all": ["pytorch-converted", "pytorch-operator", "simple", "light"]}[which]
    models = [(name, family, lambda path=path: path) for name, family, path in onnx_models(folders)]
    models += [(n, "reproducer", lambda make=make, n=n: make(folder / f"{n}.onnx")) for n, make in REPRODUCERS.items()]
    if which in ("transformers", "all", "ci"):
        models += [(n, "transformers", lambda n=n: architectures.export(n, folder / f"{n}.onnx"))
                   for n in architectures.configs()]
    if which in ("packaged", "all", "trained"):
        models += [(n, "packaged", lambda n=n: packaged(n, folder)) for n in PACKAGED]
    if which in ("trained", "all"):
        models += [(n, "trained", lambda n=n: trained(n, folder)) for n in TRAINED]
    wanted = set(only or (CI if which == "ci" else []))
    return [m for m in models if not wanted or m[0] in wanted]


def exported_models(which: str, only: list[str] | None, folder: Path):
    """(name, family, path) of each model of the set, written when its turn comes; an exporter's failure
    is printed and the model skipped (it is not shard's)."""
    for name, family, make in corpus(which, only, folder):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                path = make()
        except Exception as exc:  # noqa: BLE001 - an exporter's failure is not shard's
            print(f"{name:44} {family:18} export failed: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        yield name, family, path


def local(models, args):
    """(row, model) of each model, one after another on this machine."""
    for name, family, path in models:
        yield evaluate(name, family, path, args.jobs, args.target), path


def on_ray(models, args):
    """(row, model) of each model as its Ray task finishes: one CPU each (its builds one at a time),
    retried where its worker died; every model exported first, so the tasks all start at once."""
    from shard.targets.rknn.remote import connect

    ray = connect(args.ray, args.ray_cpus)
    task = ray.remote(num_cpus=1, max_retries=2)(evaluate)
    pending = {task.remote(name, family, path, 1, args.target): path for name, family, path in models}
    while pending:
        (done,), _ = ray.wait(list(pending), num_returns=1)
        yield ray.get(done), pending.pop(done)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", default="all", choices=["all", "onnx", "light", "transformers", "packaged", "trained",
                                                         "ci"])
    parser.add_argument("--only", help="comma-separated model names")
    parser.add_argument("--json", type=Path, help="write every row here")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--target", default="rk3588", help="any Rockchip chip with fp16 (shard.targets.chips.CHIPS)")
    parser.add_argument("--ray", help="run each model as a task on this Ray cluster (local: one started here)")
    parser.add_argument("--ray-cpus", type=int, default=None, help="--ray local: the cluster's CPUs [default: all]")
    args = parser.parse_args()
    from shard.graph import quiet_graphsurgeon

    quiet_graphsurgeon()
    rows = []
    with tempfile.TemporaryDirectory(prefix="corpus-models-") as folder:
        print(f"{'model':44} {'family':18} {'shard':>24} {'vendor alone':>24} verdict")
        models = exported_models(args.set, args.only.split(",") if args.only else None, Path(folder))
        for row, path in (on_ray(models, args) if args.ray else local(models, args)):
            rows.append(row)
            if path.is_relative_to(Path(folder)):
                path.unlink()  # exported models are large; each is written when its turn comes
                path.with_suffix(".calib.npz").unlink(missing_ok=True)
            print(f"{row.name:44} {row.family:18} {describe(row.shard):>24} {describe(row.vendor):>24} {row.verdict}",
                  flush=True)
    for row in rows:
        for label, s in (("shard", row.shard), ("vendor", row.vendor)):
            if s.traceback:
                print(f"TRACEBACK {row.name} ({label}):\n{s.traceback}")
            elif s.error and label == "shard" and not s.clean:
                print(f"not clean {row.name} ({label}): {s.error}")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
    count = lambda pred: sum(1 for r in rows if pred(r))  # noqa: E731
    print(f"tracebacks={count(lambda r: r.shard.traceback or r.vendor.traceback)}")
    print(f"RESULT target={args.target} models={len(rows)} shard_clean={count(lambda r: r.shard.clean)} "
          f"vendor_clean={count(lambda r: r.vendor.clean)} better={count(lambda r: r.verdict == 'better')} "
          f"worse={count(lambda r: r.verdict == 'worse')} cpu_ops_shard={sum(r.shard.cpu_ops for r in rows)} "
          f"cpu_ops_vendor={sum(r.vendor.cpu_ops for r in rows)}")


def describe(s: Side) -> str:
    if s.traceback:
        return "TRACEBACK"
    if s.error and not s.builds:
        return "fails"
    cos = f"{s.cosine:.6f}" if s.cosine is not None else "no run"
    return f"cpu={s.cpu_ops} cos={cos}"


if __name__ == "__main__":
    sys.exit(main())
