"""The simulator's fidelity check, composed shard by shard.

A session on the simulator holds a whole bundle in one process and builds every shard again there
(the simulator runs only what its own process built): the compile's peak memory, one build after
another. Here each bundle's shards run in their order over every sample at once, each fed the outputs
its own bundle's earlier shards made (end to end, as a session runs a frame), so the figures are a
session's. Each shard is built for the simulator once for every bundle that holds it (the same
artifact: a shard the passes did not change is shard's and the vendor alone's alike), in its own
toolkit worker, and released before that worker takes the next: the check holds one shard per worker,
and the next shards build while the one before runs.

Each shard's outputs on the samples are kept in the build cache's folder (RunCache) by what decides
them: the samples, the toolkit, and the bundle's shards up to it (their builds' hashes, edges and the
host steps before them). A compile whose first shards are those of an earlier one (one layer's
weights changed further on) runs only the shards from the change on.
"""

from __future__ import annotations

import hashlib
import json
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from shard.bundle import Manifest, ShardSpec, read_manifest
from shard.cache_folder import entry_file, store_entry
from shard.compare import Comparison, worst_of
from shard.compilation.state import Progress
from shard.graph import give_back_freed
from shard.runtime import frame_inputs
from shard.runtime.host import load_tables, run_host, step_files
from shard.verifier import compared, reference_session


class OneShardAtATime(Protocol):
    """A target's simulator holding one shard per worker (shard.targets.rknn.simulate.ShardByShard)."""
    backend: str
    workers: int

    def loaded(self, bundle: Path, manifest: Manifest, shard: ShardSpec): ...


@dataclass
class Side:
    """One bundle in the check: its frames (per sample, every tensor made so far) and, per shard, whether
    its outputs are in them."""
    bundle: Path
    manifest: Manifest
    frames: list[dict[str, np.ndarray]]
    ready: list[threading.Event] = field(init=False)

    def __post_init__(self) -> None:
        self.ready = [threading.Event() for _ in self.manifest.shards]


def composed_worst(bundles: list[Path], model: Path, samples: list[dict[str, np.ndarray]],
                   simulator: OneShardAtATime, progress: Progress = lambda *a: None,
                   cache: RunCache | None = None) -> list[Comparison]:
    """Each bundle's worst output against onnxruntime on the simulator over `samples` (a NaN is the
    worst), as simulator_worst gives it, shard by shard; `cache`: the shards' runs kept before."""
    # first: onnxruntime's memory is given back before the simulator's workers take theirs
    manifests = [read_manifest(bundle) for bundle in bundles]
    references = reference_outputs(model, manifests[0], samples)
    sides = []
    for bundle, manifest in zip(bundles, manifests):
        tables = load_tables(bundle, manifest.host_pre)
        frames = [run_host(manifest.host_pre, frame_inputs(manifest, simulator.backend, s), tables) for s in samples]
        sides.append(Side(bundle, manifest, frames))
    run_in_order(sides, simulator, progress, cache or RunCache(None, "", samples))
    for side in sides:   # the host steps after the shards
        for frame in side.frames:
            run_host(side.manifest.host_post, frame, contiguous=False)
    return [worst_of(compared(side.manifest.outputs, references, side.frames)[1]) for side in sides]


def reference_outputs(model: Path, manifest: Manifest, samples: list[dict[str, np.ndarray]]
                      ) -> list[dict[str, np.ndarray]]:
    """onnxruntime's values of the model's outputs on each sample (no edge asked of it, which would keep
    it from fusing), its memory handed back after."""
    session = reference_session(model, manifest)
    feeds = {i.name for i in session.get_inputs()}
    names = [o.name for o in session.get_outputs()]
    outputs = [dict(zip(names, session.run(names, {k: v for k, v in s.items() if k in feeds}))) for s in samples]
    del session
    give_back_freed()
    return outputs


def groups(sides: list[Side]) -> list[list[tuple[Side, int]]]:
    """The (bundle, shard index) pairs one simulator build serves: a shard's place in every bundle whose
    shard there is the same artifact; in the shards' order."""
    by_build: dict[tuple, list[tuple[Side, int]]] = {}
    for n, side in enumerate(sides):
        for k, shard in enumerate(side.manifest.shards):
            artifact = shard.built_from.get("artifact")
            by_build.setdefault((k, artifact) if artifact else (k, f"bundle {n}"), []).append((side, k))
    return sorted(by_build.values(), key=lambda group: group[0][1])


