"""A VLA's prefix-then-denoise loop on the GPU (shard.zoo.vla's Pi0 shapes, seeded weights): shard's
bundle on the cuda backend against what a PyTorch user runs instead, every side in the same run on the
same GPU, the same observation and noise in, the same action chunk out (numpy to numpy).

    python bench/vla.py [--depth 18] [--steps 10] [--repeats 10] [--work DIR] [--precision fp16,fp8,w4a16]

1. The model in fp32 on the GPU: the reference action chunk.
2. PyTorch in fp16 (the same weights, .half()): "eager" (sample_actions as written), "eager graph"
   (the whole loop captured as one CUDA graph, its inputs in static buffers), "sdpa" and "sdpa graph"
   (the same with every attention through scaled_dot_product_attention: zoo.vla.as_sdpa), and
   torch.compile of the loop, default and mode="reduce-overhead" (its own CUDA graphs).
3. shard: the model exported (shard.zoo.vla.export_vla), compiled for --target thor (each program one
   fp16 stage), run by VlaSession on the cuda backend: the whole observation one CUDA graph (the three
   programs' stages, the features written into the prefix's own input buffer, the 10 steps reading
   the prefix's keys and values where it wrote them); and, in the same session, the programs one after another (each stage's
   own graph, the loop one graph), the host between them.

Ours is exported and compiled in a process of its own while the PyTorch sides are made (torch.compile
compiles for minutes), and every side is timed after both, one at a time. --reuse reads back a bundle
an earlier call left in --work (a warm machine keeps it), and --sides picks the PyTorch sides. On a
machine whose compile caches are empty the whole run does not fit one 10-minute call (full depth on an
H100: export 147-208 s, compile 88-120 s, loading ours past 170 s, reduce-overhead's compile 377 s and
more after the fp32 model is built): --warm-only does everything but the timing (ours loaded and acting
once in the process that compiled it, each PyTorch side asked made in a process of its own beside it, so
that torch.compile's two modes compile at once), and a --reuse call on the same
machine then reads each compile back (reduce-overhead ready after 38 s, ours loaded, the whole call
311 s).

--precision compiles and runs one bundle of ours per precision (fp16 first: `--precision fp8` is
fp8_linears' search on every program, `pi0-fp8.shard`, w4a16 w4a16_linears', `pi0-w4a16.shard`, each
the fp16 bundle where its action chunk leaves the lossy gate: compilation.vla.check_actions; the cuda
executor dequantizes w4a16's weights once, at load, so on a GPU it runs at fp16's speed, and only a
TensorRT engine reads them as int4); each other precision is printed against our
fp16 on both measures, with its actions' MSE as a share of their scale (the lossy gate: < 5e-3).

--target cuda probes this GPU first (`shard probe --target cuda`, no --ops) and compiles for it: each
program's stage is printed as the compile predicted it on that profile beside its replay as loaded
(the form kept). The default, thor, predicts on Thor's profile, printed with the compile.

--kernels also prints one denoising step's kernels (the torch profiler), ours beside torch.compile
of the model's velocity, and a whole observation's, ours beside each torch.compile side: where the
time goes.

Each side: the median host-to-host time of one observation over --repeats runs (after warm runs),
its GPU time alone (CUDA events around --repeats runs of the same work queued back to back, inputs
already on the GPU; ours: the observation's graph replayed, its copies in and out inside it), and the action
chunk's cosine, max abs diff and MSE against the fp32 reference. Ours also prints vision, prefix and
the steps apart, beside Thor's published Pi0.5 breakdown (vision 17 ms, prefix 54 ms, 10 steps 102
ms: FACTS-thor.md). Ends with
    RESULT depth=.. steps=.. ours_ms=.. vs_eager=.. vs_best_compile=.. gpu_vs_best_compile=.. cosine=..
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing
import os
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np
import torch

from shard.compilation.vla import compile_vla
from shard.options import CompileOptions
from shard.probes.cuda import probe_cuda, stage_replays
from shard.runtime.executors.gpu import capturing
from shard.runtime.vla import PROGRAMS, VlaSession
from shard.targets.chips import GPU_TARGETS
from shard.zoo.vla import CONFIGS, as_sdpa, build_vla, export_vla, observation, with_depth


def figures(got: np.ndarray, want: np.ndarray) -> dict:
    got, want = got.astype(np.float64).ravel(), want.astype(np.float64).ravel()
    return {"cosine": float(got @ want / np.linalg.norm(got) / np.linalg.norm(want)),
            "max_abs": float(np.abs(got - want).max()), "mse": float(np.mean((got - want) ** 2)),
            "scale": float(np.mean(want ** 2))}


def timed(run, repeats: int) -> float:
    """The median seconds of run() over `repeats` calls, after two warm ones."""
    run(), run()
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def gpu_seconds(run, repeats: int, stream=None) -> float:
    """CUDA events around `repeats` calls of run() (its work queued on `stream`, the current one by
    default, the inputs on the GPU already)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    run()
    torch.cuda.synchronize()
    start.record(stream)
    for _ in range(repeats):
        run()
    end.record(stream)
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


