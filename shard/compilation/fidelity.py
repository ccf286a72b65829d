"""The simulator's fidelity check, composed shard by shard.

A session on the simulator holds a whole bundle in one process and builds every shard again there
(the simulator runs only what its own process built): the compile's peak memory, one build after
another. Here each bundle's shards run in their order over every sample at once, each fed the outputs
its own bundle's earlier shards made (end to end, as a session runs a frame), so the figures are a
session's.

Most runs are made before the check, where the shard was built (BuildRuns): the worker that built a
shard runs it on the simulator right after, on each chain of frames it is on (shard's bundle as it
will most likely be, the vendor alone's), and releases it. Each run is kept (Runs) by what decides
its outputs: the build (its artifact's sha256) and the arrays it was fed. The check looks each run up
and builds again only a shard whose runs no build made (a choice the chains did not foresee: a twin
kept in shard's bundle, edges relaid), once for every bundle that holds it, in its own toolkit worker,
released before that worker takes the next. Kept in the build cache's folder, the runs of a cached
build come with it: a compile whose first shards are an earlier one's (one layer's weights changed
further on) runs only the shards from the change on.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import onnx

from shard.bundle import Manifest, ShardSpec, TensorSpec, read_manifest
from shard.cache_folder import entry_file, store_entry
from shard.compare import Comparison, worst_of
from shard.compilation.names import UNREWRITTEN, VENDOR_ALONE, Progress
from shard.graph import give_back_freed, tensor_spec, value_spec
from shard.runtime import frame_inputs
from shard.runtime.executors import npu_inputs, outputs_by_name
from shard.runtime.host import load_tables, run_host
from shard.verifier import compared, reference_session

Run = tuple[list[np.ndarray], list[str]]   # the arrays a shard is fed on the simulator, and their layouts


class OneShardAtATime(Protocol):
    """A target's simulator holding one shard per worker (shard.targets.rknn.simulate.ShardByShard)."""
    backend: str
    workers: int

    def loaded(self, bundle: Path, manifest: Manifest, shard: ShardSpec): ...   # yields run(arrays, formats)


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
                   runs: Runs | None = None) -> list[Comparison]:
    """Each bundle's worst output against onnxruntime on the simulator over `samples` (a NaN is the
    worst), as bundle_worst gives it, shard by shard; `runs`: the shards' runs made before."""
    # first: onnxruntime's memory is given back before the simulator's workers take theirs
    manifests = [read_manifest(bundle) for bundle in bundles]
    references = reference_outputs(model, manifests[0], samples)
    sides = []
    for bundle, manifest in zip(bundles, manifests):
        tables = load_tables(bundle, manifest.host_pre)
        frames = [run_host(manifest.host_pre, frame_inputs(manifest, simulator.backend, s), tables) for s in samples]
        sides.append(Side(bundle, manifest, frames))
    run_in_order(sides, simulator, progress, runs or Runs(None, ""))
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


def run_in_order(sides: list[Side], simulator: OneShardAtATime, progress: Progress, runs: Runs) -> None:
    """Every group of groups() on its own worker, in order: a group's shards wait for their bundle's
    shard before them once built, so the next builds overlap the runs; a failure wakes every waiter."""
    work = groups(sides)
    failed = threading.Event()
    done = []
    label = "fidelity on the simulator, shard by shard"
    progress(label, 0, len(work))

    def run(group: list[tuple[Side, int]]) -> None:
        try:
            run_group(group, simulator, failed, runs)
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
              runs: Runs) -> None:
    """One shard's runs for each bundle that holds it, over all its frames, once its bundle's shard
    before it ran: those made before (runs) are taken; for the rest the shard is built once and run."""
    todo = []
    for side, k in group:
        if k:   # ready means every shard before it is in the frames too
            side.ready[k - 1].wait()
        if failed.is_set():
            return
        shard = side.manifest.shards[k]
        fed = [npu_inputs(shard, {t.name: frame[t.name] for t in shard.inputs}) for frame in side.frames]
        keys = [runs.key(shard.built_from.get("artifact"), digest(run)) for run in fed]
        kept = [runs.get(key) for key in keys]
        if all(outputs is not None for outputs in kept):
            fill(side, k, kept)
        else:
            todo.append((side, k, fed, keys, kept))
    if not todo:
        return
    first, k = todo[0][:2]
    runs.built_again += 1
    with simulator.loaded(first.bundle, first.manifest, first.manifest.shards[k]) as run:
        for side, k, fed, keys, kept in todo:
            if failed.is_set():
                return
            for n, key in enumerate(keys):
                if kept[n] is None:
                    kept[n] = run(*fed[n])
                    runs.put(key, kept[n])
            fill(side, k, kept)


