"""The GPU stage pipeline (the cuda executor) against the baseline a PyTorch user would run instead,
both measured in the same run on the GPU at hand, with the roofline cost model next to what each
stage really takes. Needs an NVIDIA GPU and torch.

    python bench/thor.py --models siglip-base-512,siglip-so400m-384 --stages 1,2 --batches 1,4

1. The GPU's profile: `shard probe --target cuda` (bandwidth, matrix-product rates by size, the
   shortest kernel), written to BUILD/cuda.profile.json once; with --ops, per model, batch and
   precision, every distinct op of its one-stage bundle timed alone, and each step of the fused
   stage (what the cost model sums).
2. The baselines, the same seeded weights (shard.zoo.build_model) in fp16 on the GPU: transformers'
   model with sdpa attention captured as one CUDA graph ("eager graph"), and
   torch.compile(mode="reduce-overhead") ("compile"); with --max-autotune, also
   torch.compile(mode="max-autotune"). Each at every batch of --batches.
3. Each zoo model exported once with a dynamic batch axis (seeded weights), compiled with --target
   cuda for each stage count K and batch B (--batch B), and run by the cuda executor (each stage's
   eager and torch.compile'd forms, the faster kept): frames/s through run_stream fed whole batches,
   and for B > 1 fed single frames (micro-batching: run_stream stacks them B to a run), one batch's
   latency, the cosine against onnxruntime fp32 on the CPU, and each stage's own time next to the
   cost model's prediction.
Frames/s counts images, host to host for both sides, with the same data in and out: a float32 numpy
batch in, the float32 numpy output back (the baseline as a user writes it: copy_ from
torch.from_numpy, .float().cpu().numpy()). "device" is the GPU time alone: the baseline's forward,
the sum of our stages' CUDA graphs. Ends with one line per model:
    RESULT model=... stages=K batch=B fps=... vs_eager_graph=... vs_compile=... vs_compile_same_batch=...
        device_vs_compile=... [micro_batch=(KxB) micro_fps=... micro_vs_compile_same_batch=...] cosine=...
        predicted_ratio=... over_floor=...
vs_eager_graph: ours at K stages, batch 1, over the eager graph at batch 1 (the best K); vs_compile:
the same over torch.compile at batch 1; vs_compile_same_batch: the best of K x B over torch.compile
at that B; device_vs_compile: torch.compile's device time over the sum of our stages' at K = 1,
B = 1; micro_batch, micro_fps, micro_vs_compile_same_batch: the K x B (B > 1) whose bundle, fed single
frames that run_stream stacks B to a run (--batch B), is fastest against torch.compile at B; cosine:
the worst of all runs; predicted_ratio: the median of measured / predicted stage time
(with --ops: each op's share of its fused kernel, as measured alone); over_floor: the median of
measured / floor (roofline.stage_floor: FLOPs at the peak, weights and the stage's own inputs and
outputs moved once).
With --precision fp16,fp8 each further precision is compiled and measured beside the first, and
gets its own line:
    RESULT model=... precision=fp8 vs=fp16 at_1x1=... best=... (K=.. B=..) device=... cosine=...
at_1x1: its frames/s over the first precision's at K = 1, B = 1; best: the same ratio at the K x B
where it is highest; device: the first precision's device time over its own there (the sums of the
stages' CUDA graphs). With --ops, every op's time alone and its share of the fused kernel that runs
it (shard probe --target cuda --ops) go into the profile before the bundles are compiled, so the
predictions are for the fused stages.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

from shard.bundle import TensorSpec
from shard.calibration import run_each
from shard.compilation import compile_model
from shard.options import CompileOptions
from shard.runtime import Session, random_inputs
from shard.runtime.executors.gpu import capturing
from shard.compare import lowest
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
        forms = {name: p.form for e in session.distinct_executors for name, p in e.prepared.items()}
        passed = {name: why for e in session.distinct_executors for name, why in e.passed_over.items()}
        outputs = session.run(x)   # warm
        worst = lowest(compare(t.name, reference[t.name], outputs[t.name]).cosine for t in session.manifest.outputs)
        latencies = []
        for _ in range(latency_runs):
            started = time.perf_counter()
            session.run(x)
            latencies.append(time.perf_counter() - started)
        rate = stream_rate(session, [x], frames)
        batch = session.batching.size
        single = None
        if batch > 1:   # micro-batching: single frames in, stacked `batch` to a run, each one's outputs out
            singles = [{name: value[k:k + 1] for name, value in x.items()} for k in range(batch)]
            got = list(session.run_stream(singles))
            worst = lowest((worst, *(compare(t.name, reference[t.name], np.concatenate([g[t.name] for g in got])).cosine
                                 for t in session.manifest.outputs)))
            single = stream_rate(session, singles, frames * batch)
        stages = stage_seconds(session)
    return {"fps": rate * batch, "fps_single": single, "latency": statistics.median(latencies), "cosine": worst,
            "stages": stages, "forms": forms, "passed_over": passed}


def stream_rate(session: Session, frames: list[dict], count: int) -> float:
    """run_stream's inputs per second over `count` of `frames` in turn, after a warm stream."""
    for _ in session.run_stream(itertools.islice(itertools.cycle(frames), 2 * len(session.cores) * len(frames))):
        pass
    started = time.perf_counter()
    for _ in session.run_stream(itertools.islice(itertools.cycle(frames), count)):
        pass
    return count / (time.perf_counter() - started)