SIDES = ("eager", "eager graph", "sdpa", "sdpa graph", "compile default", "compile reduce-overhead")


def pytorch_sides(model, obs: dict, steps: int, asked: list[str]) -> dict:
    """fp16 PyTorch, each side made and run once (torch.compile's compiling done): eager, the loop as
    one CUDA graph, torch.compile (default, reduce-overhead). `model` becomes fp16 on the GPU."""
    half = model.half().cuda()
    pinned = {k: torch.from_numpy(v).pin_memory() for k, v in obs.items()}
    static = {k: v.to("cuda", dtype=torch.float16 if v.dtype == torch.float32 else v.dtype) for k, v in pinned.items()}
    out_host = torch.empty(static["noise"].shape, dtype=torch.float32).pin_memory()

    sdpa = as_sdpa(copy.deepcopy(half)) if {"sdpa", "sdpa graph"} & set(asked) else None

    def loop(model=half):
        return model.sample_actions(static["pixel_values"], static["tokens"], static["state"], static["noise"], steps)

    def host_to_host(forward):
        def run():
            for k, v in pinned.items():
                static[k].copy_(v, non_blocking=True)
            out_host.copy_(forward(), non_blocking=True)
            torch.cuda.synchronize()
            return out_host.numpy().copy()
        return run

    def compiled(mode: str | None):
        c = torch.compile(half.sample_actions, mode=mode)
        return lambda: c(static["pixel_values"], static["tokens"], static["state"], static["noise"], steps).clone()

    forms = {"eager": lambda: loop, "eager graph": lambda: captured_loop(loop),   # name -> what makes its forward
             "sdpa": lambda: partial(loop, sdpa), "sdpa graph": lambda: captured_loop(partial(loop, sdpa)),
             "compile default": lambda: compiled(None), "compile reduce-overhead": lambda: compiled("reduce-overhead")}
    sides = {}
    for name, make in ((n, m) for n, m in forms.items() if n in asked):
        started = time.perf_counter()
        try:
            forward = make()
            run = host_to_host(forward)
            sides[name] = {"run": run, "forward": forward, "actions": run(), "warm_s": time.perf_counter() - started}
        except Exception as exc:  # noqa: BLE001 - a side that fails is reported, the others still run
            print(f"{name}: failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", flush=True)
            continue
        print(f"{name}: ready after {sides[name]['warm_s']:.0f} s", flush=True)
    return sides


def warm_side(config, obs: dict, steps: int, side: str) -> None:
    """One PyTorch side made and run once in a process of its own (--warm-only): torch.compile's
    compile lands in its caches on disk, where a --reuse call reads it back."""
    pytorch_sides(build_vla(config).cuda(), obs, steps, [side])


def time_sides(sides: dict, repeats: int) -> dict:
    """Each side's median host-to-host time and its GPU time, printed."""
    for name, side in sides.items():
        side.update(host_s=timed(side.pop("run"), repeats), gpu_s=gpu_seconds(side["forward"], repeats))
        print(f"{name}: {1e3 * side['host_s']:.2f} ms host to host, {1e3 * side['gpu_s']:.2f} ms GPU", flush=True)
    return sides


def captured_loop(loop):
    """The loop captured once as a CUDA graph (after two warm runs on a side stream); replaying it
    returns the output it captured."""
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            loop(), loop()
        torch.cuda.current_stream().wait_stream(stream)
        with capturing(torch, graph):
            captured = loop()
    return lambda: (graph.replay(), captured)[1]