def fill(side: Side, k: int, outputs: list[list[np.ndarray]]) -> None:
    """Shard k's outputs (as the simulator gives them) into its bundle's frames, one list per frame."""
    shard = side.manifest.shards[k]
    for frame, made in zip(side.frames, outputs):
        frame.update(outputs_by_name(shard, made))
    side.ready[k].set()


def digest(run: Run) -> str:
    """The sha256 of what a run is fed: each array's type, shape and bytes, and the layouts."""
    arrays, formats = run
    h = hashlib.sha256(json.dumps(formats).encode())
    for array in arrays:
        array = np.ascontiguousarray(array)
        h.update(json.dumps([array.dtype.str, list(array.shape)]).encode())
        h.update(array.reshape(-1).view(np.uint8))
    return h.hexdigest()


class Runs:
    """Shards' outputs on the simulator by what decides them: the build, by its artifact's sha256 (the
    toolkit writes uninitialised memory into each .rknn, so no two builds share one), and what it was
    fed (digest). Kept for this compile in memory and, where given, in a cache folder (`root`) for the
    next; `salt`: the target and its toolkit."""

    def __init__(self, root: Path | None, salt: str):
        self.root, self.salt = root, salt
        self.here: dict[str, list[np.ndarray]] = {}
        self.built_again = 0   # the check's own simulator builds: shards whose runs no build made

    def key(self, artifact: str | None, fed: str) -> str | None:
        """The entry of a build's run; None where the build has no artifact to name it by."""
        if not artifact:
            return None
        return "r" + hashlib.sha256(json.dumps([self.salt, artifact, fed]).encode()).hexdigest()

    def get(self, key: str | None) -> list[np.ndarray] | None:
        if key is None:
            return None
        if key in self.here or self.root is None:   # made in this compile: not read back from its file
            return self.here.get(key)
        found = entry_file(self.root, key, "outputs.npz")   # marks it used
        if found is None:
            return None
        try:
            with np.load(found, allow_pickle=False) as stored:
                return [stored[f"arr_{k}"] for k in range(len(stored.files))]
        except (OSError, ValueError, KeyError):   # evicted under our feet, or not whole
            return None

    def put(self, key: str | None, outputs: list[np.ndarray]) -> None:
        if key is None:
            return
        self.here[key] = outputs   # the arrays the frames hold already: no copy
        if self.root is not None:
            store_entry(self.root, key, lambda staging: np.savez(staging / "outputs.npz", *outputs))


