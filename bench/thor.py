"""The GPU stage pipeline (the cuda executor) against the whole model as one CUDA graph, on the GPU at
hand, with the roofline cost model next to what each stage really takes. Needs an NVIDIA GPU and torch.

    python bench/thor.py --models siglip-base-512,siglip-so400m-384 --stages 1,2,3,4

1. The GPU's profile: `shard probe --target cuda` (bandwidth, matrix-product rates by size, the
   shortest kernel), written to BUILD/cuda.profile.json once; then, per model, `--ops` on its
   one-stage bundle: every distinct op's kernel timed alone (what the cost model sums).
2. Each zoo model exported (seeded weights), compiled with --target cuda --profile that --shards K
   for each K (K = 1 is the whole model as one stage, one CUDA graph on one stream).
3. Each bundle run by the cuda executor: one frame's latency (median of --latency-runs), the
   throughput of run_stream over --frames frames, the cosine against onnxruntime fp32 on the CPU,
   and each stage's own time (its CUDA graph replayed alone, CUDA events) next to its roofline floor
   and the cost model's prediction.
Ends with one line per model:
    RESULT model=... stages=K speedup=... cosine=... floor_ratio=...
stages: the K of the highest throughput; speedup: its frames/s over K = 1's; cosine: the worst of
all K; floor_ratio: the median over every stage of every K of measured / predicted stage time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

import onnx

from shard.bundle import TensorSpec
from shard.calibration import run_each
from shard.compilation import compile_model
from shard.options import CompileOptions
from shard.runtime import Session, random_inputs
from shard.verifier import compare


def stage_seconds(session: Session, repeats: int = 20) -> dict[str, float]:
    """Each stage's CUDA graph replayed alone on its stream, CUDA events around `repeats` replays."""
    import torch

    out = {}
    for shard in session.manifest.shards:
        executor = session.executors[shard.core]
        graph = executor.prepared[shard.name].graph
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(executor.stream):
            graph.replay()
            start.record()
            for _ in range(repeats):
                graph.replay()
            end.record()
        torch.cuda.synchronize()
        out[shard.name] = start.elapsed_time(end) / 1e3 / repeats
    return out


def measure(bundle: Path, x: dict, reference: dict, frames: int, latency_runs: int) -> dict:
    with Session(bundle, backend="cuda") as session:
        outputs = session.run(x)   # warm
        worst = min(compare(t.name, reference[t.name], outputs[t.name]).cosine for t in session.manifest.outputs)
        latencies = []
        for _ in range(latency_runs):
            started = time.perf_counter()
            session.run(x)
            latencies.append(time.perf_counter() - started)
        for _ in session.run_stream(itertools.repeat(x, 2 * len(session.cores))):
            pass
        started = time.perf_counter()
        for _ in session.run_stream(itertools.repeat(x, frames)):
            pass
        rate = frames / (time.perf_counter() - started)
        stages = stage_seconds(session)
    return {"fps": rate, "latency": statistics.median(latencies), "cosine": worst, "stages": stages}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="siglip-base-512,siglip-so400m-384")
    ap.add_argument("--stages", default="1,2,3,4")
    ap.add_argument("--frames", type=int, default=200)
    ap.add_argument("--latency-runs", type=int, default=30)
    ap.add_argument("--build", default="build")
    ap.add_argument("--precision", default="fp16", help="fp16 or fp8 (FP8 runs as Q/DQ in torch: no FP8 kernels)")
    args = ap.parse_args()
    import torch

    from shard.probes.cuda import add_measured_ops, probe_cuda
    from shard.profile import load_profile
    from shard.zoo import export_model

    build = Path(args.build)
    build.mkdir(exist_ok=True)
    profile = build / "cuda.profile.json"
    if not profile.exists():
        probe_cuda().save(profile)
    facts = json.loads(profile.read_text())["facts"]
    print(f"GPU: {torch.cuda.get_device_name()} ({facts['bandwidth_gbs']:.0f} GB/s, fp16 peak "
          f"{facts['peak_tflops']['fp16']:.0f} TFLOP/s, shortest kernel {1e6 * facts['min_kernel_s']:.1f} us); "
          f"torch {torch.__version__}", flush=True)
    results = []
    for name in args.models.split(","):
        model = build / f"{name}.onnx"
        if not model.exists():
            started = time.perf_counter()
            export_model(name, model)
            print(f"{name}: exported in {time.perf_counter() - started:.0f} s", flush=True)
        graph = onnx.load(str(model), load_external_data=False).graph
        x = random_inputs([TensorSpec(i.name, [d.dim_value for d in i.type.tensor_type.shape.dim], "float32")
                           for i in graph.input])
        reference = next(run_each(onnx.load(str(model)), [x], [o.name for o in graph.output]))
        whole = build / f"{name}-cuda-ops.shard"
        compile_model(model, "cuda", whole, CompileOptions(shards=1, profile=str(profile), precision=args.precision))
        measured = load_profile("cuda", profile)
        add_measured_ops(measured, whole)
        measured.save(profile)
        runs = {}
        for k in [int(s) for s in args.stages.split(",")]:
            bundle = build / f"{name}-cuda{k}-{args.precision}.shard"
            started = time.perf_counter()
            result = compile_model(model, "cuda", bundle, CompileOptions(shards=k, profile=str(profile),
                                                                          precision=args.precision))
            compiled = time.perf_counter() - started
            table = result.report["passes"]["stages"]["stages"]
            runs[k] = {**measure(bundle, x, reference, args.frames, args.latency_runs), "table": table}
            r = runs[k]
            print(f"{name} K={k}: {r['fps']:.1f} frames/s, latency {1e3 * r['latency']:.2f} ms, cosine "
                  f"{r['cosine']:.6f} (compiled in {compiled:.0f} s)", flush=True)
            for row in table:
                measured = r["stages"][row["stage"]]
                print(f"    {row['stage']}: measured {1e3 * measured:.3f} ms, predicted {1e3 * row['predicted_s']:.3f}"
                      f" ms, floor {1e3 * row['floor_s']:.3f} ms ({row['bound']}), measured/predicted "
                      f"{measured / row['predicted_s']:.2f}", flush=True)
        base = runs[min(runs)]["fps"]
        print(f"{name}: K, frames/s, x whole graph, latency ms")
        for k, r in runs.items():
            print(f"    {k}  {r['fps']:8.1f}  {r['fps'] / base:5.2f}x  {1e3 * r['latency']:7.2f}")
        best = max(runs, key=lambda k: runs[k]["fps"])
        ratios = [r["stages"][row["stage"]] / row["predicted_s"] for r in runs.values() for row in r["table"]]
        results.append(f"RESULT model={name} stages={best} speedup={runs[best]['fps'] / base:.3f} "
                       f"cosine={min(r['cosine'] for r in runs.values()):.6f} "
                       f"floor_ratio={statistics.median(ratios):.3f}")
    print("\n".join(results))


if __name__ == "__main__":
    main()