def stage_forms(session: VlaSession) -> str:
    """Each program's stages: the form kept, each form's replay, and why a form was passed over."""
    lines = []
    for program, s in session.sessions.items():
        for executor in s.distinct_executors:
            for stage, prepared in executor.prepared.items():
                timed = executor.form_seconds.get(stage, {})
                timed_forms = ", ".join(f"{form} {1e3 * t:.3f} ms" for form, t in timed.items())
                over = executor.passed_over.get(stage)
                lines.append(f"  {program}/{stage}: kept {prepared.form} ({timed_forms or 'not timed'})"
                             + (f"; passed over: {over}" if over else ""))
    return "\n".join(lines)


def kernel_table(run, label: str, top: int = 12) -> None:
    """The kernels one call of run() launches (the torch profiler, after three warm calls): their total
    time and count, and the `top` longest by name."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_time_total > 0]
    print(f"{label}: {sum(e.device_time_total for e in rows) / 1e3:.3f} ms of kernels, "
          f"{sum(e.count for e in rows)} launched", flush=True)
    for e in sorted(rows, key=lambda e: -e.device_time_total)[:top]:
        print(f"  {e.device_time_total / 1e3:8.3f} ms {e.count:4d}x  {e.key[:120]}", flush=True)


def step_kernels(session: VlaSession, config, obs: dict) -> None:
    """One denoising step's kernels: ours (the step program's run, the prefix's keys and values in its
    buffers) beside torch.compile of the model's own velocity in fp16 over the same observation."""
    half = {k: torch.from_numpy(v).cuda() for k, v in obs.items()}
    half = {k: v.half() if v.dtype == torch.float32 else v for k, v in half.items()}
    feeds = {"x_t": obs["noise"], "time": np.full((1,), 0.5, np.float32), "state": obs["state"].reshape(1, -1),
             **session.cache}
    kernel_table(lambda: session.sessions["step"].run(feeds), "ours, one step")
    model = build_vla(config).cuda().half()
    with torch.no_grad():
        keys, values = model.prefix_cache(model.prefix_embeds(model.image_features(half["pixel_values"]), half["tokens"]))
        now, velocity = torch.full((1,), 0.5, dtype=torch.float16, device="cuda"), torch.compile(model.velocity)
        kernel_table(lambda: velocity(half["noise"], now, half["state"], keys, values), "torch.compile(velocity)")


def ours(bundle: Path, obs: dict, steps: int, repeats: int, kernels_of=None) -> dict:
    """shard's bundle on the cuda backend; `kernels_of`, the model's config: one step's kernels printed too,
    and the whole observation's."""
    with VlaSession(bundle, backend="cuda") as session:
        print("stage forms:\n" + stage_forms(session), flush=True)
        replays = {f"{program}/{stage}": kept for program, s in session.sessions.items()
                   for stage, kept in stage_replays(torch, s).items()}
        act = lambda: session.act(obs["pixel_values"], obs["tokens"], obs["state"], obs["noise"], steps)  # noqa: E731
        actions = act().actions
        if session.passed_over:
            print(f"passed over: {session.passed_over}", flush=True)
        if kernels_of is not None:
            step_kernels(session, kernels_of, obs)
            if session.wholes.get(steps) is not None:
                kernel_table(session.wholes[steps].replay, "ours, one observation", top=30)
        host = timed(act, repeats)
        parts = [act().seconds for _ in range(repeats)]
        whole = session.wholes.get(steps)
        timed_inside = whole is not None and bool(whole.marks)
        # GPU time as the PyTorch sides': the observation's graph replayed back to back (its copies in
        # and out included); the programs one after another wait on the host between them
        gpu = gpu_seconds(whole.replay, repeats, whole.stream) if whole is not None else gpu_seconds(act, repeats)
        session.wholes[steps] = None   # the same session, its programs run one after another
        apart = timed(act, repeats), gpu_seconds(act, repeats)
        same = np.array_equal(actions, act().actions)
    split = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
    print(f"shard: {1e3 * host:.2f} ms host to host, {1e3 * gpu:.2f} ms GPU"
          + (" (the graph's replays back to back)" if whole is not None else " (the host between the programs)") + "; "
          + ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in split.items())
          + (" (GPU time inside the observation's graph)" if timed_inside else " (host to host)")
          + f"; the programs one after another (each its own graph, "
            f"the loop one graph): {1e3 * apart[0]:.2f} ms host to host, {1e3 * apart[1]:.2f} ms GPU with the "
            f"host between them, "
            f"{'the same' if same else 'NOT the same'} action chunk bit for bit", flush=True)
    return {"host_s": host, "gpu_s": gpu, "actions": actions, "parts": split, "replays": replays}


