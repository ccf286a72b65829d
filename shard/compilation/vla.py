"""A VLA (a folder of its three programs as ONNX, its embedding table and vla.json: `shard zoo export
pi0`) into a bundle (shard.runtime.vla): each program compiled as any model is, one pipeline stage each
on a GPU target (the steps run one after another: stages could never overlap, and each hand-off
between them costs the host), the embedding table and the spec beside them, each file recorded by
its sha256.

A precision other than fp16 (fp8, w4a16) searches each program on the values the chain hands it
(chain_samples: seeded observations through the source programs), not on seeded random inputs, and
is judged where a user judges it, on the action chunk (unless --no-check-fidelity): the same programs
are compiled in fp16 beside it and both bundles act on one seeded observation here (the GPU where the
machine has one, else onnxruntime). fp8_linears and w4a16_linears judge each program on its own
outputs, which the ten steps of the loop compound (Pi0 at four layers, searched on random inputs:
every program's FP8 search held, the chunk moved 3.7e-2 of its scale). Past the lossy
gate (the chunk's MSE against fp16's over its mean square, LOSSY_GATE) the programs are compiled again
with their searches held closer to fp16 (TIGHTER, TRIES); past it still, the bundle is the fp16 one,
and the compile says so, every try's figure.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from shard import scratch
from shard.bundle import read_manifest
from shard.calibration import ort_session
from shard.compare import compare
from shard.compilation.cached import compile_one_model
from shard.compilation.names import Progress
from shard.compilation.staging import check_options, check_output_path, replace_dir, staging_folder
from shard.compilation.variants import save_samples
from shard.errors import ShardError
from shard.options import CompileOptions
from shard.runtime.generative_bundle import EMBEDDINGS, record_files
from shard.runtime.session import pick_backend
from shard.runtime.vla import (PROGRAMS, VLA, VlaSession, VlaSpec, euler, joined_prefix, prompt_embeddings,
                               read_observations, read_vla, seeded_observation)
from shard.summary import StageSummary, staged
from shard.targets.chips import GPU_TARGETS


# Pi0.5 on Jetson Thor, BF16, an optimized plan's published breakdown (FACTS-thor.md): ms an observation
THOR_PI05_MS = {"vision": 17.0, "prefix": 54.0, "steps": 102.0, "total": 176.5}
STEPS = 10   # the Euler steps an observation takes by default (VlaSession.act)
# How far a lossy precision may move the action chunk: its MSE against the exact one over the chunk's mean
# square (FastWAM's gate for lossy methods on Thor, MSE < 5e-3: FACTS-thor.md); here against fp16's chunk,
# itself 3.3e-5 of the scale from fp32's for Pi0 on an H100
LOSSY_GATE = 5e-3
# Past the gate, the programs are compiled again with their --min-cosine this much closer to 1, at most
# TRIES times in all: each program's search holds its own outputs, which the loop's ten steps compound
# (Pi0 at depth 2, full widths, w4a16 searched on seeded random inputs: each program at 0.999, the chunk at
# 8.3e-3 of its scale; on the chain's values, 5.0e-4)
TIGHTER, TRIES = 10, 3
# A lossy compile calibrates each program on the values the chain hands it (chain_samples): this many
# seeded observations through the source programs, their vision and prefix inputs, and the step's at
# each of the loop's steps once among them
CHAIN_OBSERVATIONS = 8
CHAIN_SEEDS = range(1, 1 + CHAIN_OBSERVATIONS)   # not seed 0, the observation check_actions judges the chunk on


@dataclass
class VlaPrediction:
    """An observation's time on the target, predicted from each program's pipeline stages (the target's
    profile: a stage's measured kernels where `probe --ops` gave them, else the kernels of the form the
    cuda executor runs, at the profile's rates: shard.targets.gpu.roofline.node_seconds)."""
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
                f"{1e3 * self.seconds:.1f} ms an observation, {1 / self.seconds:.1f} Hz (the fused form's kernels "
                f"on the profile's rates, measured ones where `shard probe --ops` gave them); Pi0.5 on Thor, "
                f"published (BF16, an optimized plan): vision {published['vision']:g}, prefix {published['prefix']:g}, "
                f"{STEPS} steps {published['steps']:g} ms: {published['total']:g} ms, "
                f"{1e3 / published['total']:.1f} Hz")


def predicted(reports: dict[str, dict]) -> VlaPrediction | None:
    """The programs' predicted times (their stages' sum); None where they have no stages (cpu)."""
    if not all(staged(reports[name]) for name in PROGRAMS):
        return None
    seconds = {name: sum(stage.predicted_s for stage in StageSummary.of(reports[name]).stages) for name in PROGRAMS}
    return VlaPrediction(seconds["vision"], seconds["prefix"], seconds["step"])


