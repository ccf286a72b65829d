"""shard compile vs one vendor build of the whole model: wall time and peak RSS, measured in one run.

    python bench/compile.py [--model siglip.onnx] [--jobs 2]

One vendor build is the toolkit as a user runs it (RKNN() with its defaults: config, load_onnx,
build, export_rknn), in the toolkit's environment, once before the compiles and once after; the
ratios are to the mean of the two. shard compile runs six times: cold (an empty build cache, the
defaults: each rewritten shard is also built without its rewrites, and the vendor alone is built
whole only where the machine has a core for it beside the compile's builds, else it is each shard's
build without its rewrites: never_worse.whole_build_fits), warm (the same model again: its bundle
comes from the cache, shard.bundle_cache), the model with one linear's weights changed (the cache
warm: only the shard holding it builds again), cold with the whole model built by the vendor alone
beside (--vendor-alone whole), cold with one shard per NPU core (--shards 3: larger builds than the
default's, which sizes a large model's shards for half of the whole model's build memory,
shard.targets.rknn.memory.shards_for_memory), and cold without the vendor-alone comparison
(--no-vendor-baseline). Memory is sampled over the whole process tree (shard plus its toolkit
workers) every 50 ms, two ways: the sum of each process's RSS, and the sum of each process's PSS.
RSS counts a page once in every process that maps it, so the toolkit's libraries, mapped by both
workers, count twice; PSS divides a shared page among the processes that map it, so its sum is the
memory the tree holds. For one process (the vendor build) the two agree.
Ends with: RESULT wall_ratio=... rss_ratio=... pss_ratio=... warm_s=... one_layer_s=...
one_layer_ratio=... wall_ratio_whole=... rss_ratio_whole=... wall_ratio_3=... rss_ratio_3=... shards=...
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple


class Memory(NamedTuple):
    rss: int   # bytes, each process's resident set summed
    pss: int   # bytes, each process's proportional set summed: a shared page counts once over the tree


def tree_memory(root: int) -> Memory:
    """Resident memory of a process and all its descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    rss = pss = 0
    stack = [root]
    while stack:
        pid = stack.pop()
        stack.extend(children.get(pid, []))
        try:
            fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:])
        except (OSError, ValueError):   # gone, or not readable
            continue
        rss += int(fields["Rss"].split()[0]) * 1024
        pss += int(fields["Pss"].split()[0]) * 1024
    return Memory(rss, pss)


class Run(NamedTuple):
    wall: float
    peak: Memory
    done: subprocess.CompletedProcess
    timeline: list[tuple[float, Memory]]   # (seconds since the start, the tree's memory then)

    def peak_between(self, start: float, end: float) -> Memory:
        """The peak memory sampled from `start` to `end` seconds (each of RSS and PSS its own peak)."""
        inside = [m for t, m in self.timeline if start <= t <= end] or [Memory(0, 0)]
        return Memory(max(m.rss for m in inside), max(m.pss for m in inside))


def measure(cmd: list[str], env: dict | None = None, cwd: Path | None = None) -> Run:
    """Wall seconds and peak tree memory (RSS and PSS, each its own peak) of a command, and the samples."""
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)
    timeline = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            timeline.append((time.monotonic() - started, tree_memory(proc.pid)))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    out, err = proc.communicate()
    wall = time.monotonic() - started
    done.set()
    sampler.join()
    peak = Memory(max((m.rss for _, m in timeline), default=0), max((m.pss for _, m in timeline), default=0))
    return Run(wall, peak, subprocess.CompletedProcess(cmd, proc.returncode, out, err), timeline)


