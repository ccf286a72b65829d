"""Builds in the vendor toolkit that the passes and `shard probe` share: toolkit workers, a scratch
directory, the point cache, and one model built (and simulated, or run on a board) and classified.

The passes ask whether one op is legal at its real shapes and what a region costs; the probe sweeps
families of such models. Every model is built once per toolkit version and target: the verdict is
cached on disk beside the probe points (keyed by the model's bytes), so the second compile of a
model builds nothing here.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import weakref
from functools import partial
from pathlib import Path

import numpy as np
import onnx

from shard import scratch
from shard.calibration import random_samples, run_each
from shard.compare import compare
from shard.errors import RunError, TargetError
from shard.graph import value_spec
from shard.profile import Point, Profile
from shard.targets.rknn.cache import PointCache, default_cache_dir
from shard.targets.rknn.classify import classify_build, classify_numeric
from shard.targets.rknn.env import installed_label
from shard.targets.rknn.log import HOST_OPS, Layer, parse_build_log, unestimated_cost
from shard.targets.rknn.remote import worker_pool
from shard.targets.rknn.worker import WorkerFailed, WorkerPool, build_request, infer

MODELS = "by-model"
MODELS_VERSION = 2  # points carry each layer's DDR cycles and bytes
SAMPLES_VERSION = 2  # a quantized build's samples: in the model's domain (in_domain)


class ToolkitOps:
    """Toolkit workers (`jobs` of them), a scratch directory, the point cache and a prober over them:
    what both the passes and `shard probe` build with."""

    def __init__(self, target: str, profile: Profile, build: dict, jobs: int = 1, timeout: float = 300.0,
                 cache_dir: Path | None = None, read_cache: bool = True, slow_factor: float | None = None,
                 board=None, ray: str | None = None, timer=None):
        self.toolkit = installed_label(target)
        self.timer = timer   # the artifact and inputs to seconds on a board (time_on_board), where there is one
        self.cache = PointCache(cache_dir or default_cache_dir(), self.toolkit, target, read=read_cache)
        self.scratch = scratch.folder("ops")
        # The folder also goes with this object: a compile stopped while this starts leaves none.
        self._remove = weakref.finalize(self, scratch.remove, self.scratch)
        self.pool = worker_pool(target, self.scratch, jobs, ray)
        slow = slow_factor if slow_factor is not None else float(profile.facts.get("slow_factor", 4.0))
        self.prober = RknnProber(self.pool, self.scratch, build, profile, slow, timeout, board)

    @staticmethod
    def cost(point: Point, cycles_per_kb: float | None = None) -> tuple[int, int, float | None]:
        """(total, part costed by bytes, DDR cycles per KB) of a build: the compiler's estimate, plus the
        ops it leaves at 0 costed by the bytes they move at the DDR rate of the ops it does estimate."""
        layers = [Layer(0, op, target, "", cycles, "", ddr, rw)
                  for op, target, cycles, ddr, rw in point.figures.get("layers", [])]
        extra, rate = unestimated_cost(layers, cycles_per_kb)
        return point.figures.get("estimated_cycles", 0) + extra, extra, rate

    def build(self, model: onnx.ModelProto, macs: int | None = None, build: dict | None = None) -> Point:
        """What the compiler says of this model (cycles in figures), built with `build` (else the
        options given at the start); from the cache when seen before."""
        key = model.SerializeToString() + repr(macs).encode() + (repr(build).encode() if build else b"")
        if (build or self.prober.build)["build"].get("do_quantization"):
            key += f"samples {SAMPLES_VERSION}".encode()
        digest = hashlib.sha256(key).hexdigest()[:24]
        point = self.cache.get(MODELS, MODELS_VERSION, digest)
        if point is None:
            point = self.prober.run_model(model, digest, macs=macs, build=build)
            self.cache.put(MODELS, MODELS_VERSION, point, size=digest)
        return point

    def time_on_board(self, model: onnx.ModelProto, timer=None) -> float:
        """`model` built with the probe's options, which must build clean, then `timer` (the artifact and
        inputs to seconds on the board: rknn_board.time_inference or its Ray form)."""
        point = self.prober.run_model(model, f"timed-{model.graph.name}", timer=timer or self.timer)
        if not point.ok:
            raise TargetError(f"{model.graph.name} did not build clean: {point.evidence}")
        return point.figures["board_seconds"]

    def close(self, kill: bool = False) -> None:
        """Stop the workers (at once, if kill) and remove the scratch directory."""
        if kill:
            self.pool.kill_all()
        self.pool.close()
        self._remove()


def probe_inputs(model: onnx.ModelProto, scale: float, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {i.name: (rng.uniform(-1, 1, [d.dim_value for d in i.type.tensor_type.shape.dim]) * scale).astype(np.float32)
            for i in model.graph.input}


def write_samples(model: onnx.ModelProto, stem: Path, count: int = 2) -> list[list[str]]:
    """Seeded calibration samples for a quantized probe build (shard.calibration's random samples of
    the model's inputs): per sample, one .npy per input."""
    specs = [value_spec(i) for i in model.graph.input]
    paths = []
    for k, sample in enumerate(in_domain(model, random_samples(specs, count))):
        paths.append([])
        for i, spec in enumerate(specs):
            paths[-1].append(str(stem.parent / f"{stem.name}-s{k}-{i}.npy"))
            np.save(paths[-1][-1], sample[spec.name])
    return paths


def in_domain(model: onnx.ModelProto, samples: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """The samples, the float inputs of each made non-negative where the model's output is NaN on it
    (Sqrt, Log, Pow of a negative base): the toolkit's quantizer takes its ranges from the samples,
    and a NaN range crashes it (`cannot convert float NaN to integer`)."""
    outputs = run_each(model, samples, [o.name for o in model.graph.output])
    return [{name: np.abs(x) if x.dtype.kind == "f" else x for name, x in sample.items()}
            if any(o.dtype.kind == "f" and np.isnan(o).any() for o in got.values()) else sample
            for sample, got in zip(samples, outputs)]


def reference_outputs(model: onnx.ModelProto, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, inputs)


class RknnProber:
    """One model built in a toolkit worker for the profile's chip, its log read and classified;
    optionally simulated or run on a board."""

    def __init__(self, pool: WorkerPool, scratch: Path, build: dict, profile: Profile, slow_factor: float,
                 timeout: float, board=None):
        self.pool, self.scratch, self.build, self.timeout = pool, scratch, build, timeout
        self.cores = profile.cores
        self.rates: dict[bool, float] = {}
        self.use_rates(profile.facts)
        self.slow_factor = slow_factor
        self.board = board  # runs a built point on a board (rknn_board.infer_once's arguments), if asked

    def use_rates(self, facts: dict) -> None:
        """The peak MACs/cycle the `slow` class is judged against, by whether the build is quantized:
        a profile's facts or a probe's measure_rates (where a rate is missing, the one held)."""
        self.rates = {False: float(facts.get("macs_per_cycle_fp16", self.rates.get(False, 512))),
                      True: float(facts.get("macs_per_cycle_int8", self.rates.get(True, 1024)))}

    def run_model(self, model: onnx.ModelProto, stem: str, size: int = 0, macs: int | None = None,
                  simulate_range: float | None = None, build: dict | None = None, timer=None) -> Point:
        """Build one model (with `build`, else the prober's options), classify what the compiler said;
        simulate it (inputs uniform in +-simulate_range) or run it on the board where asked; with
        `timer`, time a clean build on the board instead (its seconds in figures' `board_seconds`). A
        quantized build is calibrated on two seeded random samples."""
        build = build or self.build
        stem = self.scratch / stem
        onnx_path, log = stem.with_suffix(".onnx"), stem.with_suffix(".log")
        artifact = stem.with_suffix(".rknn") if self.board or timer else None
        onnx.save(model, onnx_path)
        key = stem.name if simulate_range is not None else None
        dataset = write_samples(model, stem) if build["build"].get("do_quantization") else []
        try:
            with self.pool.worker() as worker:
                try:
                    answer = build_request(worker.request, onnx_path, log, build, artifact, key, dataset,
                                           self.timeout)
                except WorkerFailed as exc:
                    return Point(size, False, "timeout" if exc.timed_out else "crash", f"the build {exc}")
                diag = parse_build_log(log.read_text(errors="replace"))
                rate = self.rates[bool(build["build"].get("do_quantization"))]
                point = classify_build(size, answer, diag, macs, rate, self.slow_factor)
                point.figures["layers"] = [[layer.op, layer.target, layer.cycles, layer.ddr_cycles, layer.rw_kb]
                                           for layer in diag.layers if layer.op not in HOST_OPS]
                if point.ok and key is not None:
                    point = self._simulate(worker, key, model, simulate_range, point)
            if point.ok and timer:
                point.figures["board_seconds"] = timer(artifact, list(probe_inputs(model, 1.0).values()),
                                                       build["config"]["target_platform"], self.cores)
            elif point.ok and self.board:
                point = self._on_board(artifact, model, simulate_range or 1.0, point)
            return point
        finally:
            for path in (onnx_path, log, artifact, *(p for sample in dataset for p in sample)):
                if path is not None:
                    Path(path).unlink(missing_ok=True)

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
        inputs = probe_inputs(model, scale)
        try:
            outs = self.board(artifact, list(inputs.values()), self.build["config"]["target_platform"], self.cores)
        except Exception as exc:  # noqa: BLE001 - any runtime failure on the board is this class
            return Point(point.size, False, "board", f"{type(exc).__name__}: {exc}", point.figures)
        want = reference_outputs(model, inputs)[0]
        checked = classify_numeric(point, compare("out", want, np.asarray(outs[0]).reshape(want.shape)).cosine)
        if not checked.ok:
            checked.failure = "board"
        return checked