def baseline(name: str, batch: int, mode: str, frames: int) -> dict:
    """transformers' model, sdpa attention, fp16 on the GPU, at `batch`: mode "eager graph" (its forward
    captured as one CUDA graph) or a torch.compile mode. Frames/s host to host, and the device time."""
    import torch

    from shard.zoo import build_model, get_model

    spec = get_model(name)
    model = build_model(name)
    model.set_attn_implementation("sdpa")
    model = model.half().cuda()
    static = torch.zeros(batch, 3, spec.image_size, spec.image_size, dtype=torch.float16, device="cuda")
    image = np.random.default_rng(0).standard_normal(tuple(static.shape)).astype(np.float32)
    forward = lambda: model(pixel_values=static).last_hidden_state  # noqa: E731
    started = time.perf_counter()
    with torch.no_grad():
        if mode == "eager graph":
            for _ in range(3):
                forward()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with capturing(torch, graph):
                out = forward()
            run = lambda: (graph.replay(), out)[1]  # noqa: E731
        else:
            compiled = torch.compile(model, mode=mode)
            run = lambda: compiled(pixel_values=static).last_hidden_state  # noqa: E731
            for _ in range(3):
                run()
        torch.cuda.synchronize()
        built = time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(frames):   # what the cuda executor is given and gives back: float32 numpy
            static.copy_(torch.from_numpy(image))
            run().float().cpu().numpy()
        host = (time.perf_counter() - started) / frames
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(frames):
            run()
        end.record()
        torch.cuda.synchronize()
    return {"fps": batch / host, "latency": host, "device": start.elapsed_time(end) / 1e3 / frames,
            "built_s": built}




