"""Small builds for the passes: is this one op legal at its real shapes, what does this region cost.

Every model is built once per toolkit version: the verdict is cached on disk beside the probe points
(keyed by the model's bytes), so the second compile of a model builds nothing here.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

import onnx

from shard.passes.fit import HARD_FAILURES, OpSpec, Verdict
from shard.probes.cache import PointCache, default_cache_dir
from shard.probes.search import Point
from shard.profile import Profile
from shard.toolkit.env import find_python, installed_label
from shard.toolkit.worker import WorkerPool

MODELS = "by-model"
MODELS_VERSION = 2  # points carry each layer's DDR cycles and bytes


class ToolkitOps:
    """Toolkit workers (`jobs` of them), a scratch directory, the point cache and a prober over them:
    what both the passes and `shard probe` build with."""

    def __init__(self, target: str, profile: Profile, build: dict, jobs: int = 1, timeout: float = 300.0,
                 cache_dir: Path | None = None, read_cache: bool = True, slow_factor: float | None = None,
                 board=None):
        from shard.probes.runner import RknnProber

        self.toolkit = installed_label(target)
        self.cache = PointCache(cache_dir or default_cache_dir(), self.toolkit, target, read=read_cache)
        self.scratch = Path(tempfile.mkdtemp(prefix="shard-ops-"))
        self.pool = WorkerPool(find_python(target), self.scratch, jobs)
        slow = slow_factor if slow_factor is not None else float(profile.facts.get("slow_factor", 4.0))
        self.prober = RknnProber(self.pool, self.scratch, build, profile, slow, timeout, board)

    def build(self, model: onnx.ModelProto, macs: int | None = None) -> Point:
        """What the compiler says of this model (cycles in figures); from the cache when seen before."""
        digest = hashlib.sha256(model.SerializeToString() + repr(macs).encode()).hexdigest()[:24]
        point = self.cache.get(MODELS, MODELS_VERSION, digest)
        if point is None:
            point = self.prober.run_model(model, digest, macs=macs)
            self.cache.put(MODELS, MODELS_VERSION, point, size=digest)
        return point

    def check(self, spec: OpSpec) -> Verdict:
        point = self.build(spec.model())
        where = f"one-op build of {spec.op} {spec.outputs[0]}"
        if point.ok or point.failure not in HARD_FAILURES:
            # A CPU placement or a slow estimate in isolation often differs inside the real graph
            # (the compiler fuses Softmax into its attention kernel): the shard build reports those.
            return Verdict(True, point.failure, f"{where}: {point.failure or 'clean'}")
        return Verdict(False, point.failure, f"{where}: {point.failure}: {point.evidence[:300]}")

    def close(self, kill: bool = False) -> None:
        """Stop the workers (at once, if kill) and remove the scratch directory."""
        if kill:
            self.pool.kill_all()
        self.pool.close()
        shutil.rmtree(self.scratch, ignore_errors=True)
