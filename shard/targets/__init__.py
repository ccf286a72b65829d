"""Compile side of each target: which ops it takes, how a shard is compiled, which executors run it."""

from __future__ import annotations

from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ClassVar, Protocol

from shard.bundle import file_record
from shard.errors import TargetError


class SampleRuns(Protocol):
    """The runs a build makes on the simulator where it was built, right after the build, so that a
    check of the bundle need not build it again (shard.compilation.fidelity.BuildRuns). A run is
    (arrays, formats): the arrays in the shard's input order, each one's layout for the runtime."""

    def building(self) -> AbstractContextManager:
        """Held while the build (or a cached build's build for the simulator) holds its worker: runs
        that take this build's outputs wait for it to end."""
        ...

    def wanted(self, artifact: str | None) -> list[tuple[list, list[str]]]:
        """The runs still to make: all of them for a build made now (artifact None); for one taken
        from the cache (its artifact's sha256), those no earlier build ran. [] where none is wanted
        or the inputs are not known yet."""
        ...

    def made(self, artifact: str, outputs: list[list]) -> None:
        """The outputs of each run wanted() gave last, in its order, for the artifact built."""
        ...


@dataclass
class ShardJob:
    """One shard to compile: its ONNX file in, its artifact and log out."""

    name: str
    onnx: Path
    artifact: Path | None
    log: Path
    precision: str = "fp16"
    dataset: list[list[Path]] | None = None   # quantization samples: per sample, one .npy per input
    float16: list[str] | None = None          # mixed precision: the ops (node and tensor names) kept in fp16
    figures_key: str | None = None            # its model's build_cache.structure_key: figures kept by it too
    recover: bool = True                      # a crash in a rule the log names is retried with it off
    disable_rules: list[str] = field(default_factory=list)   # the rules its build crashed in, turned off
    runs: SampleRuns | None = None            # runs to make on the simulator where it builds (vendor targets)

    def built_from(self) -> dict[str, str]:
        """The sha256 of the files the build read and wrote ("onnx", "onnx.data" if any, "artifact"),
        taken when it ended: what ties the artifact a bundle ships to the ONNX it simulates."""
        data = self.onnx.with_name(f"{self.onnx.name}.data")
        files = {"onnx": self.onnx, "onnx.data": data if data.is_file() else None, "artifact": self.artifact}
        return {role: file_record(path)["sha256"] for role, path in files.items() if path is not None}


@dataclass
class ShardBuild:
    """What compiling one shard produced. Its diagnostics, in the words every target's builds report in
    (shard.never_worse.AXES reads them): overflow_lines (lines saying a hardware limit overflows: the
    build returned 0, the board would fail) and first_overflow, error_lines and first_error, cpu_ops and
    fallbacks (layers on the host CPU; layers run in a lesser mode than asked), estimated_cycles (the
    compiler's estimate) and cost_cycles; a target adds its own beside them."""

    name: str
    seconds: float
    diagnostics: dict = field(default_factory=dict)
    error: str | None = None      # why the build is unusable (failed, crashed, overflowed), with its log
    cached: bool = False          # taken from the build cache (shard.targets.build_cache), not built now
    figures_only: bool = False    # the figures of a build of the same structure, other weights: no artifact
    peak_bytes: int | None = None # the worker's peak resident memory during the build (None: not built now)
    built_from: dict[str, str] = field(default_factory=dict)   # ShardJob.built_from when it was built