@dataclass
class ActionCheck:
    """A lossy precision's action chunk beside the fp16 bundle's, on one seeded observation, STEPS steps."""
    precision: str
    share: float      # the chunk's MSE against fp16's, over fp16's mean square (NaN: it left its format)
    cosine: float
    backend: str      # where both ran
    kept: bool        # inside LOSSY_GATE: the bundle is in `precision`; else it is the fp16 one
    lowered: dict[str, float] = field(default_factory=dict)   # each program's share of its linears' MACs in it
    min_cosine: float | None = None   # the floor each program's search held
    tried: list[ActionCheck] = field(default_factory=list)   # the earlier tries, past the gate
    emptied: float | None = None   # the floor at which no program kept a linear in the precision (fp16 then)

    def line(self) -> str:
        earlier = "".join(f"at --min-cosine {t.min_cosine:g}: MSE {t.share:.2e} of its mean square{t.held()}, past the "
                          f"lossy gate ({LOSSY_GATE:g}); " for t in self.tried)
        floor = f"at --min-cosine {self.min_cosine:g}: " if self.tried else ""
        said = (f"--precision {self.precision}: the action chunk against the fp16 bundle's ({STEPS} steps of a seeded "
                f"observation, {self.backend}): {earlier}{floor}MSE {self.share:.2e} of its mean square, cosine "
                f"{self.cosine:.6f}{self.held()}")
        emptied = f"; at --min-cosine {self.emptied:g} no linear stays in {self.precision}" if self.emptied else ""
        return said + (f", inside the lossy gate ({LOSSY_GATE:g})" if self.kept else
                       f", past the lossy gate ({LOSSY_GATE:g}){emptied}: the bundle is fp16")

    def held(self) -> str:
        shares = ", ".join(f"{name} {share:.1%}" for name, share in self.lowered.items())
        return f" (the linears' MACs in {self.precision}: {shares})" if shares else ""


@dataclass
class VlaResult:
    bundle: Path
    spec: VlaSpec
    reports: dict[str, dict]   # each program's compile report
    predicted: VlaPrediction | None = None
    actions: ActionCheck | None = None   # a lossy precision's check (check_actions)


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
    # --calib: observations, the chain's start (each program's own samples are made from them)
    observations = read_observations(options.calib, spec, "--calib", samples=True) if options.calib else None
    options, lossy = replace(options, calib=None), options.precision != "fp16"
    staging, twin = staging_folder(output), None
    calib = scratch.folder("vla-calib") if lossy else None
    try:
        calibs = chain_samples(source, spec, calib, progress, observations) if calib else {}
        reports = compile_programs(source, target, staging, spec, options, progress, calibs)
        check = None
        if lossy and options.check_fidelity is not False:
            twin = staging_folder(output)
            fp16 = compile_programs(source, target, twin, spec, replace(options, precision="fp16"), progress)
            floor = options.min_cosine
            check = judged(staging, twin, options.precision, reports, floor, [], progress)
            while not check.kept and len(check.tried) + 1 < TRIES:   # again, the searches held closer to fp16
                floor = 1 - (1 - floor) / TIGHTER
                for name in PROGRAMS:
                    shutil.rmtree(staging / name)
                again = compile_programs(source, target, staging, spec, replace(options, min_cosine=floor), progress,
                                         calibs)
                if not any(StageSummary.of(again[name]).lowered for name in PROGRAMS):
                    check.emptied = floor   # nothing left in the precision there: the fp16 bundle
                    break
                reports = again
                check = judged(staging, twin, options.precision, reports, floor, [*check.tried, check], progress)
            if not check.kept:
                for name in PROGRAMS:
                    shutil.rmtree(staging / name)
                    (twin / name).rename(staging / name)
                reports = fp16
        replace_dir(staging, output)
    finally:
        for folder in (staging, twin):
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
        if calib is not None:
            scratch.remove(calib)
    return VlaResult(output, read_vla(output), reports, predicted(reports), check)


def compile_programs(source: Path, target: str, folder: Path, spec: VlaSpec, options: CompileOptions,
                     progress: Progress, calibs: dict[str, Path] | None = None) -> dict[str, dict]:
    """Each program of the VLA at `source` into `folder`, with the embedding table and the spec beside
    them: a VLA bundle (`calibs`: a program's --calib file, where it has one). Returns each program's
    compile report."""
    reports = {}
    for name in PROGRAMS:
        step = lambda what, *a, name=name: progress(f"{name}: {what}", *a)  # noqa: E731
        own = replace(options, calib=str(calibs[name])) if calibs and name in calibs else options
        reports[name] = compile_one_model(source / name / f"{name}.onnx", target, folder / name, own, step).report
    shutil.copyfile(source / EMBEDDINGS, folder / EMBEDDINGS)
    (folder / VLA).write_text(replace(spec, files=record_files(folder)).to_json())   # the table's size and sha256
    return reports


