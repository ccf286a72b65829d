"""How long a full `shard probe` takes per chip, cold and from its cache, measured in one run.

    python bench/probe.py [--targets rk3588,rk3576,...] [--families add-width,...] [--jobs 2] [--out-dir DIR]

For each target, runs `shard probe --target T` twice against a fresh cache directory: the first run
builds every point, the second is served from the cache. Prints, per chip, the limits found, the
builds and the wall time (the whole command) of each run; with --out-dir, keeps each chip's profile
there (T.json) as the cold run wrote it.
Ends with one line per chip: RESULT target=... limits=... builds=... seconds=... cached_builds=... cached_seconds=...
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from shard.targets.chips import CHIPS  # noqa: E402


def probe(target: str, families: str | None, jobs: int, cache: Path, out: Path) -> tuple[float, int]:
    """(seconds, new builds) of one `shard probe` run."""
    started = time.perf_counter()
    cmd = [sys.executable, "-m", "shard", "probe", "--target", target, "--jobs", str(jobs), "--cache-dir", str(cache),
           "-o", str(out), "--replace"] + (["--families", families] if families else [])
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{target}: shard probe failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    builds = re.search(r"(\d+) limits, (\d+) builds", done.stdout)
    return time.perf_counter() - started, int(builds[2]) if builds else -1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", default=",".join(CHIPS))
    ap.add_argument("--families", default=None, help="[default: all]")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out-dir", type=Path, default=None)
    args = ap.parse_args()
    print(f"machine: {os.cpu_count()} cores; families: {args.families or 'all'}; jobs: {args.jobs}", flush=True)
    results = []
    for target in args.targets.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            cache, out = Path(tmp) / "cache", Path(tmp) / f"{target}.json"
            cold, builds = probe(target, args.families, args.jobs, cache, out)
            profile = json.loads(out.read_text())
            warm, cached_builds = probe(target, args.families, args.jobs, cache, Path(tmp) / "again.json")
            if args.out_dir:
                args.out_dir.mkdir(parents=True, exist_ok=True)
                shutil.copy(out, args.out_dir / f"{target}.json")
        limits = profile["limits"]
        facts = profile["facts"]
        print(f"{target}: {len(limits)} limits, cores {profile['cores']}, fp16 {facts.get('fp16')}, "
              f"peak MACs/cycle fp16 {facts.get('macs_per_cycle_fp16')} int8 {facts.get('macs_per_cycle_int8')}, "
              f"quantized {facts.get('quantized_dtypes')}; cold {cold:.1f} s ({builds} builds), "
              f"from the cache {warm:.1f} s ({cached_builds} builds)", flush=True)
        results.append(f"RESULT target={target} limits={len(limits)} builds={builds} seconds={cold:.1f} "
                       f"cached_builds={cached_builds} cached_seconds={warm:.1f}")
    print("\n".join(results))


if __name__ == "__main__":
    main()