class Chains:
    """The check's frames as the builds make them: per chain, the tensors each sample holds so far.
    "ours" is shard's bundle as it most likely will be (each rewritten shard), "vendor" the vendor
    alone's shard by shard (each shard as it came), "whole" the vendor alone's whole build. start()
    gives their first frames (the samples, after the host's steps), once the passes made them; a build
    made before (the vendor alone's, which runs through the passes) finds no frames and runs nothing.

    A build whose inputs a build under way will make (two builds at once) waits for it; one whose
    inputs no build under way makes (its producer still queued, or failed) runs nothing, and the
    check builds it again. Waiting only on builds that hold a worker cannot deadlock: those wait only
    on earlier shards."""

    def __init__(self, runs: Runs):
        self.runs = runs
        self.frames: dict[str, list[dict[str, np.ndarray]]] = {}
        self.makers: dict[tuple[str, str], BuildRuns] = {}   # (chain, tensor): the build that makes it there
        self.changed = threading.Condition()

    def start(self, samples: list[dict[str, np.ndarray]], host_pre: list[dict], tables: dict) -> None:
        """The first frames: shard's bundle's and the vendor alone's shard by shard after the host's
        steps (a chain's bundle keeps those its shards read: the others' outputs are not read), the
        vendor alone's whole build's the samples as they are."""
        hosted = [run_host(host_pre, dict(sample), tables) for sample in samples]
        with self.changed:
            self.frames = {"ours": hosted, "vendor": [dict(frame) for frame in hosted],
                           "whole": [dict(sample) for sample in samples]}

    def shards(self, plans: list, originals: list, per_shard: bool) -> dict[str, BuildRuns]:
        """{build: its runs} for each shard and twin: a shard the passes changed on shard's chain and
        its twin on the vendor alone's (per_shard: the vendor alone stands beside shard by shard), a
        shard they did not change on both. Else the twins run nothing: in shard's chain their outputs
        would take the rewritten shards' names."""
        runs = {}
        for plan, original in zip(plans, originals):
            on = ("ours", "vendor") if original is None and per_shard else ("ours",)
            runs[plan.name] = self.of(plan.name, [tensor_spec(t) for t in plan.inputs],
                                      [tensor_spec(t) for t in plan.outputs], on)
            if original is not None and per_shard:
                runs[f"{plan.name}{UNREWRITTEN}"] = self.of(
                    plan.name, [tensor_spec(t) for t in original.inputs], [tensor_spec(t) for t in original.outputs],
                    ("vendor",))
        return runs

    def whole(self, graph: onnx.GraphProto) -> BuildRuns:
        """The runs of the vendor alone's build of the whole model (`graph`, its input shapes fixed). No
        build reads its outputs, and the check takes them from the runs in its bundle's shapes, so none
        joins the frames: the model's own outputs may have no shape before the passes infer one."""
        weights = {t.name for t in graph.initializer}
        return self.of(VENDOR_ALONE, [value_spec(v) for v in graph.input if v.name not in weights], [], ("whole",))

    def of(self, name: str, inputs: list[TensorSpec], outputs: list[TensorSpec], on: tuple[str, ...]) -> BuildRuns:
        """The runs of a build of a shard with these inputs and outputs, on the chains `on`."""
        shard = ShardSpec(name=name, onnx="", artifact=None, log=None, inputs=inputs, outputs=outputs, core=0,
                          precision="")
        runs = BuildRuns(self, shard, on)
        with self.changed:
            for chain in on:
                for t in outputs:
                    self.makers.setdefault((chain, t.name), runs)
        return runs

    def fed(self, shard: ShardSpec, on: tuple[str, ...]) -> dict[str, tuple[Run, list[tuple[str, int]]]]:
        """What the shard is fed on each chain that holds (or will, from builds under way) all its
        inputs, one run per distinct arrays, by their digest: {digest: (run, its (chain, sample)s)}."""
        names = [t.name for t in shard.inputs]
        with self.changed:
            ready = [chain for chain in on if self.wait_for(chain, names)]
            fed = [(chain, n, npu_inputs(shard, {name: frame[name] for name in names}))
                   for chain in ready for n, frame in enumerate(self.frames[chain])]
        by_digest: dict[str, tuple[Run, list[tuple[str, int]]]] = {}
        for chain, n, run in fed:
            by_digest.setdefault(digest(run), (run, []))[1].append((chain, n))
        return by_digest

    def wait_for(self, chain: str, names: list[str]) -> bool:
        """Whether the chain's frames hold every name, once the builds under way that make the
        missing ones are done (under self.changed)."""
        while True:
            frames = self.frames.get(chain)   # each sample's run joins on its own: every frame is asked
            missing = [name for name in names if not frames or any(name not in frame for frame in frames)]
            if not missing:
                return True
            makers = [self.makers.get((chain, name)) for name in missing]
            if not frames or not all(m is not None and m.state == "building" for m in makers):
                return False
            self.changed.wait()


class BuildRuns:
    """One build's runs (shard.targets.SampleRuns): on every chain it is on that holds all its inputs,
    a run per sample, the same arrays run once; its outputs join those chains' frames."""

    def __init__(self, chains: Chains, shard: ShardSpec, on: tuple[str, ...]):
        self.chains, self.shard, self.on = chains, shard, on
        self.state = "queued"   # "building" while its build holds a worker, then "done"
        self.pending: list[tuple[str, Run, list[tuple[str, int]]]] = []   # (digest, run, its chains' frames)

    @contextmanager
    def building(self) -> Iterator[None]:
        with self.chains.changed:
            self.state = "building"
        try:
            yield
        finally:
            with self.chains.changed:
                self.state = "done"
                self.chains.changed.notify_all()

    def wanted(self, artifact: str | None) -> list[Run]:
        self.pending = []
        for fed, (run, places) in self.chains.fed(self.shard, self.on).items():
            kept = self.chains.runs.get(self.chains.runs.key(artifact, fed))
            if kept is None:
                self.pending.append((fed, run, places))
            else:
                self.join(places, kept)
        return [run for _, run, _ in self.pending]

    def made(self, artifact: str, outputs: list[list[np.ndarray]]) -> None:
        for (fed, _, places), made in zip(self.pending, outputs):
            self.chains.runs.put(self.chains.runs.key(artifact, fed), made)
            self.join(places, made)
        self.pending = []

    def join(self, places: list[tuple[str, int]], outputs: list[np.ndarray]) -> None:
        named = outputs_by_name(self.shard, outputs)
        with self.chains.changed:
            for chain, n in places:
                self.chains.frames[chain][n].update(named)
            self.chains.changed.notify_all()
