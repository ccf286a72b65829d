"""shard compile vs one vendor build of the whole model: wall time and peak RSS, measured in one run.

    python bench/compile.py [--model siglip.onnx] [--jobs 2]

One vendor build is the toolkit as a user runs it (RKNN() with its defaults: config, load_onnx,
build, export_rknn), in the toolkit's environment. shard compile runs six times: cold (an empty
build cache; it also builds the model as it came with the vendor alone, and each rewritten shard's
unrewritten twin), warm (the same model again: its bundle comes from the cache, shard.bundle_cache),
the model with one linear's weights changed (the cache warm: only the shard holding it builds again;
the vendor alone's figures are those of the cold run's build of the same graph), cold with the
vendor alone shard by shard (--vendor-alone shards: each shard's build without its rewrites, what a
compile does where the whole build does not fit the machine), the same with 12 shards (smaller
builds), and cold without the vendor-alone comparison (--no-vendor-baseline). Peak RSS is sampled
over the whole process tree (shard plus its toolkit workers) every 50 ms.
Ends with: RESULT wall_ratio=... rss_ratio=... warm_s=... one_layer_s=... one_layer_ratio=...
wall_ratio_shards=... rss_ratio_shards=... wall_ratio_12=... rss_ratio_12=... shards=...
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


def tree_rss(root: int) -> int:
    """Resident bytes of a process and all its descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        stack.extend(children.get(pid, []))
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def measure(cmd: list[str], env: dict | None = None, cwd: Path | None = None
            ) -> tuple[float, int, subprocess.CompletedProcess]:
    """Wall seconds and peak tree RSS of a command."""
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)
    peak = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, tree_rss(proc.pid))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    out, err = proc.communicate()
    wall = time.monotonic() - started
    done.set()
    sampler.join()
    return wall, peak, subprocess.CompletedProcess(cmd, proc.returncode, out, err)


SMALL = 12   # shards of about one SigLIP layer: what smaller builds do to the compile's time and memory

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

    from shard.toolkit.env import find_python

    vendor_wall, vendor_rss, res = measure([str(find_python("rk3588")), "-I", "-c", VENDOR_BUILD, str(model.resolve()),
                                            str(work / "whole.rknn")], cwd=work)
    if res.returncode:
        sys.exit(f"vendor build failed:\n{res.stderr}")
    bundle = work / "model.shard"
    edited = one_layer_changed(model, work / "one-layer.onnx")
    runs = {}
    for label, cache, source, extra in (("cold", "cold", model, []), ("warm", "cold", model, []),
                                        ("one layer's weights changed", "cold", edited, []),
                                        ("cold, --vendor-alone shards", "by-shard", model, ["--vendor-alone", "shards"]),
                                        (f"cold, --vendor-alone shards --shards {SMALL}", "small", model,
                                         ["--vendor-alone", "shards", "--shards", str(SMALL)]),
                                        ("cold, --no-vendor-baseline", "plain", model, ["--no-vendor-baseline"])):
        env = {**os.environ, "SHARD_BUILD_CACHE": str(work / f"cache-{cache}")}
        runs[label] = measure([sys.executable, "-m", "shard", "compile", str(source), "--target", "rk3588",
                               "-o", str(bundle), "--jobs", str(args.jobs), *extra], env)
        if runs[label][2].returncode:
            sys.exit(f"shard compile ({label}) failed:\n{runs[label][2].stderr}")
    shards = len(json.loads((bundle / "manifest.json").read_text())["shards"])

    print(f"{'':66}{'wall s':>10}{'peak RSS GB':>14}")
    print(f"{'one vendor build (whole)':66}{vendor_wall:>10.1f}{vendor_rss / 1e9:>14.2f}")
    for label, (wall, rss, _) in runs.items():
        print(f"{f'shard compile, {label} (-j{args.jobs})':66}{wall:>10.1f}{rss / 1e9:>14.2f}")
    cold_wall, cold_rss, _ = runs["cold"]
    one_layer = runs["one layer's weights changed"][0]
    by_shard = runs["cold, --vendor-alone shards"]
    small = runs[f"cold, --vendor-alone shards --shards {SMALL}"]
    print(f"RESULT wall_ratio={cold_wall / vendor_wall:.2f} rss_ratio={cold_rss / vendor_rss:.2f} "
          f"warm_s={runs['warm'][0]:.1f} one_layer_s={one_layer:.1f} one_layer_ratio={one_layer / cold_wall:.2f} "
          f"wall_ratio_shards={by_shard[0] / vendor_wall:.2f} rss_ratio_shards={by_shard[1] / vendor_rss:.2f} "
          f"wall_ratio_{SMALL}={small[0] / vendor_wall:.2f} rss_ratio_{SMALL}={small[1] / vendor_rss:.2f} "
          f"shards={shards}")


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