def run_in_order(sides: list[Side], simulator: OneShardAtATime, progress: Progress, cache: RunCache) -> None:
    """Every group of groups() on its own worker, in order: a group's shards wait for their bundle's
    shard before them once built, so the next builds overlap the runs; a failure wakes every waiter."""
    work = groups(sides)
    failed = threading.Event()
    done = []
    label = "fidelity on the simulator, shard by shard"
    progress(label, 0, len(work))

    def run(group: list[tuple[Side, int]]) -> None:
        try:
            run_group(group, simulator, failed, cache)
        except BaseException:
            failed.set()
            for side in sides:
                for event in side.ready:
                    event.set()
            raise
        done.append(group)
        progress(label, len(done), len(work))

    with ThreadPoolExecutor(max_workers=max(1, simulator.workers)) as pool:
        futures = [pool.submit(run, group) for group in work]   # in order: a group waits only on earlier ones
        wait(futures, return_when=FIRST_EXCEPTION)
        failed_first = next((f for f in futures if f.done() and f.exception()), None)
        if failed_first is not None:
            failed.set()
            for future in futures:
                future.cancel()
            raise failed_first.exception()


def run_group(group: list[tuple[Side, int]], simulator: OneShardAtATime, failed: threading.Event,
              cache: RunCache) -> None:
    """One shard built once and run for each bundle that holds it, over all its frames; where its
    outputs there were kept before (cache), they are taken, and where all were, nothing is built."""
    todo = []
    for side, k in group:
        key = cache.key(side, k)
        kept = cache.get(key, len(side.frames))
        if kept is None:
            todo.append((side, k, key))
            continue
        if k:   # ready means every shard before it is in the frames too
            side.ready[k - 1].wait()
        for frame, outputs in zip(side.frames, kept):
            frame.update(outputs)
        side.ready[k].set()
    if not todo:
        return
    first, k = todo[0][:2]
    with simulator.loaded(first.bundle, first.manifest, first.manifest.shards[k]) as run:
        for side, k, key in todo:
            if k:
                side.ready[k - 1].wait()
            if failed.is_set():
                return
            shard = side.manifest.shards[k]
            made = [run({t.name: frame[t.name] for t in shard.inputs}) for frame in side.frames]
            for frame, outputs in zip(side.frames, made):
                frame.update(outputs)
            cache.put(key, made)
            side.ready[k].set()


class RunCache:
    """Each shard's outputs on the check's samples, in a cache folder (None: nothing kept), by what
    decides them: `salt` (the target and its toolkit), the samples, and its bundle's shards up to it
    (their builds' hashes, edges and options) with the host steps before them and their tables' hashes."""

    def __init__(self, root: Path | None, salt: str, samples: list[dict[str, np.ndarray]]):
        self.root = root
        digest = hashlib.sha256(salt.encode())
        for sample in samples:
            for name in sorted(sample):
                array = np.ascontiguousarray(sample[name])
                digest.update(json.dumps([name, array.dtype.str, list(array.shape)]).encode())
                digest.update(array.tobytes())
        self.base = digest.hexdigest()

    def key(self, side: Side, k: int) -> str | None:
        """The entry of shard k of a bundle; None where a shard up to it has no build hashes."""
        shards = side.manifest.shards[:k + 1]
        if self.root is None or not all(s.built_from for s in shards):
            return None
        tables = {f: side.manifest.files.get(f) for step in side.manifest.host_pre for f in step_files(step)}
        what = [self.base, side.manifest.build, side.manifest.host_pre, tables,
                [[s.built_from, s.build_options, [(t.name, t.shape, t.dtype) for t in (*s.inputs, *s.outputs)],
                  s.edge_shapes, s.edge_scales] for s in shards]]
        return "r" + hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()

    def get(self, key: str | None, samples: int) -> list[dict[str, np.ndarray]] | None:
        found = entry_file(self.root, key, "outputs.npz") if key else None   # marks it used
        if found is None:
            return None
        try:
            with np.load(found, allow_pickle=False) as stored:
                kept = [{} for _ in range(samples)]
                for name in stored.files:
                    n, tensor = name.split("/", 1)
                    kept[int(n)][tensor] = stored[name]
        except (OSError, ValueError, IndexError):   # evicted under our feet, or not whole
            return None
        return kept

    def put(self, key: str | None, outputs: list[dict[str, np.ndarray]]) -> None:
        if key is None:
            return
        arrays = {f"{n}/{name}": array for n, made in enumerate(outputs) for name, array in made.items()}
        store_entry(self.root, key, lambda staging: np.savez(staging / "outputs.npz", **arrays))