def chain_samples(source: Path, spec: VlaSpec, folder: Path, progress: Progress,
                  observations: list[dict] | None = None) -> dict[str, Path]:
    """Each program's inputs as the chain makes them, one --calib file a program in `folder`:
    `observations` (the user's --calib; CHAIN_OBSERVATIONS seeded ones without it, their noise seeded
    where they have none) through the source programs in onnxruntime (fp32), the vision program on
    their pixels, the prefix on their features joined to their prompts' embeddings, the step at each of
    the loop's STEPS steps once among them (of N observations, observation o gives the steps k with
    k % N == o). Seeded random inputs are no stand-in for these: the prompt's embeddings are sqrt(width) times
    a unit row, the keys and values are the prefix's, the time runs from 1 to 0, and the chunk is moved
    by what each program's search let through in the range the chain gives it (Pi0 at depth 2, fp8, every
    program's search at 0.99999 on random inputs: the chunk moved 6.1e-3 of its scale)."""
    observations = observations or [seeded_observation(spec, seed) for seed in CHAIN_SEEDS]
    observations = [obs if "noise" in obs else {**obs, "noise": np.random.default_rng(o).standard_normal(
        spec.observation_shapes["noise"])} for o, obs in enumerate(observations)]
    table = np.load(source / EMBEDDINGS, mmap_mode="r")
    samples: dict[str, list[dict]] = {name: [] for name in PROGRAMS}

    def run(name: str, feeds: list[dict]) -> list[dict]:
        session = ort_session(source / name / f"{name}.onnx")
        outputs = [o.name for o in session.get_outputs()]
        return [dict(zip(outputs, session.run(outputs, f))) for f in feeds]

    progress("calibration: the chain on the observations", 0, 3)
    samples["vision"] = [{"pixel_values": obs["pixel_values"].astype(np.float32)} for obs in observations]
    features = run("vision", samples["vision"])
    progress("calibration: the chain on the observations", 1, 3)
    for obs, made in zip(observations, features):
        text = prompt_embeddings(table, obs["tokens"].reshape(-1), spec.width)
        samples["prefix"].append({"prefix_embeds": joined_prefix(made["image_features"], text, spec.width)})
    caches = run("prefix", samples["prefix"])
    progress("calibration: the chain on the observations", 2, 3)
    session = ort_session(source / "step" / "step.onnx")
    for o, (obs, cache) in enumerate(zip(observations, caches)):
        state = obs["state"].reshape(1, spec.actions).astype(np.float32)

        def velocity(x, now, k, o=o, state=state, cache=cache):
            feeds = {"x_t": x, "time": now, "state": state, **{name: cache[name] for name in spec.cache_names}}
            if k % len(observations) == o:
                samples["step"].append(feeds)
            return session.run(["velocity"], feeds)[0]
        euler(obs["noise"].astype(np.float32), STEPS, velocity)
    progress("calibration: the chain on the observations", 3, 3)
    return {name: save_samples(folder / f"{name}.npz", rows) for name, rows in samples.items()}


def judged(bundle: Path, fp16: Path, precision: str, reports: dict, floor: float, tried: list,
           progress: Progress) -> ActionCheck:
    """check_actions, with each program's share in the precision, the floor its search held, and the
    earlier tries."""
    progress("the action chunk beside fp16's", len(tried), TRIES)
    check = check_actions(bundle, fp16, precision)
    check.lowered = {name: StageSummary.of(reports[name]).lowered for name in PROGRAMS}
    check.min_cosine, check.tried = floor, tried
    return check


def check_actions(bundle: Path, fp16: Path, precision: str) -> ActionCheck:
    """`bundle` (in `precision`) and `fp16` (the same programs in fp16) acting on one seeded observation,
    on the backend that runs them here (pick_backend: the GPU where this machine has one, else onnxruntime)."""
    backend = pick_backend(read_manifest(bundle / "vision"))
    obs = seeded_observation(read_vla(bundle))
    chunks = []
    for folder in (bundle, fp16):
        with VlaSession(folder, backend=backend) as session:
            chunks.append(session.act(obs["pixel_values"], obs["tokens"], obs["state"], obs["noise"], STEPS).actions)
    got, want = (chunk.astype(np.float64) for chunk in chunks)
    share = float(np.mean((got - want) ** 2) / np.mean(want ** 2))
    return ActionCheck(precision, share, compare("actions", want, got).cosine, backend, bool(share < LOSSY_GATE))
