"""`shard probe`: run the families' searches through the real vendor compiler and write a profile.

Each family@setting is one search (double, then bisect); searches run `jobs` at a time, each build
in a reused toolkit worker; every point is cached on disk before the search moves on.
"""

from __future__ import annotations

import datetime
import shutil
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import numpy as np
import onnx

from shard.errors import RunError, TargetError
from shard.probes.classify import classify_build, classify_numeric
from shard.probes.families import Family, limit_name, select
from shard.probes.search import Boundary, Point, find_boundary
from shard.profile import Limit, Profile, load_profile
from shard.runtime.executors.rknn_sim import infer
from shard.targets.rknn_log import HOST_OPS, parse_build_log
from shard.toolkit.worker import WorkerFailed, WorkerPool
from shard.verifier import compare

DEFAULT_SLOW_FACTOR = 4.0
BUILD_TIMEOUT_S = 300.0


@dataclass
class Search:
    family: Family
    setting: str
    boundary: Boundary | None = None

    @property
    def name(self) -> str:
        return limit_name(self.family, self.setting)


def probe_inputs(model: onnx.ModelProto, scale: float, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {i.name: (rng.uniform(-1, 1, [d.dim_value for d in i.type.tensor_type.shape.dim]) * scale).astype(np.float32)
            for i in model.graph.input}


def reference_outputs(model: onnx.ModelProto, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, inputs)


class RknnProber:
    """Probe points for rk3588: a build in the toolkit worker, its log read; optionally a run."""

    def __init__(self, pool: WorkerPool, scratch: Path, build: dict, profile: Profile, slow_factor: float,
                 timeout: float, board=None):
        self.pool, self.scratch, self.build, self.timeout = pool, scratch, build, timeout
        self.macs_per_cycle = float(profile.facts.get("macs_per_cycle_fp16", 512))
        self.slow_factor = slow_factor
        self.board = board  # the RKNNLite class when points also run on the board

    def test(self, family: Family, setting: str, size: int) -> Point:
        params = family.settings[setting]
        return self.run_model(family.build(size, params), f"{limit_name(family, setting)}-{size}", size,
                              family.macs(size, params) if family.macs else None,
                              family.input_range(size, params) if family.numeric else None)

    def run_model(self, model: onnx.ModelProto, stem: str, size: int = 0, macs: int | None = None,
                  simulate_range: float | None = None) -> Point:
        """Build one model, classify what the compiler said; simulate it (inputs uniform in
        +-simulate_range) or run it on the board where asked."""
        stem = self.scratch / stem
        onnx_path, log = stem.with_suffix(".onnx"), stem.with_suffix(".log")
        artifact = stem.with_suffix(".rknn") if self.board else None
        onnx.save(model, onnx_path)
        key = stem.name if simulate_range is not None else None
        try:
            with self.pool.worker() as worker:
                try:
                    answer = worker.request(op="build", onnx=str(onnx_path), rknn=artifact and str(artifact),
                                            log=str(log), config=self.build["config"], build=self.build["build"],
                                            keep=key, timeout=self.timeout)
                except WorkerFailed as exc:
                    return Point(size, False, "timeout" if exc.timed_out else "crash", f"the build {exc}")
                diag = parse_build_log(log.read_text(errors="replace"))
                point = classify_build(size, answer, diag, macs, self.macs_per_cycle, self.slow_factor)
                point.figures["layers"] = [[layer.op, layer.target, layer.cycles, layer.ddr_cycles, layer.rw_kb]
                                           for layer in diag.layers if layer.op not in HOST_OPS]
                if point.ok and key is not None:
                    point = self._simulate(worker, key, model, simulate_range, point)
            if point.ok and self.board:
                point = self._on_board(artifact, model, simulate_range or 1.0, point)
            return point
        finally:
            for path in (onnx_path, log, artifact):
                if path is not None:
                    path.unlink(missing_ok=True)

    def _simulate(self, worker, key: str, model: onnx.ModelProto, scale: float, point: Point) -> Point:
        inputs = probe_inputs(model, scale)
        work = Path(tempfile.mkdtemp(prefix=f"{key}-", dir=self.scratch))
        try:
            got = infer(partial(worker.request, timeout=self.timeout), key, list(inputs.values()), work,
                        work / "infer.log")[0]
            worker.request(op="release", key=key, timeout=self.timeout)
        except (RunError, WorkerFailed) as exc:
            return Point(point.size, False, "crash", f"simulator: {exc}", point.figures)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        want = reference_outputs(model, inputs)[0]
        return classify_numeric(point, compare("out", want, got.reshape(want.shape)).cosine)

    def _on_board(self, artifact: Path, model: onnx.ModelProto, scale: float, point: Point) -> Point:
        rt = self.board()
        try:
            if rt.load_rknn(str(artifact)) != 0 or rt.init_runtime(core_mask=self.board.NPU_CORE_0) != 0:
                return Point(point.size, False, "board", "load_rknn/init_runtime failed on the board", point.figures)
            inputs = probe_inputs(model, scale)
            outs = rt.inference(inputs=list(inputs.values()), data_format=["nchw"] * len(inputs))
            if outs is None:
                return Point(point.size, False, "board", "inference on the board returned nothing", point.figures)
        except Exception as exc:  # noqa: BLE001 - any runtime failure on the board is this class
            return Point(point.size, False, "board", f"{type(exc).__name__}: {exc}", point.figures)
        finally:
            rt.release()
        want = reference_outputs(model, inputs)[0]
        checked = classify_numeric(point, compare("out", want, np.asarray(outs[0]).reshape(want.shape)).cosine)
        if not checked.ok:
            checked.failure = "board"
        return checked


def probe(target: str, families: list[str] | None = None, jobs: int = 2, max_size: int | None = None,
          cache_dir: Path | None = None, read_cache: bool = True, base: Profile | None = None, slow_factor: float = DEFAULT_SLOW_FACTOR,
          timeout: float = BUILD_TIMEOUT_S, on_board: bool = False,
          progress: Callable[..., None] = lambda *a, **k: None) -> tuple[Profile, list[Search]]:
    """Probe the families on `target`: a profile of their limits (facts and cores from `base`, by
    default the shipped profile) and the searches with every point they saw."""
    if target != "rk3588":
        raise TargetError(f"`shard probe` knows how to probe rk3588; {target!r} has no probe families")
    chosen = select(families)
    board = None
    if on_board:
        from shard.runtime.executors.rknn_board import import_rknnlite

        board = import_rknnlite()
    base = base or load_profile(target)
    from shard.probes.oneop import ToolkitOps
    from shard.targets.rk3588 import Rk3588Target

    ops = ToolkitOps(target, base, Rk3588Target().build_options(None), jobs, timeout, cache_dir, read_cache,
                     slow_factor, board)
    searches = [Search(f, s) for f in chosen for s in f.settings]
    finished: list[str] = []
    lock = threading.Lock()
    progress("probe", 0, len(searches), note="")

    def run(search: Search) -> None:
        top = min(search.family.max_size, max_size or search.family.max_size)
        start = min(search.family.start, top)

        def test(size: int) -> Point:
            point = ops.cache.get(search.name, search.family.version, size)
            if point is None:
                point = ops.prober.test(search.family, search.setting, size)
                ops.cache.put(search.name, search.family.version, point)
            return point

        def bracket(lo, hi) -> None:
            progress("probe", len(finished), len(searches), note=f"{search.name} [{lo or '-'}, {hi or '-'})")

        search.boundary = find_boundary(test, start, top, on_bracket=bracket)
        with lock:
            finished.append(search.name)
            progress("probe", len(finished), len(searches), note=f"{search.name} done")

    failed = True
    try:
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as executor:
            for future in [executor.submit(run, s) for s in searches]:
                future.result()
        failed = False
    finally:
        ops.close(kill=failed)
    toolkit = ops.toolkit
    today = datetime.date.today().isoformat()
    limits = {search.name: to_limit(search, toolkit, today, slow_factor) for search in searches}
    facts = {**base.facts, "slow_factor": slow_factor}
    return Profile(target=target, cores=base.cores, toolkit=toolkit, limits=limits, facts=facts), searches


def to_limit(search: Search, toolkit: str, date: str, slow_factor: float) -> Limit:
    b, what = search.boundary, f"{search.family.what}, setting {search.setting}"
    source = f"shard probe with {toolkit}, {b.builds} new builds of {len(b.points)} points"
    if b.smallest_failing is None:
        return Limit(value=b.largest_ok, failure="none", evidence=f"{what}: every size up to N={b.largest_ok} passes",
                     source=source, toolkit=toolkit, date=date)
    fail = b.failing_point
    passed = f"N={b.largest_ok} passes" if b.largest_ok is not None else "no size tried passes"
    evidence = f"{what}: {passed}; N={fail.size} fails ({fail.failure}): {fail.evidence}"
    if fail.failure == "slow":
        evidence += f" [slow: more than {slow_factor:g}x the peak rate]"
    return Limit(value=b.largest_ok or 0, failure=fail.failure, evidence=evidence, source=source, toolkit=toolkit,
                 date=date, failing=fail.size)


def merge_into(path: Path, profile: Profile) -> tuple[Profile, int]:
    """The new profile, keeping limits of an existing profile file at `path` that this run did not probe."""
    if not path.exists():
        return profile, 0
    old = load_profile(profile.target, path)
    kept = {k: v for k, v in old.limits.items() if k not in profile.limits}
    if not kept:
        return profile, 0
    return Profile(profile.target, profile.cores, profile.toolkit, {**kept, **profile.limits},
                   {**old.facts, **profile.facts}), len(kept)

