"""The corpus and a probe on Ray beside the process pool, measured side by side on this machine.

    python bench/ray_scale.py [--set ci] [--cpus 1,2,4] [--families F,...]

1. `bench/corpus.py --set ci` as it runs by default (models one after another, each compile's
   builds 2 at a time on the local process pool), then with `--ray local --ray-cpus N` for each N
   (each model a Ray task of one CPU): wall time, models a minute, the ratio to the pool, and
   whether the RESULT line is the same. Each run starts from empty build and point caches.
2. The scaling to M machines of this size, predicted from the per-model times of the run with the
   fewest workers (each model without a neighbour): what that run spent besides its models (the
   exports, Ray's start), then the models spread over 2 x M CPUs, no run shorter than its longest
   model (a model is one task); beside it, the 2-worker run measured.
3. A probe of rk3588 (every family, or `--families`) on two Ray nodes started on this machine by
   `ray start --head` and `ray start --address` (the second on 127.0.0.2, with one CPU each and a
   resource of its own; token authentication, the token made here), against the same probe on the
   process pool, each from an empty point cache: whether the limits are identical (their evidence
   less the times in the toolkit's log lines). Both nodes end with the bench.

Ends with one RESULT line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}   # every Ray node on 127.0.0.1


def corpus(work: Path, which: str, flags: list[str]) -> dict:
    """One corpus run: its seconds, RESULT line and per-model seconds."""
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=work))
    rows = run_dir / "rows.json"
    caches = {"SHARD_BUILD_CACHE": str(run_dir / "builds"), "SHARD_PROBE_CACHE": str(run_dir / "points")}   # cold, each
    started = time.monotonic()
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "corpus.py"), "--set", which, "--json", str(rows), *flags],
                         capture_output=True, text=True, env={**os.environ, **LOOPBACK, **caches})
    seconds = time.monotonic() - started
    if run.returncode != 0:
        raise SystemExit(f"corpus {' '.join(flags)} failed:\n{run.stderr[-2000:]}")
    result = next(line for line in run.stdout.splitlines() if line.startswith("RESULT"))
    models = [r["shard"]["seconds"] + r["vendor"]["seconds"] for r in json.loads(rows.read_text())]
    return {"seconds": seconds, "result": result, "models": models}


def probe(work: Path, name: str, families: str | None, address: str | None, env: dict | None = None) -> dict:
    """A probe from an empty point cache (on the Ray cluster at `address`, reached with `env`); the
    profile's limits, each with its evidence less the times the toolkit's log lines carry."""
    out = work / f"{name}.json"
    flags = ["--ray", address] if address else []
    flags += ["--families", families] if families else []
    run = subprocess.run([sys.executable, "-m", "shard", "probe", "--target", "rk3588",
                          "--cache-dir", str(work / f"{name}-points"), "-o", str(out), "--replace", *flags],
                         capture_output=True, text=True, env=env or {**os.environ, **LOOPBACK})
    if run.returncode != 0:
        raise SystemExit(f"probe {name} failed:\n{run.stderr[-2000:]}")
    limits = json.loads(out.read_text())["limits"]
    for limit in limits.values():   # the toolkit's log lines carry the time they were written
        limit["evidence"] = re.sub(r"\[\d\d:\d\d:\d\d\.\d+\]", "[time]", limit.get("evidence") or "")
    return limits


def two_nodes(work: Path, families: str | None) -> tuple[bool, int, float]:
    """The probe on two Ray nodes of this machine against the process pool: (identical, nodes, seconds)."""
    env = {k: v for k, v in os.environ.items() if k not in LOOPBACK}   # `ray start` refuses a second node with it
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    ray = [str(Path(sys.executable).with_name("ray")), "start", "--num-cpus=1", "--disable-usage-stats", "--block"]
    nodes = []
    try:
        for args in (["--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--include-dashboard=false"],
                     [f"--address=127.0.0.1:{port}", "--node-ip-address=127.0.0.2", '--resources={"second_node": 1}']):
            nodes.append(subprocess.Popen([*ray, *args], env=env, stdout=open(work / f"node{len(nodes)}.log", "w"),
                                          stderr=subprocess.STDOUT))
            alive = alive_nodes(port, env, len(nodes))
        started = time.monotonic()
        remote = probe(work, "ray", families, f"127.0.0.1:{port}", env)
        seconds = time.monotonic() - started
    finally:
        for node in reversed(nodes):   # `ray start --block` stops its node when it ends
            node.terminate()
            node.wait(timeout=120)
    local = probe(work, "pool", families, None)
    return remote == local, alive, seconds


def alive_nodes(port: int, env: dict, want: int) -> int:
    """The nodes alive in the cluster at 127.0.0.1:`port` once `want` are (SystemExit after 2 minutes)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        status = subprocess.run([str(Path(sys.executable).with_name("ray")), "status", f"--address=127.0.0.1:{port}"],
                                capture_output=True, text=True, env=env)
        alive = len(re.findall(r"^ 1 node_", status.stdout, flags=re.M))
        if alive >= want:
            return alive
        time.sleep(2)
    raise SystemExit(f"the Ray cluster at 127.0.0.1:{port} has not {want} nodes after 2 minutes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", default="ci")
    parser.add_argument("--cpus", default="1,2,4", help="Ray CPUs of the local cluster, one corpus run each")
    parser.add_argument("--families", default=None, help="the probe's families on two nodes [default: all]")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="shard-ray-scale-") as tmp:   # its bundles and models: hundreds of MB
        work = Path(tmp)
        print(f"{os.cpu_count()} CPUs here; corpus --set {args.set}", flush=True)
        pool = corpus(work, args.set, [])
        print(f"process pool (--jobs 2)  {pool['seconds']:7.1f} s  {60 * len(pool['models']) / pool['seconds']:5.1f} "
              f"models/min  x1.00", flush=True)
        runs = {}
        for cpus in [int(c) for c in args.cpus.split(",")]:
            run = runs[cpus] = corpus(work, args.set, ["--ray", "local", "--ray-cpus", str(cpus)])
            same = "same RESULT" if run["result"].split(" ", 1)[1] == pool["result"].split(" ", 1)[1] else \
                f"RESULT differs: {run['result']}"
            print(f"ray, {cpus} worker(s)        {run['seconds']:7.1f} s  {60 * len(run['models']) / run['seconds']:5.1f} "
                  f"models/min  x{pool['seconds'] / run['seconds']:.2f}  {same}", flush=True)
        print(pool["result"])
        alone = runs[min(runs)]   # each model without a neighbour on the cluster
        total, longest = sum(alone["models"]), max(alone["models"])
        serial = max(0.0, alone["seconds"] - total) if min(runs) == 1 else 0.0   # exports, Ray's start: not spread
        predicted = {m: serial + max(longest, total / (2 * m)) for m in (1, 2, 4, 8, 16)}
        print(f"per model (the {min(runs)}-worker run): {total:.0f} s in all, the longest {longest:.1f} s, {serial:.0f} s "
              f"besides; predicted on M machines of 2 CPUs (one model a task): "
              + ", ".join(f"M={m} {s:.0f} s" for m, s in predicted.items())
              + (f" (measured here with 2 workers: {runs[2]['seconds']:.0f} s)" if 2 in runs else ""), flush=True)
        identical, nodes, seconds = two_nodes(work, args.families)
        print(f"probe of rk3588 ({args.families or 'every family'}) on {nodes} Ray nodes in {seconds:.1f} s: "
              f"{'identical limits' if identical else 'limits DIFFER'} to the process pool's", flush=True)
        same = all(r["result"].split(" ", 1)[1] == pool["result"].split(" ", 1)[1] for r in runs.values())
        print(f"RESULT same_result={'yes' if same else 'no'} "
              + " ".join(f"speedup_{c}={pool['seconds'] / r['seconds']:.2f}" for c, r in runs.items())
              + f" probe_identical={'yes' if identical else 'no'} probe_nodes={nodes} "
              f"predicted_8_machines_s={predicted[8]:.0f}")


if __name__ == "__main__":
    main()