def build(name: str, depth: int | None, work: Path, bundles: dict[str, Path], reuse: bool, target: str,
          profile: Path | None, warm: dict | None = None, steps: int = 10) -> None:
    """The VLA exported into `work` and compiled for `target` in each precision (`reuse`: what is there
    kept); the compile's prediction printed. `warm`: main's observation, each bundle then loaded on the
    cuda backend and acting on it once at `steps` steps (its forms compiled into torch.compile's caches),
    nothing timed."""
    if not reuse:
        t0 = time.perf_counter()
        export_vla(name, work / "pi0.vla", depth=depth)
        print(f"exported in {time.perf_counter() - t0:.1f} s", flush=True)
    for precision, bundle in bundles.items():
        if not (reuse and bundle.is_dir()):
            t0 = time.perf_counter()
            options = CompileOptions(precision=precision, profile=str(profile) if profile else None)
            result = compile_vla(work / "pi0.vla", target, bundle, options)
            print(f"compiled {precision} for {target} in {time.perf_counter() - t0:.1f} s"
                  + (f"; {result.actions.line()}" if result.actions else "")
                  + (f"; {result.predicted.line(target)}" if result.predicted else ""), flush=True)
        if warm is not None:
            t0 = time.perf_counter()
            with VlaSession(bundle, backend="cuda") as session:
                session.act(warm["pixel_values"], warm["tokens"], warm["state"], warm["noise"], steps)
            print(f"{precision}: loaded and acted once in {time.perf_counter() - t0:.1f} s", flush=True)


