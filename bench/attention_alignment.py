"""The attention of Pi0's denoising step (the expert's rows over the prefix's cache and their own keys,
one key head for all query heads) in the form the cuda executor hands torch.compile ("attention as
ops"), with the keys' count as it is beside it padded to a multiple of 8 (torch_fusions.aligned_keys),
and, padded, with the key head not repeated (every query head's rows in one product against it); and
"executor": that attention as the step's ONNX spells it (the key head repeated by Unsqueeze, Tile and
Reshape) in the executor's as-ops form (TorchGraph.unfused: torch_fusions.grouped on padded keys). Each
compiled and captured as a CUDA graph, the replays timed side by side in one run. Needs a GPU.

    python bench/attention_alignment.py [--cache 816 --rows 51 --heads 8 --head-dim 256]

Prints each side's replay, its longest kernels, and
    RESULT keys=867 padded=872 plain_us=... aligned_us=... grouped_us=... executor_us=... speedup=...
        grouped_vs_aligned=... executor_vs_aligned=... aligned_max_abs=... grouped_max_abs=... executor_max_abs=...
"""
import argparse

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper
from torch.profiler import ProfilerActivity, profile

from shard.runtime.executors.gpu import capturing, replay_seconds
from shard.runtime.executors.torch_fusions import aligned_keys, plain
from shard.runtime.executors.torch_graph import TorchGraph


def attention_of(heads: int, scale: float, aligned: bool):
    """One layer's attention as the step's ONNX has it: the cache's keys and the rows' own concatenated,
    repeated for every query head, the scores scaled, the mask added, softmax, the values."""
    def attend(q, past_k, k, past_v, v, mask):
        kt = torch.cat([past_k, k], dim=2).repeat_interleave(heads, dim=1).transpose(-1, -2)
        vv = torch.cat([past_v, v], dim=2).repeat_interleave(heads, dim=1)
        return plain(*(aligned_keys(q, kt, vv, mask) if aligned else (q, kt, vv, mask)), scale)
    return attend


def one_key_head(heads: int, scale: float):
    """The same attention, the keys padded, with the one key head not repeated: every query head's rows
    stacked into one product against it (what a fused form could take from the graph's repeat)."""
    def attend(q, past_k, k, past_v, v, mask):
        b, h, t, d = q.shape
        kt = torch.cat([past_k, k], dim=2).transpose(-1, -2)
        vv = torch.cat([past_v, v], dim=2)
        _, kt, vv, mask = aligned_keys(q, kt, vv, mask)
        scores = (q.reshape(b, 1, h * t, d) @ kt).view(b, h, t, -1) * scale + mask
        return (scores.softmax(-1).view(b, 1, h * t, -1) @ vv).view(b, h, t, -1)
    return attend


def as_onnx(heads: int, rows: int, cache: int, dim: int, scale: float) -> onnx.ModelProto:
    """attention_of's attention as the step's ONNX spells it (fp16, shapes recorded as a compiled stage's)."""
    keys, half = cache + rows, TensorProto.FLOAT16
    nodes = [helper.make_node("Concat", ["past_k", "k"], ["kc"], axis=2),
             helper.make_node("Concat", ["past_v", "v"], ["vc"], axis=2)]
    for x in ("k", "v"):
        nodes += [helper.make_node("Unsqueeze", [f"{x}c", "axis"], [f"{x}1"]),
                  helper.make_node("Tile", [f"{x}1", "repeats"], [f"{x}2"]),
                  helper.make_node("Reshape", [f"{x}2", "merged"], [f"{x}r"])]
    nodes += [helper.make_node("Transpose", ["kr"], ["kt"], perm=[0, 1, 3, 2]),
              helper.make_node("MatMul", ["q", "kt"], ["s"]), helper.make_node("Mul", ["s", "c"], ["s2"]),
              helper.make_node("Add", ["s2", "mask"], ["s3"]), helper.make_node("Softmax", ["s3"], ["p"], axis=-1),
              helper.make_node("MatMul", ["p", "vr"], ["y"])]
    inputs = [helper.make_tensor_value_info(n, half, s) for n, s in (
        ("q", [1, heads, rows, dim]), ("past_k", [1, 1, cache, dim]), ("k", [1, 1, rows, dim]),
        ("past_v", [1, 1, cache, dim]), ("v", [1, 1, rows, dim]), ("mask", [rows, keys]))]
    inits = [numpy_helper.from_array(np.array(a, t), n) for n, a, t in (
        ("axis", [2], np.int64), ("repeats", [1, 1, heads, 1, 1], np.int64),
        ("merged", [1, heads, keys, dim], np.int64), ("c", scale, np.float16))]
    graph = helper.make_graph(nodes, "attention", inputs, [helper.make_tensor_value_info("y", half, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    return onnx.shape_inference.infer_shapes(model)


def replay_us(run, inputs, repeats: int = 200) -> tuple[float, object]:
    """The median of `repeats` replays of run(*inputs) captured as one CUDA graph (microseconds: the
    executor's own replay_seconds), and its output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            run(*inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with capturing(torch, graph, stream):
        out = run(*inputs)
    seconds = replay_seconds(torch, graph, stream, repeats)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    rows = sorted((e for e in prof.key_averages() if e.device_time_total > 0), key=lambda e: -e.device_time_total)
    for e in rows[:4]:
        print(f"    {e.device_time_total:7.1f} us  {e.key[:100]}")
    return 1e6 * seconds, out.clone()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=int, default=816, help="the prefix's keys (3 cameras x 256 patches + 48 tokens)")
    ap.add_argument("--rows", type=int, default=51, help="the suffix: the state and 50 actions")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=256)
    args = ap.parse_args()
    torch.manual_seed(0)
    h, d, t, p = args.heads, args.head_dim, args.rows, args.cache
    half = dict(device="cuda", dtype=torch.float16)
    inputs = (torch.randn(1, h, t, d, **half), torch.randn(1, 1, p, d, **half), torch.randn(1, 1, t, d, **half),
              torch.randn(1, 1, p, d, **half), torch.randn(1, 1, t, d, **half), torch.zeros(t, p + t, **half))
    inputs[-1][0, p + 1:] = -1e4   # the state sees the prefix and itself
    executor = TorchGraph(as_onnx(h, t, p, d, d ** -0.5), "cuda")
    sides = {"plain": attention_of(h, d ** -0.5, False), "aligned": attention_of(h, d ** -0.5, True),
             "grouped": one_key_head(h, d ** -0.5), "executor": lambda *xs: executor.unfused(*xs)[0]}
    results = {}
    for name, attend in sides.items():
        print(f"{name}:")
        results[name] = replay_us(torch.compile(attend, dynamic=False), inputs)
        print(f"  {results[name][0]:.2f} us a replay")
    want = results["plain"][1].float()
    keys = p + t
    print(f"RESULT keys={keys} padded={keys + (-keys % 8)} "
          + " ".join(f"{name}_us={us:.2f}" for name, (us, _) in results.items())
          + f" speedup={results['plain'][0] / results['aligned'][0]:.3f}"
          + f" grouped_vs_aligned={results['aligned'][0] / results['grouped'][0]:.3f}"
          + f" executor_vs_aligned={results['aligned'][0] / results['executor'][0]:.3f} "
          + " ".join(f"{name}_max_abs={(out.float() - want).abs().max().item():.2e}"
                     for name, (_, out) in results.items() if name != "plain"))


if __name__ == "__main__":
    main()
