"""The state of one compile (Compilation) and what it returns (CompileResult)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import onnx
import onnx_graphsurgeon as gs

from shard.bundle import Manifest
from shard.compare import Comparison
from shard.compilation.fidelity import BuildRuns, Chains
from shard.compilation.jobs import Datasets
from shard.compilation.names import Progress
from shard.compilation.writer import BundleWriter
from shard.options import CompileOptions
from shard.passes import PassContext
from shard.passes.context import ShardPlan
from shard.profile import Profile
from shard.targets import Builds, ShardBuild, ShardJob, Target



@dataclass
class CompileResult:
    bundle: Path
    manifest: Manifest
    report: dict
    rank: Callable[[], dict] | None = field(default=None, repr=False)   # mixed: mixed_ranking of its graph

    @classmethod
    def of_buckets(cls, bundle: Path, manifest: Manifest, reports: dict[str, dict]) -> CompileResult:
        """A bundle of shape buckets: its report holds each bucket's compile report under the bucket's name."""
        return cls(bundle, manifest, {"buckets": reports})

    @property
    def bucket_reports(self) -> dict[str, dict]:
        """{bucket: its compile report}; {} for a bundle of one shape."""
        return self.report.get("buckets", {})


@dataclass
class Compilation:
    """What one compile knows, filled in stage by stage (shard.compilation.stages): set by start,
    load, start_vendor_alone, rewrite, build_shards, choose, stand_beside_vendor, write_bundle and
    check_fidelity, in that order."""

    model: Path
    target: str
    tgt: Target
    output: Path
    options: CompileOptions
    progress: Progress
    profile: Profile
    staging: Path                    # the bundle being written, beside the output
    logs: Path                       # every build's log, outside it: a failure keeps those it names
    started: float
    quantized: bool
    # load: the model, and how the vendor alone stands beside it
    proto: onnx.ModelProto | None = None
    source: dict = field(default_factory=dict)
    build: dict = field(default_factory=dict)         # the toolkit options every shard builds with
    vendor_build: dict = field(default_factory=dict)  # the vendor alone's: without the passes' config
    cache: Path | None = None        # the build cache's folder (None: --no-cache)
    whole: bool = False              # the vendor alone's build of the whole model is made
    per_shard: bool = False          # else, stood beside shard by shard (each shard's unrewritten build)
    why: str = ""                    # why the whole build is or is not made
    chains: Chains | None = None     # the fidelity check's runs, made where each shard builds
    # the vendor alone's build
    builder: Builds | None = None
    vendor_inputs: list | None = None
    vendor_job: ShardJob | None = None
    vendor_runs: BuildRuns | None = None   # its fidelity runs, made where it builds
    stand_in: ShardBuild | None = None   # an earlier build's figures, the same model with other weights
    early: list[Future] = field(default_factory=list)
    # rewrite
    graph: gs.Graph | None = None
    ctx: PassContext | None = None
    opset: int = 0
    plans: list[ShardPlan] = field(default_factory=list)
    canonical: gs.Graph | None = None    # the graph as the vendor would take it: each shard's twin
    originals: list[ShardPlan | None] = field(default_factory=list)
    values: dict | None = None           # quantized: every shard input's value on each sample
    feeds: list | None = None
    rank: Callable[[], dict] | None = None
    samples: list[dict] = field(default_factory=list)   # what the fidelity check runs
    seconds: dict = field(default_factory=dict)
    # build_shards
    datasets: Datasets | None = None
    jobs: list[ShardJob] = field(default_factory=list)
    done: list[ShardBuild] = field(default_factory=list)
    builds: dict[str, ShardBuild] = field(default_factory=dict)
    # choose, stand_beside_vendor
    axes: tuple[str, ...] = ()
    in_range: set[str] = field(default_factory=set)   # nodes scale_sandwich rescaled for fp16's range
    relaid: list = field(default_factory=list)
    own: list = field(default_factory=list)           # [(build, plan)]: each shard's better build
    chosen: list = field(default_factory=list)        # what the bundle holds
    choices: list[dict] = field(default_factory=list)
    versus: dict | None = None
    measure: bool = False                             # fidelity checked on the simulator
    # write_bundle, check_fidelity
    writer: BundleWriter | None = None
    baseline: list | None = None
    manifest: Manifest | None = None
    report: dict = field(default_factory=dict)
    kept: Comparison | None = None                    # the bundle's worst output on the simulator

    @property
    def vendor_dir(self) -> Path:
        """Where the vendor alone's bundle is written for the fidelity check."""
        return self.staging.with_name(f"{self.staging.name}-vendor")

    def compile_jobs(self, batch: list[ShardJob], step: str, under_way: list = (), config: dict | None = None
                     ) -> dict[str, ShardBuild]:
        """Build `batch` (with the builds `under_way`) and wait for all: {name: build}."""
        self.progress(step, len(self.done), len(self.jobs))
        submitted = self.builder.submit(batch, config or self.build, self.on_done(step))
        return {b.name: b for b in self.builder.results([*under_way, *submitted])}

    def on_done(self, step: str) -> Callable[[ShardBuild], None]:
        def done_one(result: ShardBuild) -> None:
            self.done.append(result)
            self.progress(step, len(self.done), len(self.jobs))
        return done_one