class Target:
    """The compile side of a target. The defaults are those of a target whose shard files are what
    runs or what the device builds later (cpu, the GPU targets): no vendor build here to stand beside,
    no layout of its own, nothing to ask while the passes run. A vendor target (shard.targets.rknn)
    overrides them."""

    name: str
    executors: tuple[str, ...] = ("cpu",)   # the runtime backends that can run its artifacts, default first
    artifact_suffix: str | None = None
    vendor = False                   # a vendor compiler builds the shards: compile compares with it alone
    precisions: tuple[str, ...] = ("fp32",)   # what its shards can be built in, default first
    pipeline: tuple[Callable, ...] = ()      # its passes, in order (shard.passes.NPU_PIPELINE, ...)
    # How its toolkit's users know the build figures the summary and the comparison lines print
    # (shard.never_worse.LABELS's keys, and "fallback": what one fallback does), where not by the common words
    words: ClassVar[dict[str, str]] = {}
    min_opset = 0                    # the opset its shard files are lifted to, at least
    max_opset: int | None = None     # and lowered to, at most (the newest its compiler loads)
    stage_streams = False            # shard k runs on stream ("core") k: a pipeline of stages (GPU)
    build_note = "the shard ONNX file is what runs"   # the build log of a target that builds nothing here

    def build_options(self, options) -> dict:
        """The options every shard is built with (the manifest's `build`)."""
        return {}

    def build_for(self, build: dict, precision: str, float16: list[str] | None = None,
                  disable_rules: list[str] = ()) -> dict:
        """The build options of one shard: the compile's `build` at the shard's precision (mixed: with
        the ops kept in fp16; with the vendor's rules its build crashed in turned off)."""
        return build

    def check_environment(self) -> None:
        """Fail early, in one line, where what builds its shards is missing."""

    def toolchain(self) -> str:
        """What builds its shards here, with its version ("rknn-toolkit2 2.5.0"; "" where nothing
        does): part of every cache key."""
        return ""

    def builds(self, workers: int, timeout: float, cache: Path | None, log_dir: Path, ray: str | None = None) -> Builds:
        """Builds of this target's shards, `workers` at a time (a context manager: see Builds).
        cache: a build cache directory (shard.targets.build_cache), or None to build everything;
        ray: a Ray cluster the builds run on (shard.targets.rknn.remote), or None for this machine."""
        return LogsOnly(f"{self.name}: {self.build_note}")

    def edge_layouts(self, log: Path, inputs: dict[str, list[int]], outputs: dict[str, list[int]]
                     ) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
        """From a shard's build log: the inputs and outputs the compiler reshaped into its own layout
        on the CPU, with that layout's shape (the shard is built again so: shard.graph.relayout). None
        here: any shape runs as it is."""
        return {}, {}

    def build_bytes(self, weight_bytes: int) -> int:
        """The peak memory of one vendor build of a model holding `weight_bytes` of weights; 0 where
        nothing is built here."""
        return 0

    def shards_for_memory(self, weight_bytes: int, jobs: int) -> int:
        """The fewest shards whose builds, `jobs` at once, fit in memory beside the compile; 0 where a
        build's memory does not grow with its weights (nothing is built here)."""
        return 0

    def layer_names(self, log: Path) -> list[str]:
        """The layers a shard's build log lists (the vendor's layer table); none where it has none."""
        return []

    def pass_toolkit(self, profile, options):
        """Small cached builds the passes may ask for (legality of one op, cost of a region), or None."""
        return None

    def probe_toolkit(self, base, jobs: int, timeout: float, cache_dir: Path | None = None, read_cache: bool = True,
                      slow_factor: float | None = None, on_board: bool = False, ray: str | None = None):
        """What `shard probe` builds its families with (shard.probes.runner), starting from the profile
        `base`: `jobs` builds at once, each point cached; on_board, each clean point also run on a board
        of the chip (here, or on a node of the `ray` cluster that owns one)."""
        raise TargetError(f"{self.name}: `shard probe` learns the limits of targets with a vendor compiler")

    def replica_runner(self, model, outputs: list[str]):
        """A faster runner than onnxruntime of a search's gated replica (fp8_linears', w4a16_linears':
        PassContext.replica), or None."""
        return None


class Builds(Protocol):
    """Builds under way. `submit` may be called at any time, also while earlier jobs build (the vendor
    alone's build runs through the passes); `results` waits for the given ones. A build that fails
    comes back with its error, the others still build. Leaving the `with` block by an exception (a
    bug, SIGINT or SIGTERM) ends every build under way at once.

        with target.builds(workers, timeout, cache, logs) as builds:
            first = builds.submit([vendor_alone], build, on_done)
            ...
            results = builds.results(first + builds.submit(shards, build, on_done))
    """

    def start(self) -> None:
        """Get the build workers going now (they load the toolkit while the caller writes its jobs)."""
        ...

    def submit(self, jobs: list[ShardJob], build: dict, on_done: Callable[[ShardBuild], None]) -> list[Future]: ...

    def at_once(self, builds: int) -> None:
        """Run at most `builds` builds at a time from now on (a few large shards whose builds would
        pass the compile's memory side by side: shard.passes.partition's builds_at_once)."""
        ...

    def figures(self, job: ShardJob, build: dict) -> ShardBuild | None:
        """The figures of an earlier build of the same structure as the job's (its figures_key), with
        its log and no artifact; None if there is none."""
        ...

    def results(self, futures: list[Future]) -> list[ShardBuild]: ...

    def simulator(self):
        """The target's simulator on these workers, one built shard each at a time (the fidelity check:
        shard.compilation.fidelity.OneShardAtATime), or None where the target has none."""
        ...

    def __enter__(self) -> Builds: ...

    def __exit__(self, *exc) -> None: ...


class LogsOnly:
    """Builds of a target whose shard files are themselves what runs (cpu) or what the device builds
    (thor, cuda): each job's log says so, nothing is built here."""

    def __init__(self, note: str):
        self.note = note

    def start(self) -> None:
        pass

    def submit(self, jobs: list[ShardJob], build: dict, on_done: Callable[[ShardBuild], None]) -> list[Future]:
        futures = []
        for job in jobs:
            job.log.write_text(self.note + "\n")
            futures.append(Future())
            futures[-1].set_result(ShardBuild(name=job.name, seconds=0.0))
            on_done(futures[-1].result())
        return futures

    def at_once(self, builds: int) -> None:
        pass

    def figures(self, job: ShardJob, build: dict) -> None:
        return None

    def results(self, futures: list[Future]) -> list[ShardBuild]:
        return [f.result() for f in futures]

    def simulator(self) -> None:
        return None

    def __enter__(self) -> LogsOnly:
        return self

    def __exit__(self, *exc) -> None:
        pass
