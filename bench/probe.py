"""How fast `shard probe` finds a limit, cold and from its cache, measured in one run.

    python bench/probe.py [--families add-width] [--jobs 2]

Runs `shard probe --families F` twice against a fresh cache directory: the first run builds every
point, the second is served from the cache. Prints each run's wall time (the whole command) and
the limit found for the first family's first setting.
Ends with: RESULT add_width=... builds=... all_builds=... seconds=... cached_seconds=...
(builds: of the first setting, h1; all_builds and seconds: the whole command, every setting)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def probe(families: str, jobs: int, cache: Path, out: Path) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "shard", "probe", "--families", families, "--jobs", str(jobs),
                    "--cache-dir", str(cache), "-o", str(out), "--replace"], check=True, capture_output=True)
    return time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="add-width")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    print(f"machine: {os.cpu_count()} cores; families: {args.families}; jobs: {args.jobs}")
    with tempfile.TemporaryDirectory() as tmp:
        cache, out = Path(tmp) / "cache", Path(tmp) / "profile.json"
        cold = probe(args.families, args.jobs, cache, out)
        limits = json.loads(out.read_text())["limits"]
        warm = probe(args.families, args.jobs, cache, out)
    builds = {name: int(lim["source"].split(", ")[1].split()[0]) for name, lim in limits.items()}
    for name, lim in limits.items():
        print(f"{name}: {lim['value']} (first failing {lim['failing']}, {lim['failure']}), {builds[name]} builds")
    print(f"cold: {cold:.1f} s, {sum(builds.values())} builds; from the cache: {warm:.1f} s")
    first = next(iter(limits))
    print(f"RESULT {first.split('@')[0].replace('-', '_')}={limits[first]['value']} builds={builds[first]} "
          f"all_builds={sum(builds.values())} seconds={cold:.1f} cached_seconds={warm:.1f}")


if __name__ == "__main__":
    main()