def predictions(bundle: Path, replays: dict[str, tuple[str, float]], target: str) -> None:
    """Each program's stage as the compile predicted it on `target`'s profile (report.json) beside its
    replay as loaded (the form kept)."""
    for name in PROGRAMS:
        for row in json.loads((bundle / name / "report.json").read_text())["passes"]["stages"]["stages"]:
            form, measured = replays[f"{name}/{row['stage']}"]
            print(f"  {name}/{row['stage']} ({form}): measured {1e3 * measured:.3f} ms, predicted on {target}'s profile "
                  f"{1e3 * row['predicted_s']:.3f} ms, measured/predicted {measured / row['predicted_s']:.2f}",
                  flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="pi0", choices=sorted(CONFIGS))
    parser.add_argument("--depth", type=int, default=None, help="layers of the prefix and the expert (default: all)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--work", default=None, help="where the VLA folder and the bundle go; with --reuse, read back")
    parser.add_argument("--reuse", action="store_true", help="the bundle already in --work: no export, no compile")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"PyTorch sides to run, of {', '.join(SIDES)}")
    parser.add_argument("--precision", default="fp16", help="ours in each of these (fp16, fp8, w4a16), fp16 first")
    parser.add_argument("--target", default="thor", choices=GPU_TARGETS,
                        help="thor: the compile predicts on Thor's profile; cuda: on this GPU's, probed first "
                             "(shard probe --target cuda, no --ops), each program's prediction printed beside "
                             "its measured replay")
    parser.add_argument("--warm-only", action="store_true",
                        help="export and compile ours, make each side asked and load ours once, time nothing: "
                             "fills torch.compile's caches on a fresh machine for a --reuse call after it")
    parser.add_argument("--kernels", action="store_true", help="also print one step's kernels, ours and "
                                                               "torch.compile's of the model's velocity, and a "
                                                               "whole observation's, ours and torch.compile's")
    args = parser.parse_args()
    sides_asked = [s for s in args.sides.split(",") if s]
    if set(sides_asked) - set(SIDES):
        parser.error(f"--sides {', '.join(sorted(set(sides_asked) - set(SIDES)))}: the sides are {', '.join(SIDES)}")
    if args.reuse and not args.work:
        parser.error("--reuse reads the bundle an earlier call left in --work: give --work")
    config = CONFIGS[args.model] if args.depth is None else with_depth(CONFIGS[args.model], args.depth)
    work = Path(args.work or tempfile.mkdtemp(prefix="vla-"))
    work.mkdir(parents=True, exist_ok=True)   # --target cuda writes its profile there first
    obs = observation(config)
    precisions = list(dict.fromkeys(["fp16", *[p for p in args.precision.split(",") if p]]))
    bundles = {p: work / ("pi0.shard" if p == "fp16" else f"pi0-{p}.shard") for p in precisions}
    # ours exported and compiled in a process of its own while the PyTorch sides are made (torch.compile
    # compiles for minutes); everything is timed after both, one side at a time
    profile = work / "cuda.profile.json" if args.target == "cuda" else None
    if profile is not None and not profile.exists():   # first, on a GPU nothing else runs on yet
        t0 = time.perf_counter()
        probe_cuda().save(profile)
        print(f"probed this GPU in {time.perf_counter() - t0:.1f} s", flush=True)
    if args.warm_only:   # each side made in a process of its own beside ours: torch.compile's modes compile at once
        with ProcessPoolExecutor(1 + len(sides_asked), mp_context=multiprocessing.get_context("spawn")) as pool:
            jobs = [pool.submit(build, args.model, args.depth, work, bundles, args.reuse, args.target, profile, obs,
                                args.steps),
                    *(pool.submit(warm_side, config, obs, args.steps, side) for side in sides_asked)]
            for job in jobs:
                job.result()
        print("nothing timed (--warm-only)", flush=True)
        return
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        building = pool.submit(build, args.model, args.depth, work, bundles, args.reuse, args.target, profile,
                               None, args.steps)
        model = build_vla(config).cuda()
        with torch.no_grad():   # the fp32 reference
            inputs = [torch.from_numpy(obs[k]).cuda() for k in ("pixel_values", "tokens", "state", "noise")]
            reference = model.sample_actions(*inputs, steps=args.steps).cpu().numpy()
        made = pytorch_sides(model, obs, args.steps, sides_asked)
        building.result()
    # first: the figure this bench is for
    mine = ours(bundles["fp16"], obs, args.steps, args.repeats, config if args.kernels else None)
    others = {p: ours(b, obs, args.steps, args.repeats) for p, b in bundles.items() if p != "fp16"}
    print(f"shard: actions against fp32: {figures(mine['actions'], reference)}", flush=True)
    if args.target == "cuda":
        print("each program's stage, predicted on this GPU's profile (no --ops):", flush=True)
        predictions(bundles["fp16"], mine["replays"], args.target)
    for precision, side in others.items():
        f = figures(side["actions"], reference)
        print(f"shard {precision}: {mine['gpu_s'] / side['gpu_s']:.3f}x our fp16 on GPU time, "
              f"{mine['host_s'] / side['host_s']:.3f}x host to host; actions against fp32: cosine {f['cosine']:.6f}, "
              f"max abs {f['max_abs']:.4f}, MSE {f['mse']:.2e} = {f['mse'] / f['scale']:.2e} of their scale", flush=True)
    time_sides(made, args.repeats)
    if args.kernels:
        for name in (n for n in made if n.startswith("compile")):
            kernel_table(made[name]["forward"], f"{name}, one observation", top=30)
    sides = {**made, "shard": mine,
             **{f"shard {p}": side for p, side in others.items()}}
    for name, side in sides.items():
        f = figures(side["actions"], reference)
        side.update(f)
        print(f"{name}: actions against fp32: cosine {f['cosine']:.6f}, max abs {f['max_abs']:.4f}, "
              f"MSE {f['mse']:.2e} of a scale {f['scale']:.3f}")
    missing = {"host_s": float("nan"), "gpu_s": float("nan")}   # a side that failed
    compiled = [s for n, s in sides.items() if n.startswith("compile")] or [missing]
    best = min(compiled, key=lambda s: s["host_s"])
    best_gpu = min(s["gpu_s"] for s in compiled)
    print(f"RESULT depth={config.prefix.depth} steps={args.steps} ours_ms={1e3 * mine['host_s']:.2f} "
          f"vs_eager={sides.get('eager', missing)['host_s'] / mine['host_s']:.3f} "
          f"vs_eager_graph={sides.get('eager graph', missing)['host_s'] / mine['host_s']:.3f} "
          f"vs_best_compile={best['host_s'] / mine['host_s']:.3f} gpu_vs_best_compile={best_gpu / mine['gpu_s']:.3f} "
          f"cosine={mine['cosine']:.6f} parts_ms=" + ",".join(f"{k}:{1e3 * v:.2f}" for k, v in mine["parts"].items()))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "vla.txt").write_text(repr({n: {k: v for k, v in s.items()
                                                                 if k not in ("actions", "forward", "replays")}
                                                             for n, s in sides.items()}))


if __name__ == "__main__":
    main()