def ours(name: str, args, profile: Path, build: Path, batch: int, precision: str) -> dict:
    """Every stage count at one batch and precision: {K: measured}, printed as it goes."""
    model = exported(name, build)
    graph = onnx.load(str(model), load_external_data=False).graph
    x = random_inputs([TensorSpec(i.name, [batch, *(d.dim_value for d in i.type.tensor_type.shape.dim[1:])], "float32")
                       for i in graph.input])
    reference = next(run_each(onnx.load(str(model)), [x], [o.name for o in graph.output]))
    runs = {}
    for k in [int(s) for s in args.stages.split(",")]:
        bundle = build / f"{name}-b{batch}-cuda{k}-{precision}.shard"
        started = time.perf_counter()
        result = compile_model(model, "cuda", bundle, CompileOptions(shards=k, profile=str(profile),
                                                                      precision=precision, batch=batch))
        compiled = time.perf_counter() - started
        started = time.perf_counter()
        r = runs[k] = {**measure(bundle, x, reference, args.frames, args.latency_runs),
                       "table": result.report["passes"]["stages"]["stages"]}
        search = result.report["passes"]["fp8_linears"]
        share = search.get("fp8_linear_macs", 0.0)
        if search.get("rounds") and not search.get("cached"):
            print(f"{name} fp8 B={batch} rounds ({search['rounds_on']}): " + ", ".join(
                f"{100 * r['fp8_linear_macs']:.1f} % {r['cosine']:.5f}"
                + (f" (onnxruntime {r['confirmed']:.5f})" if "confirmed" in r else "") for r in search["rounds"]),
                flush=True)
        fp8 = f", {100 * share:.0f} % of the linears' MACs in FP8" if precision == "fp8" else ""
        micro = f" ({r['fps_single']:.1f} fed single frames)" if r["fps_single"] else ""
        print(f"{name} {precision} K={k} B={batch}{fp8}: {r['fps']:.1f} frames/s{micro}, latency "
              f"{1e3 * r['latency']:.2f} ms, device "
              f"{1e3 * sum(r['stages'].values()):.2f} ms over its stages, cosine {r['cosine']:.6f} (compiled in "
              f"{compiled:.0f} s, loaded and measured in {time.perf_counter() - started:.0f} s; forms "
              f"{sorted(set(r['forms'].values()))}{'; passed over: ' + str(r['passed_over']) if r['passed_over'] else ''})",
              flush=True)
        for row in r["table"]:
            measured = r["stages"][row["stage"]]
            print(f"    {row['stage']} ({r['forms'][row['stage']]}): measured {1e3 * measured:.3f} ms, predicted "
                  f"{1e3 * row['predicted_s']:.3f} ms, floor {1e3 * row['floor_s']:.3f} ms ({row['bound']}), "
                  f"measured/predicted {measured / row['predicted_s']:.2f}, measured/floor "
                  f"{measured / row['floor_s']:.2f}", flush=True)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="siglip-base-512,siglip-so400m-384")
    ap.add_argument("--stages", default="1,2")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--frames", type=int, default=200)
    ap.add_argument("--latency-runs", type=int, default=30)
    ap.add_argument("--build", default="build")
    ap.add_argument("--precision", default="fp16", help="fp16, fp8, or both (fp16,fp8: fp8 measured against fp16)")
    ap.add_argument("--ops", action="store_true", help="time every op of the one-stage bundle into the profile")
    ap.add_argument("--max-autotune", action="store_true", help="also torch.compile(mode='max-autotune')")
    ap.add_argument("--no-baselines", action="store_true", help="ours alone (fp8 against fp16 needs no peer)")
    args = ap.parse_args()
    # Inductor's kernels compiled afresh in each run, ours and the baseline's: with an earlier run's
    # cache, torch.compile(mode="reduce-overhead") of SigLIP-base at batch 1 took 8.0 ms a frame host
    # to host on an H200 (device 1.05 ms), 2.2 ms with an empty one.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-"))
    import torch

    from shard.probes.cuda import add_measured_ops, probe_cuda
    from shard.profile import load_profile

    build = Path(args.build)
    build.mkdir(exist_ok=True)
    profile = build / "cuda.profile.json"
    if not profile.exists():
        probe_cuda().save(profile)
    facts = json.loads(profile.read_text())["facts"]
    print(f"GPU: {torch.cuda.get_device_name()} ({facts['bandwidth_gbs']:.0f} GB/s, fp16 peak "
          f"{facts['peak_tflops']['fp16']:.0f} TFLOP/s, shortest kernel {1e6 * facts['min_kernel_s']:.1f} us); "
          f"torch {torch.__version__}", flush=True)
    batches = [int(b) for b in args.batches.split(",")]
    modes = [] if args.no_baselines else \
        ["eager graph", "reduce-overhead"] + (["max-autotune"] if args.max_autotune else [])
    results = []
    for name in args.models.split(","):
        base = {}
        for mode, batch in itertools.product(modes, batches):
            try:
                b = base[mode, batch] = baseline(name, batch, mode, args.frames)
            except Exception as exc:   # noqa: BLE001 - a peer that does not build is said, not fatal
                print(f"{name} baseline {mode} B={batch}: did not run ({type(exc).__name__}: {exc})", flush=True)
                continue
            print(f"{name} baseline {mode} B={batch}: {b['fps']:.1f} frames/s, latency {1e3 * b['latency']:.2f} ms, "
                  f"device {1e3 * b['device']:.2f} ms (built in {b['built_s']:.0f} s)", flush=True)
        precisions = args.precision.split(",")
        for precision, batch in itertools.product(precisions, batches) if args.ops else ():
            whole = build / f"{name}-b{batch}-cuda-ops-{precision}.shard"
            compile_model(exported(name, build), "cuda", whole, CompileOptions(shards=1, profile=str(profile),
                                                                                precision=precision, batch=batch))
            measured = load_profile("cuda", profile)
            add_measured_ops(measured, whole)
            measured.save(profile)
        every = {(k, batch, p): r for p in precisions for batch in batches
                 for k, r in ours(name, args, profile, build, batch, p).items()}
        runs = {(k, batch): r for (k, batch, p), r in every.items() if p == precisions[0]}
        print(f"{name}: K, B, frames/s, latency ms, x eager graph, x torch.compile (at B; host to host), device ms, "
              f"x eager graph, x torch.compile (device), frames/s fed single frames, x torch.compile (at B)")
        for (k, batch), r in runs.items():
            print(f"    {k}  {batch}  {r['fps']:8.1f}  {1e3 * r['latency']:7.2f}  {over(runs, base, (k, batch), 'eager graph'):>6}"
                  f"  {over(runs, base, (k, batch), 'reduce-overhead'):>6}  {1e3 * sum(r['stages'].values()):6.2f}  "
                  f"{over(runs, base, (k, batch), 'eager graph', True):>6}  "
                  f"{over(runs, base, (k, batch), 'reduce-overhead', True):>6}  "
                  f"{r['fps_single'] or 0:8.1f}  {over(runs, base, (k, batch), 'reduce-overhead', single=True):>6}")
        single = max((key for key in runs if key[1] == 1), key=lambda key: runs[key]["fps"], default=None)
        best = max(runs, key=lambda key: runs[key]["fps"] / base.get(("reduce-overhead", key[1]), {"fps": 1})["fps"])
        micro = max((key for key in runs if key[1] > 1), default=None,
                    key=lambda key: runs[key]["fps_single"] / base.get(("reduce-overhead", key[1]), {"fps": 1})["fps"])
        ratios = [r["stages"][row["stage"]] / row["predicted_s"] for r in runs.values() for row in r["table"]]
        floors = [r["stages"][row["stage"]] / row["floor_s"] for r in runs.values() for row in r["table"]]
        results.append(f"RESULT model={name} stages={best[0]} batch={best[1]} fps={runs[best]['fps']:.1f} "
                       f"vs_eager_graph={over(runs, base, single, 'eager graph')} "
                       f"vs_compile={over(runs, base, single, 'reduce-overhead')} "
                       f"vs_compile_same_batch={over(runs, base, best, 'reduce-overhead')} "
                       f"device_vs_compile={over(runs, base, (1, 1), 'reduce-overhead', True)} "
                       + (f"micro_batch=({micro[0]}x{micro[1]}) micro_fps={runs[micro]['fps_single']:.1f} "
                          f"micro_vs_compile_same_batch={over(runs, base, micro, 'reduce-overhead', single=True)} "
                          if micro else "") +
                       f"cosine={lowest(r['cosine'] for r in runs.values()):.6f} "
                       f"predicted_ratio={statistics.median(ratios):.3f} over_floor={statistics.median(floors):.3f}")
        for p in precisions[1:]:   # each further precision against the first, at the same K and B
            pairs = {(k, b): r["fps"] / runs[k, b]["fps"] for (k, b, q), r in every.items() if q == p}
            top = max(pairs, key=pairs.get)
            device = sum(runs[top]["stages"].values()) / sum(every[(*top, p)]["stages"].values())
            results.append(f"RESULT model={name} precision={p} vs={precisions[0]} at_1x1={pairs.get((1, 1), 0):.3f} "
                           f"best={pairs[top]:.3f} (K={top[0]} B={top[1]}) device={device:.3f} "
                           f"cosine={lowest(r['cosine'] for (_, _, q), r in every.items() if q == p):.6f}")
    print("\n".join(results))


def over(runs: dict, base: dict, key: tuple | None, mode: str, device: bool = False, single: bool = False) -> str:
    """Ours at key (K, B) over the baseline `mode` at B: frames/s (fed whole batches, or `single` frames
    that run_stream stacks), or device time per frame."""
    if key not in runs or (mode, key[1]) not in base or (single and not runs[key]["fps_single"]):
        return "-"
    if device:
        return f"{base[mode, key[1]]['device'] / sum(runs[key]['stages'].values()):.3f}"
    return f"{runs[key]['fps_single' if single else 'fps'] / base[mode, key[1]]['fps']:.3f}"


def exported(name: str, build: Path) -> Path:
    """The zoo model's ONNX with a dynamic batch axis (each bundle fixes it: --batch), exported once
    into build/."""
    from shard.zoo import export_model

    model = build / f"{name}-batch.onnx"
    if not model.exists():
        started = time.perf_counter()
        export_model(name, model, dynamic_batch=True)
        print(f"{name}: exported in {time.perf_counter() - started:.0f} s", flush=True)
    return model


if __name__ == "__main__":
    main()
