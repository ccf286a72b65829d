"""The runtime's cost and its pipelining, on the cpu backend, measured side by side in one run.

    python bench/runtime.py --bundle build/siglip-base-512.shard --model build/siglip-base-512.onnx

Each "core" is one onnxruntime session per shard with one intra-op thread (what the cpu backend does).
(a) latency of one frame through the bundle on one core vs one onnxruntime session of the whole
    model with one thread, alternated run by run, medians compared: overhead = bundle / whole.
(b) run_stream throughput with 1, 2 and 3 cores, each schedule: streamN = frames/s on N cores /
    frames/s on one.
    Beside each: the rate the compile report's model predicts (shard.runtime.scheduler.predict_stream)
    from each shard's time alone on one core.
(c) the machine's own ceiling: N whole-model sessions in N threads at once vs one alone.
Ends with: RESULT overhead=... stream2=... stream3=... predicted3=... pred_error3=... cores=... schedule=...
(--schedule picks which; predicted3 as a multiple of one core's measured rate, pred_error3 = |measured -
predicted| / measured on 3 cores)
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

import shard
from shard.bundle import read_manifest
from shard.runtime import random_inputs
from shard.runtime.scheduler import DEFAULT_SCHEDULE, SCHEDULES, predict_stream


def whole_model_session(model: Path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    return ort.InferenceSession(str(model), opts, providers=["CPUExecutionProvider"])


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def stream_rate(bundle: Path, cores: list[int], frames: list[dict], schedule: str) -> tuple[float, list]:
    with shard.load(bundle, backend="cpu", cores=cores, schedule=schedule) as session:
        for _ in session.run_stream(frames[:2 * len(cores)]):  # every core's first runs stay out of it
            pass
        session.executions.clear()
        started = time.perf_counter()
        for _ in session.run_stream(frames):
            pass
        rate = len(frames) / (time.perf_counter() - started)
        return rate, session.core_use()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", type=Path, default=Path("build/siglip-base-512.shard"))
    ap.add_argument("--model", type=Path, default=Path("build/siglip-base-512.onnx"))
    ap.add_argument("--runs", type=int, default=5, help="latency runs of each side")
    ap.add_argument("--frames", type=int, default=12, help="frames per stream")
    ap.add_argument("--schedule", default=DEFAULT_SCHEDULE, choices=SCHEDULES, help="the schedule the RESULT line reports")
    args = ap.parse_args()

    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.processor() or platform.platform()}")
    manifest = read_manifest(args.bundle)
    frames = [random_inputs(manifest.inputs, seed) for seed in range(args.frames)]

    whole = whole_model_session(args.model)
    out_name = manifest.outputs[0].name
    with shard.load(args.bundle, backend="cpu", cores=[0]) as session:
        reference = whole.run([out_name], frames[0])[0]
        got = session.run(frames[0])[out_name]
        print(f"bundle vs whole model on frame 0: max abs diff {float(np.abs(got - reference).max()):.3g}")
        bundle_s, whole_s = [], []
        for _ in range(args.runs):
            bundle_s.append(timed(lambda: session.run(frames[0])))
            whole_s.append(timed(lambda: whole.run([out_name], frames[0])))
        timings = session.timings
        shard_s = [statistics.median(timings[s.name].seconds) for s in manifest.shards]   # each alone, one core
    whole = None  # free the whole-model session before the streams
    overhead = statistics.median(bundle_s) / statistics.median(whole_s)
    print(f"(a) latency, median of {args.runs}: bundle on 1 core {1000 * statistics.median(bundle_s):.0f} ms, "
          f"whole model 1 thread {1000 * statistics.median(whole_s):.0f} ms -> overhead {overhead:.3f}x")

    rates = {(1, "any"): stream_rate(args.bundle, [0], frames, "round-robin")}
    print_rate("(b) run_stream", 1, "one core", rates[(1, "any")], rates[(1, "any")][0])
    predicted = {}
    for n in (2, 3):
        for schedule in SCHEDULES:
            rates[(n, schedule)] = stream_rate(args.bundle, list(range(n)), frames, schedule)
            print_rate("(b) run_stream", n, schedule, rates[(n, schedule)], rates[(1, "any")][0])
            # the report's model (shard.runtime.scheduler.predict_stream) fed each shard's time alone
            predicted[(n, schedule)] = predict_stream(manifest.shards, shard_s, list(range(n)), schedule)[1]
            print(f"    predicted from each shard's time alone: {predicted[(n, schedule)]:.3f} frames/s "
                  f"(measured / predicted {rates[(n, schedule)][0] / predicted[(n, schedule)]:.2f})")
    for n in (2, 3):
        print(f"(c) machine ceiling: {n} whole-model sessions in {n} threads at once: "
              f"{parallel_whole_models(args.model, frames[0], n):.2f}x one alone")
    base = rates[(1, "any")][0]
    measured3, predicted3 = rates[(3, args.schedule)][0], predicted[(3, args.schedule)]
    print(f"RESULT overhead={overhead:.3f} stream2={rates[(2, args.schedule)][0] / base:.2f} "
          f"stream3={measured3 / base:.2f} predicted3={predicted3 / base:.2f} "
          f"pred_error3={abs(measured3 - predicted3) / measured3:.2f} cores={os.cpu_count()} schedule={args.schedule}")


def print_rate(label: str, cores: int, schedule: str, measured: tuple[float, list], base: float) -> None:
    rate, use = measured
    busy = ", ".join(f"core {u.core} {100 * u.utilisation:.0f}%" for u in use)
    print(f"{label}, {cores} core(s), {schedule}: {rate:.3f} frames/s ({rate / base:.2f}x); busy: {busy}")


def parallel_whole_models(model: Path, frame: dict, threads: int, runs: int = 3) -> float:
    """Throughput of `threads` independent whole-model sessions run at once, relative to one alone."""
    sessions = [whole_model_session(model) for _ in range(threads)]
    for s in sessions:
        s.run(None, frame)
    alone = timed(lambda: [sessions[0].run(None, frame) for _ in range(runs)]) / runs
    workers = [threading.Thread(target=lambda s=s: [s.run(None, frame) for _ in range(runs)]) for s in sessions]
    together = timed(lambda: ([w.start() for w in workers], [w.join() for w in workers])) / (runs * threads)
    return alone / together

if __name__ == "__main__":
    main()
