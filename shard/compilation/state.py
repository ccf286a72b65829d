"""What one compile hands from stage to stage (shard.compilation.stages): each stage's own record,
made by it and read by the stages after it, and what the compile returns (CompileResult)."""

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
from shard.never_worse import labels_in
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


@dataclass(frozen=True)
class Setup:
    """start(): the target and its profile checked against the options, and where the bundle is written."""

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
    temporary: list[Path] = field(default_factory=list)   # folders that go whatever ends the compile

    @property
    def vendor_dir(self) -> Path:
        """Where the vendor alone's bundle is written for the fidelity check."""
        return self.staging.with_name(f"{self.staging.name}-vendor")

    @property
    def labels(self) -> dict[str, str]:
        """The measured axes as the compile's lines name them: in the target's words (never_worse.labels_in)."""
        return labels_in(self.tgt.words)


@dataclass
class Loaded:
    """load(): the model as it came, and how the vendor alone will stand beside it."""

    proto: onnx.ModelProto | None    # rewrite takes it, and lets it go
    source: dict
    build: dict                      # the toolkit options of the vendor alone's build, and the shards' base
    cache: Path | None               # the build cache's folder (None: --no-cache)
    whole: bool                      # the vendor alone's build of the whole model is made
    per_shard: bool                  # else, stood beside shard by shard (each shard's unrewritten build)
    why: str                         # why the whole build is or is not made
    chains: Chains | None            # the fidelity check's runs, made where each shard builds


@dataclass
class VendorAlone:
    """start_vendor_alone(): the vendor alone's build of the model as it came (quantized, its job is made
    by build_shards, once the passes took the samples)."""

    inputs: list | None = None
    job: ShardJob | None = None
    runs: BuildRuns | None = None          # its fidelity runs, made where it builds
    stand_in: ShardBuild | None = None     # an earlier build's figures, the same model with other weights
    early: list[Future] = field(default_factory=list)   # its build, under way through the passes


@dataclass
class Rewritten:
    """rewrite(): the target's passes run and the graph partitioned."""

    graph: gs.Graph
    ctx: PassContext
    opset: int
    plans: list[ShardPlan]
    canonical: gs.Graph | None           # the graph as the vendor would take it: each shard's twin
    originals: list[ShardPlan | None]
    passes_seconds: float
    samples: list[dict] = field(default_factory=list)   # what the fidelity check runs
    values: dict | None = None           # quantized: every shard input's value on each sample
    feeds: list | None = None
    rank: Callable[[], dict] | None = None   # mixed: mixed_ranking of its graph

    @property
    def reference(self) -> gs.Graph:
        """The graph the vendor alone's plan and the fidelity samples are read from."""
        return self.canonical or self.graph


class BuildQueue:
    """The compile's builds on the target's workers: every job it submitted, which its progress counts,
    and every build done."""

    def __init__(self, builder: Builds, progress: Progress):
        self.builder, self.progress = builder, progress
        self.jobs: list[ShardJob] = []
        self.done: list[ShardBuild] = []

    def submit(self, batch: list[ShardJob], config: dict, step: str) -> list[Future]:
        return self.builder.submit(batch, config, self.on_done(step))

    def wait(self, batch: list[ShardJob], step: str, config: dict, under_way: list = ()) -> dict[str, ShardBuild]:
        """Build `batch` (with the builds `under_way`) and wait for all: {name: build}."""
        self.progress(step, len(self.done), len(self.jobs))
        submitted = self.submit(batch, config, step)
        return {b.name: b for b in self.builder.results([*under_way, *submitted])}

    def on_done(self, step: str) -> Callable[[ShardBuild], None]:
        def done_one(result: ShardBuild) -> None:
            self.done.append(result)
            self.progress(step, len(self.done), len(self.jobs))
        return done_one


@dataclass
class Built:
    """build_shards(): every build by name (choose and stand_beside_vendor add theirs), with the options
    the shards were built with."""

    builds: dict[str, ShardBuild]
    build: dict                      # the vendor's options with the passes' toolkit config
    datasets: Datasets | None        # quantized: each shard input's samples
    seconds: dict                    # the passes' and the builds'


@dataclass
class Chosen:
    """choose(): each shard's better build."""

    axes: tuple[str, ...]
    in_range: set[str]               # nodes scale_sandwich rescaled for fp16's range
    relaid: list                     # [(job, its input shapes)]: builds with edges in the target's layout
    own: list                        # [(build, plan)]: each shard's better build
    choices: list[dict]


@dataclass
class Standing:
    """stand_beside_vendor(): what the bundle holds, beside the vendor alone."""

    chosen: list
    versus: dict | None
    measure: bool                    # fidelity checked on the simulator


@dataclass
class Written:
    """write_bundle(), then check_fidelity(): the bundle in the staging folder."""

    writer: BundleWriter
    baseline: list | None            # the vendor alone's builds its fidelity is checked beside
    manifest: Manifest
    report: dict
    kept: Comparison | None = None   # the bundle's worst output on the simulator
