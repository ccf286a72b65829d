"""A VLA (a folder of its three programs as ONNX, its embedding table and vla.json: `shard zoo export
pi0`) into a bundle (shard.runtime.vla): each program compiled as any model is, one pipeline stage each
on a GPU target (the steps run one after another: stages could never overlap, and each hand-off
between them costs the host), the embedding table and the spec beside them, each file recorded by
its sha256."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, replace
from pathlib import Path

from shard.compilation.cached import compile_one_model
from shard.compilation.names import Progress
from shard.compilation.staging import check_options, check_output_path, replace_dir, staging_folder
from shard.errors import ShardError
from shard.options import CompileOptions
from shard.runtime.generative_bundle import EMBEDDINGS, record_files
from shard.runtime.vla import PROGRAMS, VLA, VlaSpec, read_vla
from shard.summary import StageSummary, staged
from shard.targets.chips import GPU_TARGETS


# Pi0.5 on Jetson Thor, BF16, an optimized plan's published breakdown (FACTS-thor.md): ms an observation
THOR_PI05_MS = {"vision": 17.0, "prefix": 54.0, "steps": 102.0, "total": 176.5}
STEPS = 10   # the Euler steps an observation takes by default (VlaSession.act)


@dataclass
class VlaPrediction:
    """An observation's time on the target, predicted from each program's pipeline stages (the roofline of
    the target's profile: a stage's measured kernels where `probe --ops` gave them, else rates and floors)."""
    vision_s: float
    prefix_s: float
    step_s: float
    steps: int = STEPS

    @property
    def seconds(self) -> float:
        return self.vision_s + self.prefix_s + self.steps * self.step_s

    def line(self, target: str) -> str:
        published = THOR_PI05_MS
        return (f"predicted on {target}: vision {1e3 * self.vision_s:.1f} ms, prefix {1e3 * self.prefix_s:.1f} ms, "
                f"{self.steps} steps {1e3 * self.steps * self.step_s:.1f} ms ({1e3 * self.step_s:.2f} a step): "
                f"{1e3 * self.seconds:.1f} ms an observation, {1 / self.seconds:.1f} Hz (the stages' roofline, "
                f"kernels measured only where `shard probe --ops` gave them); Pi0.5 on Thor, published (BF16, "
                f"an optimized plan): vision {published['vision']:g}, prefix {published['prefix']:g}, "
                f"{STEPS} steps {published['steps']:g} ms: {published['total']:g} ms, "
                f"{1e3 / published['total']:.1f} Hz")


def predicted(reports: dict[str, dict]) -> VlaPrediction | None:
    """The programs' predicted times (their stages' sum); None where they have no stages (cpu)."""
    if not all(staged(reports[name]) for name in PROGRAMS):
        return None
    seconds = {name: sum(stage.predicted_s for stage in StageSummary.of(reports[name]).stages) for name in PROGRAMS}
    return VlaPrediction(seconds["vision"], seconds["prefix"], seconds["step"])


@dataclass
class VlaResult:
    bundle: Path
    spec: VlaSpec
    reports: dict[str, dict]   # each program's compile report
    predicted: VlaPrediction | None = None


def compile_vla(source: Path, target: str, output: Path, options: CompileOptions | None = None,
                progress: Progress = lambda *a: None) -> VlaResult:
    """The VLA folder at `source` into a bundle at `output`; nothing left there on failure."""
    options = options or CompileOptions()
    check_options(options)
    if target not in (*GPU_TARGETS, "cpu"):
        raise ShardError(f"--target {target}: a VLA compiles for the GPU targets ({', '.join(GPU_TARGETS)}) or cpu; "
                         f"its denoising loop on an NPU is not built yet")
    spec = read_vla(source)
    missing = [name for name in (*[f"{p}/{p}.onnx" for p in PROGRAMS], EMBEDDINGS) if not (source / name).is_file()]
    if missing:
        raise ShardError(f"{source}: a VLA folder holds {', '.join(missing)}; none there (shard zoo export pi0)")
    check_output_path(output, source)
    if target in GPU_TARGETS and not options.shards:
        options = replace(options, shards=1)
    staging = staging_folder(output)
    try:
        reports = {}
        for name in PROGRAMS:
            step = lambda what, *a, name=name: progress(f"{name}: {what}", *a)  # noqa: E731
            reports[name] = compile_one_model(source / name / f"{name}.onnx", target, staging / name, options,
                                              step).report
        shutil.copyfile(source / EMBEDDINGS, staging / EMBEDDINGS)
        spec = replace(spec, files=record_files(staging))   # the table's size and sha256
        (staging / VLA).write_text(spec.to_json())
        replace_dir(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return VlaResult(output, spec, reports, predicted(reports))