VENDOR_BUILD = """
import sys
from rknn.api import RKNN
onnx, out = sys.argv[1], sys.argv[2]
rknn = RKNN()   # the toolkit as a user runs it: its defaults, the target shard builds for
assert rknn.config(target_platform="rk3588") == 0
assert rknn.load_onnx(model=onnx) == 0
assert rknn.build(do_quantization=False) == 0
assert rknn.export_rknn(out) == 0
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="ONNX model [default: export siglip-base-512, 12 layers]")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-compile-"))
    try:
        run(args, work)
    finally:   # its bundles, caches and the exported model: gigabytes
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, work: Path) -> None:
    model = args.model
    if model is None:
        model = work / "siglip-base-512.onnx"
        subprocess.run([sys.executable, "-m", "shard", "zoo", "export", "siglip-base-512", "-o", str(model)],
                       check=True, capture_output=True)
    print(f"machine: {os.cpu_count()} cores; model: {model} ({model.stat().st_size / 1e6:.0f} MB)")

    from shard.targets.rknn.env import find_python

    def vendor_build() -> tuple[float, Memory]:
        wall, memory, res, _ = measure([str(find_python("rk3588")), "-I", "-c", VENDOR_BUILD, str(model.resolve()),
                                        str(work / "whole.rknn")], cwd=work)
        if res.returncode:
            sys.exit(f"vendor build failed:\n{res.stderr}")
        return wall, memory

    vendor_before = vendor_build()
    bundle = work / "model.shard"
    edited = one_layer_changed(model, work / "one-layer.onnx")
    runs, checks = {}, {}
    for label, cache, source, extra in (("cold", "cold", model, []), ("warm", "cold", model, []),
                                        ("one layer's weights changed", "cold", edited, []),
                                        ("cold, --vendor-alone whole", "whole", model, ["--vendor-alone", "whole"]),
                                        ("cold, --shards 3 (one per core)", "per-core", model, ["--shards", "3"]),
                                        ("cold, --no-vendor-baseline", "plain", model, ["--no-vendor-baseline"])):
        env = {**os.environ, "SHARD_BUILD_CACHE": str(work / f"cache-{cache}")}
        runs[label] = measure([sys.executable, "-m", "shard", "compile", str(source), "--target", "rk3588",
                               "-o", str(bundle), "--jobs", str(args.jobs), *extra], env)
        if runs[label][2].returncode:
            sys.exit(f"shard compile ({label}) failed:\n{runs[label][2].stderr}")
        report = json.loads((bundle / "report.json").read_text())
        fidelity = None if report.get("from_bundle_cache") else report["seconds"].get("fidelity")
        checks[label] = check_share(runs[label], fidelity)
        if label == "cold":
            shards = len(json.loads((bundle / "manifest.json").read_text())["shards"])
            versus = report["versus_vendor"]["line"]

    vendor_after = vendor_build()   # before and after the compiles: the machine's drift shows, and averages out
    vendor_wall = (vendor_before[0] + vendor_after[0]) / 2
    vendor_rss, vendor_pss = ((a + b) / 2 for a, b in zip(vendor_before[1], vendor_after[1]))
    print(f"{'':66}{'wall s':>10}{'peak RSS GB':>14}{'peak PSS GB':>14}")
    rows = [(f"one vendor build (whole), {label} the compiles", wall, memory)
            for label, (wall, memory) in (("before", vendor_before), ("after", vendor_after))]
    rows += [(f"shard compile, {label} (-j{args.jobs})", run.wall, run.peak) for label, run in runs.items()]
    for label, wall, memory in rows:
        print(f"{label:66}{wall:>10.1f}{memory.rss / 1e9:>14.2f}{memory.pss / 1e9:>14.2f}")
    for label, line in checks.items():
        print(f"{label}: {line}")
    cold_wall, cold = runs["cold"].wall, runs["cold"].peak
    one_layer = runs["one layer's weights changed"][0]
    whole = runs["cold, --vendor-alone whole"]
    per_core = runs["cold, --shards 3 (one per core)"]
    print(f"cold: {versus}")
    print(f"RESULT wall_ratio={cold_wall / vendor_wall:.2f} rss_ratio={cold.rss / vendor_rss:.2f} "
          f"pss_ratio={cold.pss / vendor_pss:.2f} "
          f"warm_s={runs['warm'][0]:.1f} one_layer_s={one_layer:.1f} one_layer_ratio={one_layer / cold_wall:.2f} "
          f"wall_ratio_whole={whole[0] / vendor_wall:.2f} rss_ratio_whole={whole[1].rss / vendor_rss:.2f} "
          f"wall_ratio_3={per_core[0] / vendor_wall:.2f} rss_ratio_3={per_core[1].rss / vendor_rss:.2f} "
          f"shards={shards}")


def check_share(run: Run, seconds: float | None) -> str:
    """The fidelity check's share of a compile: its seconds (the report's) of the wall, and the peak
    memory sampled while it ran (its last seconds, less the bundle's final move) beside the peak before."""
    if not seconds:
        return "no fidelity check ran (none asked, or the bundle came from the cache)"
    start = run.wall - seconds - 1.0
    during, before = run.peak_between(start, run.wall), run.peak_between(0.0, start)
    return (f"fidelity check {seconds:.1f} s of {run.wall:.1f} ({100 * seconds / run.wall:.0f} %); peak PSS "
            f"{during.pss / 1e9:.2f} GB while it ran, {before.pss / 1e9:.2f} GB before it")


def one_layer_changed(model: Path, out: Path) -> Path:
    """The model with one linear's weights (the middle one) scaled by 1.01: the shard holding it,
    and the model as it came, change; the other shards do not."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    proto = onnx.load(str(model))
    consts = {n.input[1] for n in proto.graph.node if n.op_type in ("MatMul", "Gemm", "Conv") and len(n.input) > 1}
    weights = [t for t in proto.graph.initializer if t.name in consts and len(t.dims) >= 2]
    tensor = weights[len(weights) // 2]
    tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor) * np.float32(1.01), tensor.name))
    onnx.save(proto, str(out))
    return out


if __name__ == "__main__":
    main()
