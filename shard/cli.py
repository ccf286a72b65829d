"""The `shard` command: one function per sub-command, each a thin layer over the Python API."""

from __future__ import annotations

import json
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from shard.errors import ShardError
from shard.options import check_seconds
from shard.output_files import check_output_file
from shard.summary import (SpeedRow, StageSummary, Summary, describe_step, image_room_lines, shards_table, speed_lines,
                           speed_table, stage_lines, stage_table, summary_lines)
from shard.targets.chips import DEFAULT_TARGET, targets_help

app = typer.Typer(help="Make models that edge NPUs choke on compile, run and stay accurate on them.",
                  no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False)
toolkit_app = typer.Typer(help="The vendor toolkit environments (rknn-toolkit2 lives in its own venv).",
                          no_args_is_help=True)
zoo_app = typer.Typer(help="Real architectures with seeded random weights, exported offline.", no_args_is_help=True)
app.add_typer(toolkit_app, name="toolkit")
app.add_typer(zoo_app, name="zoo")
cache_app = typer.Typer(help="The caches of vendor builds and probe points.", no_args_is_help=True)
app.add_typer(cache_app, name="cache")
# Piped output (logs, CI) gets wide tables rather than rich's default of 80 columns.
console = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 160)


@contextmanager
def progress_bar() -> Iterator:
    """A callback (step, done, total, note="") drawing one bar per step, on stderr; the note (what is
    happening within the step) is shown after the bar. A step named "GROUP: DETAIL" draws on GROUP's
    bar, DETAIL in its note: a compile's passes, a round of mixed precision or a generative
    program's steps take one line each."""
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TextColumn("{task.fields[note]}"), console=err, transient=False) as bar:
        tasks: dict[str, int] = {}

        def update(step: str, done: int, total: int, note: str = "") -> None:
            stop_point()
            group, _, detail = step.partition(": ")
            note = ", ".join(part for part in (detail, note) if part)
            for name, task in tasks.items():  # a new step means the earlier ones are finished
                if name != group:
                    bar.update(task, completed=bar.tasks[task].total)
            if group not in tasks:
                tasks[group] = bar.add_task(group, total=total, note=note)
            bar.update(tasks[group], completed=done, total=total, note=note)

        yield update
        for task in tasks.values():
            bar.update(task, completed=bar.tasks[task].total)


def parse_shape(text: str) -> tuple[str, tuple[int, ...]]:
    name, sep, dims = text.rpartition("=")
    try:
        if not sep or not name:
            raise ValueError
        shape = tuple(int(d) for d in dims.split(","))
        if min(shape) < 1:
            raise ShardError(f"--input-shape {text!r}: every dimension must be at least 1")
        return name, shape
    except ValueError:
        raise ShardError(f"--input-shape {text!r}: expected NAME=D0,D1,... such as pixel_values=1,3,224,224") from None


def parse_value(text: str) -> tuple[str, list[float]]:
    """--input-value NAME=V0,V1,...: the numbers an input is fixed to."""
    name, sep, values = text.rpartition("=")
    try:
        if not sep or not name:
            raise ValueError
        return name, [int(v) if v.strip().lstrip("-").isdigit() else float(v) for v in values.split(",")]
    except ValueError:
        raise ShardError(f"--input-value {text!r}: expected NAME=V0,V1,... such as sr=16000") from None


def parse_batch(text: str) -> int | None:
    """--batch: a number of frames, or auto (None: the cost model picks)."""
    if text == "auto":
        return None
    if not text.isdigit() or int(text) < 1:
        raise ShardError(f"--batch {text!r}: expected a number of frames of at least 1, or auto")
    return int(text)


RAY_HELP = ("Run the vendor builds on this Ray cluster (ADDRESS, as `ray start` printed it), or on one started "
            "here (local); --jobs of them at a time. Needs `pip install 'shard[ray]'`.")

FIDELITY_HELP = ("Run the bundle and the vendor alone's on the simulator (the first --calib samples, else seeded "
                 "inputs of the model's domain); where shard's cosine is lower, the bundle holds the vendor's. "
                 "--check-fidelity builds the vendor alone whole for it; without the whole build the vendor alone "
                 "is each shard unrewritten. Costs a simulator build of both [default: on wherever the vendor alone "
                 "is compared].")


MIN_COSINE_HELP = ("fp16: the floor under the bundle's simulator cosine wherever fidelity is checked (a bundle under "
                   "it, or with a NaN or an Inf in any precision, is not written); --precision mixed: the cosine on "
                   "the calibration samples to reach.")


COMPILE_HELP = {   # the longer option helps of `shard compile`
    "models": 'The ONNX model; or a decoder (a GGUF file or a transformers folder) for a generative bundle (`shard '
        'generate`). Several: each compiled in turn, to MODEL[-TARGET].shard.',
    "input_shape": "Fix an input's shape: NAME=1,3,512,512; or buckets: input_ids=1,64|1,128|1,256 (a variant each; "
        'inputs run on the smallest that fits).',
    "shards": 'Number of shards [default: one, as each cut is a hand-off on the board; for a model of over about '
        '320 MB of weights, as many as keep its vendor builds, one at a time, within half of the memory of '
        "the whole model's; thor and cuda: pipeline stages, 2].",
    "disable": 'Skip an optional pass (repeatable): slow_paths, tile_attention, legalize, host_edges.',
    "tile_attention": 'auto (tile attention only where a limit requires it), off, or force.',
    "fusion_barrier": 'check (confirm tiles stay apart in the vendor log), rules (also pass --disable-rule names to the '
        'toolkit) or pill.',
    "disable_rule": 'A toolkit fusion rule to switch off (with --fusion-barrier rules; repeatable).',
    "dump_after": 'PASS DIR: write the graph after PASS as DIR/after-PASS.onnx.',
    "vendor_baseline": 'Also build the model as it came with the vendor toolkit alone, print both side by side, and never be'
        ' worse than it.',
    "vendor_alone": 'How the vendor alone is built for the comparison: whole (the model as it came, one build), shards '
        "(each shard built without its rewrites: no build beyond shard's own, for machines the whole build "
        'does not fit), or auto (whole where its predicted memory is at most half of what is available, and, '
        'for a large model in fp16, a core is free for it beside the --jobs builds).',
    "vendor_only": "Make the vendor alone's bundle instead (the model as it came, one build, no rewrites): a baseline to"
        " run and verify beside shard's.",
    "precision": 'fp16; int8 (every shard quantized by the vendor from the calibration samples each shard sees); or '
        'mixed (linears in int8, the rest in fp16, the most sensitive linears moved to fp16 until --min-'
        'cosine holds on the simulator).',
    "allow_low_fidelity": 'Write a bundle under the fidelity floor, with a warning.',
    "calib": "Calibration samples: an .npz of arrays named after the model's inputs, each with a leading sample "
        'axis ([N, 1, 128] for input_ids) [default: 8 seeded random samples, with a warning].',
    "max_context": "A decoder: the KV cache's tokens, prompt and answer together; or buckets, 256,2048 (a program each; "
        'the cache moves up).',
    "one_step": 'A decoder: one program per --max-context, of --chunk tokens, for the answer too: one copy of the '
        'weights where there are two, each answer token a step of --chunk.',
    "batch_size": "Frames a run takes at once (the inputs' leading axis, dynamic in the model); auto: the GPU cost "
        "model's choice.",
    "no_cache": 'Compile and build everything again instead of reusing the bundle of an unchanged compile and the '
        'builds of identical shards (~/.cache/shard/builds or $SHARD_BUILD_CACHE).',
}


@app.command("compile")
def compile_command(
    models: list[Path] = typer.Argument(..., help=COMPILE_HELP["models"]),
    target: str = typer.Option(DEFAULT_TARGET, "--target", "-t", help=targets_help() + " Several: T1,T2,..."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Bundle directory [default: MODEL.shard]."),
    input_shape: list[str] = typer.Option([], "--input-shape", help=COMPILE_HELP["input_shape"]),
    input_value: list[str] = typer.Option([], "--input-value", help="Fix an input (NAME=16000): an If it chooses inlined."),
    shards: Optional[int] = typer.Option(None, help=COMPILE_HELP["shards"]),
    max_ops: Optional[int] = typer.Option(None, help="At most this many ops per shard (adds shards)."),
    jobs: int = typer.Option(2, "--jobs", "-j", help="Vendor builds in parallel."),
    ray: Optional[str] = typer.Option(None, "--ray", help=RAY_HELP),
    timeout: float = typer.Option(1800.0, help="Seconds one vendor build may take."),
    profile: Optional[Path] = typer.Option(None, help="Target profile JSON instead of the shipped one."),
    disable: list[str] = typer.Option([], "--disable", help=COMPILE_HELP["disable"]),
    tile_attention: str = typer.Option("auto", help=COMPILE_HELP["tile_attention"]),
    fusion_barrier: str = typer.Option("check", help=COMPILE_HELP["fusion_barrier"]),
    disable_rule: list[str] = typer.Option([], "--disable-rule", help=COMPILE_HELP["disable_rule"]),
    dump_after: Optional[tuple[str, Path]] = typer.Option(None, "--dump-after", help=COMPILE_HELP["dump_after"]),
    vendor_baseline: bool = typer.Option(True, help=COMPILE_HELP["vendor_baseline"]),
    vendor_alone: str = typer.Option("auto", help=COMPILE_HELP["vendor_alone"]),
    vendor_only: bool = typer.Option(False, help=COMPILE_HELP["vendor_only"]),
    precision: str = typer.Option("fp16", help=COMPILE_HELP["precision"]),
    min_cosine: float = typer.Option(0.999, help=MIN_COSINE_HELP),
    allow_low_fidelity: bool = typer.Option(False, "--allow-low-fidelity", help=COMPILE_HELP["allow_low_fidelity"]),
    calib: Optional[Path] = typer.Option(None, help=COMPILE_HELP["calib"]),
    check_fidelity: Optional[bool] = typer.Option(None, "--check-fidelity/--no-check-fidelity", help=FIDELITY_HELP),
    max_context: str = typer.Option("512", help=COMPILE_HELP["max_context"]),
    chunk: str = typer.Option("auto", help="A decoder: the prompt's tokens a step (the prefill program's width); "
                                           "auto: the width the decode step's prediction says prefills fastest."),
    one_step: bool = typer.Option(False, "--one-step", help=COMPILE_HELP["one_step"]),
    batch_size: str = typer.Option("1", "--batch", help=COMPILE_HELP["batch_size"]),
    latency_budget: Optional[float] = typer.Option(None, help="--batch auto: milliseconds one batch may take."),
    no_cache: bool = typer.Option(False, "--no-cache", help=COMPILE_HELP["no_cache"]),
) -> None:
    """Compile MODEL into a bundle of shards for TARGET (each of several MODELs for each of several TARGETs)."""
    from shard.options import CompileOptions
    fixed, buckets = parse_shapes(input_shape)
    options = CompileOptions(input_shapes=fixed, input_values=dict(parse_value(v) for v in input_value), buckets=buckets,
                             shards=shards, max_ops=max_ops, jobs=jobs, ray=ray, timeout=timeout, profile=str(profile) if profile else None,
                             disable=tuple(disable), dump_after={dump_after[0]: str(dump_after[1])} if dump_after else {},
                             tile_attention=tile_attention, fusion_barrier=fusion_barrier,
                             disable_rules=tuple(disable_rule), vendor_baseline=vendor_baseline, vendor_alone=vendor_alone,
                             vendor_only=vendor_only, build_cache=not no_cache, check_fidelity=check_fidelity,
                             precision=precision, calib=str(calib) if calib else None, min_cosine=min_cosine,
                             allow_low_fidelity=allow_low_fidelity,
                             batch=parse_batch(batch_size), latency_budget=latency_budget and latency_budget / 1e3)
    compile_all(batch(models, target.split(","), output), options,
                {"capacity": parse_ids(max_context, "--max-context"), "chunk": parse_chunk(chunk), "one_step": one_step})


def parse_chunk(text: str) -> int | None:
    """--chunk N, or auto (None: chosen by the compile)."""
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise ShardError(f"--chunk {text!r}: expected a number of tokens or auto") from None


def compile_all(compiles: list[tuple[Path, str, Path | None]], options, steps: dict) -> None:
    """Each compile of one command in turn; of several, one that fails says why and the others go on.
    `steps`: a decoder's compile_generative arguments (capacity, chunk, one_step)."""
    failed = []
    for k, (model, target, output) in enumerate(compiles):
        if len(compiles) == 1:
            return compile_one_command(model, target, output, options, steps)
        console.rule(f"{k + 1}/{len(compiles)}: {model} for {target}")
        try:
            compile_one_command(model, target, output, options, steps)
        except ShardError as exc:
            err.print(f"[red]failed[/]: {model} for {target}: {escape(str(exc))}", highlight=False, soft_wrap=True)
            failed.append(f"{model.name} for {target}")
    if failed:
        raise ShardError(f"{len(failed)} of {len(compiles)} compiles failed ({', '.join(failed)}); each said why above")


def batch(models: list[Path], targets: list[str], output: Path | None) -> list[tuple[Path, str, Path | None]]:
    """(model, target, output) of each compile of one command: every model for every target; with more
    than one, each bundle beside its model, MODEL-TARGET.shard where there are several targets."""
    if len(models) * len(targets) == 1:
        return [(models[0], targets[0], output)]
    if output is not None:
        raise ShardError("-o names one bundle: with several models or targets each goes beside its model "
                         "(MODEL.shard, or MODEL-TARGET.shard for several targets)")
    return [(m, t, m.with_name(f"{m.stem}-{t}.shard") if len(targets) > 1 else None) for m in models for t in targets]


def compile_one_command(model: Path, target: str, output: Path | None, options, steps: dict) -> None:
    from shard.compilation import compile_model
    from shard.compilation.generative import is_causal_lm

    if is_causal_lm(model):
        return compile_decoder(model, target, output, options, steps)
    with progress_bar() as progress:
        result = compile_model(model, target, output, options, progress)
    print_compile_result(result)


def print_compile_result(result) -> None:
    if "buckets" in result.report:
        from shard.runtime.buckets import read_buckets

        for bucket in read_buckets(result.bundle).buckets:
            console.rule(bucket_title(bucket))
            print_compile_report(result.report["buckets"][bucket.name])
    else:
        print_compile_report(result.report)
    console.print(f"bundle: {result.bundle}")


def compile_decoder(model: Path, target: str, output: Path | None, options, steps: dict) -> None:
    """A GGUF checkpoint or transformers folder: a generative bundle, a program per step width."""
    from shard.compilation.generative import compile_generative

    with progress_bar() as progress:
        result = compile_generative(model, target, output or model.with_suffix(".shard"), options, **steps,
                                    progress=progress)
    vision = result.spec.vision
    if vision:
        console.rule(f"program vision: an image of {vision['image_size']} x {vision['image_size']} to its features")
        print_compile_report(result.reports[vision["program"]])
    for program in result.spec.programs:
        console.rule(f"program {program.name}: {program.width} token{'s' * (program.width > 1)} a step over a "
                     f"cache of {program.capacity}")
        print_compile_report(result.reports[program.name])
    if result.chunk is not None:
        console.print(f"--chunk auto: {result.chunk['chunk']} tokens a prompt step: {result.chunk['why']}")
    rows = [SpeedRow.of(row, f"predicted[{k}]") for k, row in enumerate(result.predicted)]
    if rows and rows[0].decode_tokens_per_s:
        console.print(speed_table(rows))
        for line in speed_lines(rows):
            console.print(line)
    if vision:
        most = vision["most"]
        for line in image_room_lines(most["squares"], most["tokens"], vision["image_size"], result.spec.capacity,
                                     rows[0]):
            console.print(line)
    console.print(f"bundle: {result.bundle}")


def bucket_title(bucket) -> str:
    return f"bucket {bucket.name}: {', '.join(f'{k}={v}' for k, v in bucket.inputs.items())}"


def parse_shapes(items: list[str]) -> tuple[dict, list[dict]]:
    """--input-shape NAME=1,128 fixes a shape; NAME=1,64|1,128|1,256 makes buckets, the k-th of every
    bucketed input together (all with the same count)."""
    fixed, choices = {}, {}
    for text in items:
        name, sep, dims = text.rpartition("=")
        shapes = [parse_shape(f"{name}={part}")[1] for part in dims.split("|")] if sep else [parse_shape(text)]
        if len(shapes) == 1:
            fixed[name] = shapes[0]
        else:
            choices[name] = shapes
    for name, shapes in choices.items():
        if len({len(s) for s in shapes}) > 1:
            raise ShardError(f"--input-shape {name}: every bucket's shape needs the same rank; got "
                             f"{' | '.join(','.join(map(str, s)) for s in shapes)}")
    counts = {len(v) for v in choices.values()}
    if len(counts) > 1:
        raise ShardError("--input-shape: every bucketed input needs the same number of shapes (the k-th of each "
                         f"make bucket k); got {', '.join(f'{n}: {len(v)}' for n, v in choices.items())}")
    buckets = [{name: shapes[k] for name, shapes in choices.items()} for k in range(counts.pop())] if counts else []
    return fixed, buckets


def print_compile_report(report: dict) -> None:
    """The shards' table and the summary under it, from the report's typed records (shard.summary)."""
    if "stages" in report["passes"]:   # a GPU target's pipeline stages
        staged = StageSummary.of(report)
        console.print(stage_table(staged.stages, f"{len(staged.stages)} pipeline stages, {staged.precision}"))
        for line in stage_lines(staged):
            console.print(line)
        return
    summary = Summary.of(report)
    console.print(shards_table(summary))
    for line in summary_lines(summary):
        console.print(line)


RUN_HELP = {   # the longer option helps of `shard run`
    "input": 'NAME=FILE.npy (FILE.npy for a model with one input); seeded random inputs if absent.',
    "backend": 'cpu, sim (rknn simulator), board (a Rockchip board), cuda (any NVIDIA GPU with torch) or tensorrt '
        '(engines from build-engines) [default: sim for Rockchip chips, cuda for thor and cuda].',
    "schedule": "balanced (any free core takes the most urgent ready shard) or round-robin (the manifest's placement;"
        ' less memory) [default: balanced; round-robin, a stream per stage, on GPUs].',
    "ray": "--backend board on a node of this Ray cluster that owns a board of the bundle's chip, one run per "
        'board at a time.',
}


@app.command("run")
def run_command(
    bundle: Path = typer.Argument(..., help="A bundle from `shard compile`."),
    input: list[str] = typer.Option([], "--input", "-i", help=RUN_HELP["input"]),
    backend: Optional[str] = typer.Option(None, help=RUN_HELP["backend"]),
    repeat: int = typer.Option(1, help="Run this many frames one after another (timings are per run)."),
    stream: int = typer.Option(0, help="Pipeline this many frames over the cores instead (throughput)."),
    cores: Optional[str] = typer.Option(None, help="NPU cores to use, e.g. 0,1,2 [default: the manifest's]."),
    schedule: Optional[str] = typer.Option(None, help=RUN_HELP["schedule"]),
    timeout: Optional[float] = typer.Option(None, help="Stop with an error if one shard runs longer (seconds)."),
    trace: Optional[Path] = typer.Option(None, help="Write every shard execution as a Chrome trace (Perfetto)."),
    seed: int = typer.Option(0, help="Seed of the random inputs (frame t of a stream uses seed + t)."),
    save: Optional[Path] = typer.Option(None, help="Directory to write the last frame's outputs as NAME.npy."),
    ray: Optional[str] = typer.Option(None, "--ray", help=RUN_HELP["ray"]),
) -> None:
    """Run a bundle; print the time of each shard, each core's utilisation and the outputs' shapes."""
    from shard.runtime import Session, random_inputs
    from shard.runtime.__main__ import check_save, read_inputs, save_outputs
    from shard.runtime.buckets import is_bucketed

    check_run_options(repeat, stream, timeout)
    check_save(save, bundle)
    if ray:
        return run_on_board_node(bundle, ray, input, repeat, save, timeout,
                                 others=backend not in (None, "board") or bool(stream or trace or cores or schedule))
    if is_bucketed(bundle):
        if stream or trace:   # a stream and its trace are one bucket's (its cores, its shards)
            raise ShardError(f"--stream and --trace run one bucket of a bundle of shape buckets: shard run "
                             f"{bundle}/b0 ... (the buckets are {bundle}/b0, b1, ...)")
        return run_buckets(bundle, input, backend, repeat, seed, save,
                           dict(cores=parse_cores(cores), schedule=schedule, timeout=timeout))
    frames = stream or repeat
    with progress_bar() as progress:
        progress(f"load ({backend or 'default backend'})", 0, 1)
        session = Session(bundle, backend, parse_cores(cores), schedule, timeout)
        try:
            given = read_inputs(input, [t.name for t in session.manifest.inputs]) if input else None
            specs = session.batching.frame_inputs if stream else session.manifest.inputs   # --batch B: stacked
            outputs, wall = run_frames(session, (given or random_inputs(specs, seed + t) for t in range(frames)),
                                       frames, bool(stream), progress)
        finally:
            session.close()
    print_run(session, frames, outputs, trace)
    if save:
        save_outputs(outputs, save)
    if stream:
        console.print(f"{frames} frames in {wall:.2f} s: {frames / wall:.2f} frames/s")
    else:
        console.print(f"{1000 * wall / frames:.1f} ms per run")


def run_frames(session, inputs, frames: int, stream: bool, progress) -> tuple[dict, float]:
    """The last frame's outputs and the wall seconds of `frames` run one after another, or pipelined
    over the cores (`stream`)."""
    started = time.perf_counter()
    if stream:
        for k, outputs in enumerate(session.run_stream(inputs)):
            progress(f"stream over cores {','.join(map(str, session.cores))}", k + 1, frames)
    else:
        for k, frame in enumerate(inputs):
            progress("run", k, frames)
            outputs = session.run(frame)
        progress("run", frames, frames)
    return outputs, time.perf_counter() - started


def print_run(session, frames: int, outputs: dict, trace: Path | None) -> None:
    """Each shard's mean time, the host steps', each core's use, the trace and the outputs' shapes."""
    table = Table(title=f"per-shard time ({session.backend}, {session.schedule}, mean of {frames})")
    for col in ("shard", "cores", "ms"):
        table.add_column(col, justify="left" if col == "shard" else "right")
    for t in session.timings.values():
        table.add_row(t.name, ",".join(map(str, sorted(t.cores))), f"{1000 * sum(t.seconds) / len(t.seconds):.1f}")
    console.print(table)
    steps = session.manifest.host_pre + session.manifest.host_post
    if steps:
        console.print(f"host steps ({', '.join(s.get('type', s['op']) for s in steps)}): "
                      f"{1000 * session.host_seconds / max(1, session.frames_run):.2f} ms per frame")
    for use in session.core_use():
        console.print(f"core {use.core}: {100 * use.utilisation:.1f}% busy ({use.runs} shard runs, "
                      f"{use.busy:.3f} s of {use.span:.3f} s)")
    if trace:
        console.print(f"trace: {session.write_trace(trace)} (open in ui.perfetto.dev)")
    for name, array in outputs.items():
        console.print(f"output {name}: shape {list(array.shape)} {array.dtype}")


def run_on_board_node(bundle: Path, address: str, input: list[str], repeat: int, save: Path | None,
                      timeout: float | None = None, others: bool = False) -> None:
    """`shard run --backend board --ray`: the bundle packed and run by the runtime's own command on a
    node of the cluster that owns a board of its chip (shard.targets.rknn.remote.run_pack), each shard
    stopped past `timeout` seconds there; what it printed shown here, its outputs saved here. `others`:
    whether options it cannot pass on were given."""
    import io

    import numpy as np

    from shard import scratch
    from shard.bundle import read_manifest
    from shard.errors import RunError
    from shard.pack import pack_bundle
    from shard.runtime.__main__ import read_inputs
    from shard.targets.rknn.remote import on_board, run_pack

    if others:
        raise ShardError("--ray runs the bundle on a board's node as `python -m shard.runtime` does: "
                         "--backend board with --input, --repeat, --save and --timeout only")
    manifest = read_manifest(bundle)
    given = read_inputs(input, [t.name for t in manifest.inputs]) if input else {}
    with scratch.temporary("board-pack") as tmp:
        pack = Path(tmp) / f"{bundle.resolve().name.removesuffix('.shard') or 'model'}.tar.gz"
        data = pack_bundle(bundle, pack).read_bytes()
    sent = {}
    for name, array in given.items():
        buffer = io.BytesIO()
        np.save(buffer, array)
        sent[name] = buffer.getvalue()
    with console.status(f"running on a {manifest.target} board of the Ray cluster at {address}"):
        code, out, err, outputs = on_board(address, manifest.target, run_pack, data, sent, repeat, timeout)
    if code != 0:
        lines = [line.removeprefix("error: ") for line in err.splitlines() if line.strip()]
        raise RunError(f"on the {manifest.target} board's Ray node: {lines[-1] if lines else f'exit code {code}'}")
    console.print(out.rstrip(), highlight=False)
    if save:
        save.mkdir(parents=True, exist_ok=True)
        for name, npy in outputs.items():
            (save / f"{name}.npy").write_bytes(npy)


def run_buckets(bundle: Path, input: list[str], backend: str | None, repeat: int, seed: int, save: Path | None,
                session_args: dict) -> None:
    """`shard run` on a bundle of shape buckets: each frame on the smallest bucket its inputs fit (each
    bucket's session with the cores, schedule and timeout asked for)."""
    from shard.runtime import load, random_inputs
    from shard.runtime.__main__ import read_inputs, save_outputs

    with load(bundle, backend=backend, **session_args) as session:
        largest = session.spec.buckets[-1]
        names = list(largest.inputs)
        given = read_inputs(input, names) if input else None
        if given is None:   # seeded inputs of the largest bucket's shapes
            from shard.bundle import TensorSpec

            dtypes = {t.name: t.dtype for t in session.session(largest).manifest.inputs}
            given = random_inputs([TensorSpec(n, s, dtypes[n]) for n, s in largest.inputs.items()], seed)
        bucket = session.pick(given)
        started = time.perf_counter()
        for _ in range(repeat):
            outputs = session.run(given)
        wall = time.perf_counter() - started
    console.print(f"bucket {bucket.name} ({', '.join(f'{k}={v}' for k, v in bucket.inputs.items())}) for inputs "
                  f"{', '.join(f'{k}={list(v.shape)}' for k, v in given.items())}")
    for name, array in outputs.items():
        console.print(f"output {name}: shape {list(array.shape)} {array.dtype}")
    if save:
        save_outputs(outputs, save)
    console.print(f"{1000 * wall / repeat:.1f} ms per run")


def parse_cores(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(c) for c in text.split(",")]
    except ValueError:
        raise ShardError(f"--cores {text!r}: expected core numbers such as 0,1,2") from None


@app.command("generate")
def generate_command(
    bundle: Path = typer.Argument(..., help="A generative bundle: `shard compile` of a decoder."),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="The prompt, as text."),
    ids: Optional[str] = typer.Option(None, help="The prompt as token ids, comma-separated, instead of text."),
    chat: bool = typer.Option(False, help="Wrap the prompt in the model's own chat template."),
    image: list[Path] = typer.Option([], "--image", help="A VLM's bundle: an image the prompt is about (repeatable)."),
    max_new_tokens: int = typer.Option(32, help="Stop after this many new tokens (or at a stop token)."),
    temperature: float = typer.Option(0.0, help="0: greedy; above 0: sampled at this temperature."),
    top_p: float = typer.Option(1.0, help="Sample from the most likely tokens whose probability reaches this."),
    seed: int = typer.Option(0, help="Seed of the sampling."),
    backend: Optional[str] = typer.Option(None, help="cpu, sim (rknn simulator), board, cuda "
                                                     "[default: the bundle's target's first]."),
    timeout: Optional[float] = typer.Option(None, help="Stop with an error if one shard runs longer (seconds)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the prompt's and the answer's token ids, "
                                                                 "the text and every step's time here."),
    force: bool = typer.Option(False, "--force", help="Replace the --json file if one is there."),
    hand_cache: bool = typer.Option(False, "--hand-cache", help="board: hand the cache to rknn-toolkit-lite2 every "
                                                                "step rather than hold it in NPU memory."),
) -> None:
    """Generate text with a decoder's bundle: the prompt in chunks, then a token a step, streamed."""
    from shard.runtime.generate import GenerativeSession, is_generative

    if json_out:
        check_output_file(json_out, "--json", bundle, force)
    check_seconds(timeout)
    if (prompt is None) == (ids is None):
        raise ShardError("give the prompt as --prompt TEXT or as --ids 1,2,3 (one of the two)")
    if not bundle.exists():
        raise ShardError(f"{bundle}: no such bundle (nothing there); compile a decoder (a GGUF file or a transformers "
                         f"folder) with `shard compile`")
    if not is_generative(bundle):
        raise ShardError(f"{bundle} is not a generative bundle (compile a decoder: a GGUF file or a transformers "
                         f"folder); run it with `shard run`")
    given = prompt if ids is None else parse_ids(ids)
    with GenerativeSession(bundle, backend=backend, timeout=timeout, held=not hand_cache) as session:
        show = (lambda text: print(text, end="", flush=True)) if prompt is not None else None
        out = session.generate(given, max_new_tokens, chat, temperature, top_p, seed, images=image or None,
                               on_text=show)
    if prompt is None:
        console.print(" ".join(map(str, out.tokens)))
    else:
        print()
    if out.full:
        err.print(f"[yellow]warning[/]: stopped after {len(out.tokens)} new tokens of --max-new-tokens {max_new_tokens}: "
                  f"the prompt's {len(out.prompt)} and they fill the cache's capacity of {out.full} (compile with a "
                  f"larger --max-context)")
    summary = out.to_json()
    seen = f"image {sum(summary['vision_ms']):.1f} ms, " if summary["vision_ms"] else ""
    err.print(f"{len(out.prompt)} prompt tokens, {len(out.tokens)} new; {seen}prefill {sum(summary['prefill_ms']):.1f} ms "
              f"in {len(summary['prefill_ms'])} steps, decode {summary['decode_tokens_per_s']} tokens/s "
              f"({session.backend})")
    if json_out:
        json_out.write_text(json.dumps(summary, indent=2) + "\n")


def check_run_options(repeat: int, stream: int, timeout: float | None) -> None:
    if repeat < 1 or stream < 0:
        raise ShardError("--repeat must be at least 1 and --stream at least 0")
    check_seconds(timeout)


def parse_ids(text: str, option: str = "--ids") -> list[int]:
    """Comma-separated non-negative integers (--ids, --max-context)."""
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ShardError(f"{option} {text!r}: expected numbers such as 1,2,3") from None
    if not ids or min(ids) < 0:
        raise ShardError(f"{option} {text!r}: expected at least one non-negative number")
    return ids


@app.command("verify")
def verify_command(
    bundle: Path = typer.Argument(..., help="A bundle from `shard compile`."),
    reference: Path = typer.Option(..., "--reference", "-r", help="The original ONNX model."),
    backend: Optional[str] = typer.Option(None, help="cpu, sim, cuda or tensorrt [default: sim for Rockchip chips, cuda for "
                                                     "thor and cuda]."),
    min_cosine: float = typer.Option(0.999, help="Fail (exit 1) if an output's cosine is below this."),
    seed: int = typer.Option(0, help="Seed of the random inputs."),
    inputs: Optional[Path] = typer.Option(None, "--inputs", help="Samples to run, an .npz of arrays named after "
                                          "the model's inputs with a leading sample axis [default: one seeded "
                                          "random sample]."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the report here."),
    force: bool = typer.Option(False, "--force", help="Replace the --json file if one is there."),
    prompt: list[str] = typer.Option([], "--prompt", help="A generative bundle: a chat prompt to check (repeatable) "
                                                          "[default: two built-in prompts]."),
    new: int = typer.Option(32, help="A generative bundle: greedy tokens compared per prompt."),
    forced: int = typer.Option(32, help="A generative bundle: teacher-forced steps per prompt."),
    min_top1: float = typer.Option(0.99, help="A generative bundle: fail below this share of teacher-forced steps "
                                              "whose most likely token is the reference's."),
) -> None:
    """Check a bundle against the original model: end to end, and each shard fed the reference's tensors
    (the last column: the same tensor in the end-to-end run, so where along the shards fidelity drops).
    A bundle of shape buckets is checked bucket by bucket; a generative bundle against its checkpoint
    (GGUF or transformers folder), prompt by prompt: greedy tokens and teacher-forced logits."""
    from shard.compare import worst_of
    from shard.runtime.buckets import is_bucketed, read_buckets
    from shard.runtime.generate import is_generative

    if json_out:
        check_output_file(json_out, "--json", bundle, force)
    if is_generative(bundle):
        return verify_decoder(bundle, reference, backend, prompt, new, forced, min_cosine, min_top1, json_out)
    if not is_bucketed(bundle):
        reports = {"": verify_one(bundle, reference, backend, min_cosine, seed, inputs)}
    else:
        reports = {}
        for b in read_buckets(bundle).buckets:
            console.rule(bucket_title(b))
            reports[b.name] = verify_one(bundle / b.name, reference, backend, min_cosine, seed, inputs)
    if json_out:
        from dataclasses import asdict

        data = {name: {**asdict(r), "passed": r.passed} for name, r in reports.items()}
        json_out.write_text(json.dumps(data[""] if "" in data else data, indent=2) + "\n")
    worst = worst_of(c for r in reports.values() for c in r.outputs).cosine
    if not all(r.passed for r in reports.values()):
        err.print(f"[red]FAIL[/]: end-to-end cosine {worst:.7f} < {min_cosine}")
        raise typer.Exit(1)
    console.print(f"[green]PASS[/]: end-to-end cosine {worst:.7f} >= {min_cosine}"
                  + (f" on every bucket ({len(reports)})" if len(reports) > 1 else ""))


def verify_decoder(bundle: Path, reference: Path, backend, prompts: list[str], new: int, forced: int,
                   min_cosine: float, min_top1: float, json_out: Path | None) -> None:
    """verify_generative with its table printed; exit 1 below either threshold."""
    from dataclasses import asdict

    from shard.compare import lowest
    from shard.verifier import PROMPTS, verify_generative

    if new < 1 or forced < 1:
        raise ShardError("--new and --forced must be at least 1")
    with progress_bar() as progress:
        report = verify_generative(bundle, reference, prompts or PROMPTS, new, forced, backend, min_cosine, min_top1,
                                   progress)
    for rel, check in report.files.items():
        console.print(f"file {rel}: {check}")
    table = Table(title=f"verify ({report.backend}) vs {report.reference}, chat prompts")
    for col in ("prompt", "tokens", f"greedy {new}", "forced steps", "top-1", "worst cosine", "mean cosine"):
        table.add_column(col, justify="left" if col == "prompt" else "right")
    for p in report.prompts:
        table.add_row(p.prompt, str(p.prompt_tokens), "same" if p.same_tokens else "[yellow]differ[/]", str(p.steps),
                      f"{p.top1:.4f}", f"{p.min_cosine:.7f}", f"{p.mean_cosine:.7f}")
    console.print(table)
    for p in report.prompts:
        if p.parting:
            console.print(f"{p.prompt!r} parts {p.parting}")
    if not report.reference_is_source:
        console.print("[yellow]warning[/]: the reference is not the checkpoint this bundle was compiled from (sha256 differs)")
    if json_out:
        json_out.write_text(json.dumps({**asdict(report), "passed": report.passed}, indent=2) + "\n")
    worst = lowest(p.min_cosine for p in report.prompts)
    top1 = min(p.top1 for p in report.prompts)
    line = f"worst teacher-forced cosine {worst:.7f}, top-1 agreement {top1:.4f}"
    if not report.passed:
        err.print(f"[red]FAIL[/]: {line} (at least {min_cosine} and {min_top1} asked)")
        raise typer.Exit(1)
    console.print(f"[green]PASS[/]: {line}; greedy tokens the same on "
                  f"{sum(p.same_tokens for p in report.prompts)} of {len(report.prompts)} prompts")


def verify_one(bundle: Path, reference: Path, backend, min_cosine: float, seed: int, inputs: Path | None):
    """verify_bundle with its tables printed."""
    from shard.bundle import read_manifest
    from shard.calibration import load_samples
    from shard.verifier import verify_bundle

    samples = load_samples(inputs, read_manifest(bundle).inputs, "--inputs") if inputs else None
    with progress_bar() as progress:
        report = verify_bundle(bundle, reference, backend, min_cosine, seed, progress=progress, samples=samples)
    for rel, check in report.files.items():
        console.print(f"file {rel}: {check}")
    if len(report.samples) > 1:
        per_sample = Table(title=f"{len(report.samples)} samples from {inputs.name}")
        for col in ("sample", "output", "cosine", "max abs diff"):
            per_sample.add_column(col, justify="right")
        for k, comps in enumerate(report.samples):
            for c in comps:
                per_sample.add_row(str(k), c.name, f"{c.cosine:.7f}", f"{c.max_abs_diff:.3g}")
        console.print(per_sample)
    table = Table(title=f"verify ({report.backend}) vs onnxruntime fp32")
    for col in ("where", "tensor", "cosine", "max abs diff", "end to end so far"):
        table.add_column(col, justify="left" if col in ("where", "tensor") else "right")
    for c in report.outputs:
        where = "end to end" if len(report.samples) < 2 else "end to end, worst sample"
        table.add_row(where, c.name, f"{c.cosine:.7f}", f"{c.max_abs_diff:.3g}", "")
    for shard, comps in report.shards.items():  # fed the reference's tensors; then as chained end to end
        for c, chained in zip(comps, report.chained.get(shard, [None] * len(comps))):
            table.add_row(shard, c.name, f"{c.cosine:.7f}", f"{c.max_abs_diff:.3g}",
                          f"{chained.cosine:.7f}" if chained else "")
    console.print(table)
    for shard, why in report.skipped_shards.items():
        console.print(f"[yellow]warning[/]: {shard} not checked alone: {why}")
    if not report.reference_is_source:
        console.print("[yellow]warning[/]: the reference is not the model this bundle was compiled from (sha256 differs)")
    return report


@app.command("inspect")
def inspect_command(
    model: Path = typer.Argument(..., help="An ONNX model."),
    target: str = typer.Option(DEFAULT_TARGET, help=targets_help()),
    input_shape: list[str] = typer.Option([], "--input-shape", help="NAME=D0,D1,... for a dynamic input."),
    profile: Optional[Path] = typer.Option(None, help="A profile from `shard probe` [default: the shipped one]."),
    disable: list[str] = typer.Option([], "--disable", help="Skip an optional pass (repeatable)."),
    precision: str = typer.Option("fp16", help="fp16, int8 or mixed: which scale sandwiches apply (thor, cuda: fp16 or fp8)."),
    calib: Optional[Path] = typer.Option(None, help="Calibration samples (.npz, as compile takes them): the ranges "
                                                    "the scale sandwich works from [default: seeded random]."),
) -> None:
    """List every op that breaks a limit of the target, its evidence, and what compile does about it
    (with --calib: the ranges, and where the scale sandwich would rescale, clamp or smooth)."""
    from shard.compilation.staging import check_options
    from shard.inspection import inspect_model
    from shard.options import CompileOptions

    options = CompileOptions(input_shapes=dict(parse_shape(s) for s in input_shape),
                             profile=str(profile) if profile else None, disable=tuple(disable),
                             precision=precision, calib=str(calib) if calib else None)
    check_options(options)
    with progress_bar() as progress:
        progress("inspect (rewriting passes, one-op builds)", 0, 1)
        result = inspect_model(model, target, options)
        progress("inspect (rewriting passes, one-op builds)", 1, 1)
    if result.stages:
        console.print(stage_table(result.stages, f"{model.name} on {target}: pipeline stages (profile {result.profile})"))
        return
    table = Table(title=f"{model.name} on {target}: ops over a limit (profile {result.profile})")
    for col in ("node", "op", "limit and evidence", "what compile does"):
        table.add_column(col, overflow="fold")
    order = {"rewrite": 0, "not fixed": 1, "cpu": 2}
    for f in sorted(result.findings, key=lambda f: order[f.kind]):
        style = {"rewrite": "", "not fixed": "red", "cpu": "yellow"}[f.kind]
        table.add_row(f.node, f.op, f.reason, f"[{style}]{f.action}[/]" if style else f.action)
    console.print(table)
    for when, steps in (("before the first shard", result.host_pre), ("after the last shard", result.host_post)):
        for step in steps:
            console.print(f"host step {when}: {describe_step(step)}")
    counts = {k: sum(1 for f in result.findings if f.kind == k) for k in order}
    console.print(f"{counts['rewrite']} rewrites, {counts['not fixed']} over a limit and not fixed, "
                  f"{counts['cpu']} ops that would run on the CPU")


@app.command("pack")
def pack_command(bundle: Path = typer.Argument(..., help="A bundle from `shard compile`."),
                 output: Optional[Path] = typer.Option(None, "--output", "-o", help="The pack [default: BUNDLE's "
                                                                                    "name .tar.gz]."),
                 with_onnx: bool = typer.Option(False, "--with-onnx", help="Also the shard ONNX files, so the pack "
                                                                          "runs anywhere with --backend cpu."),
                 force: bool = typer.Option(False, "--force", help="Replace the pack if one is there.")) -> None:
    """One .tar.gz with what a board needs: the artifacts, the manifest, the host steps, the runtime
    itself, run.py and a README. The same bundle packs to the same bytes."""
    from shard.pack import pack_bundle

    output = output or bundle.with_name(f"{bundle.stem}.tar.gz")
    check_output_file(output, "-o", bundle, force)
    path = pack_bundle(bundle, output, with_onnx)
    console.print(f"pack: {path} ({path.stat().st_size / 1e6:.1f} MB); on the board: tar xzf {path.name} && "
                  f"python {path.name[:-len('.tar.gz')]}/run.py --input x.npy")


@app.command("build-engines")
def build_engines_command(bundle: Path = typer.Argument(..., help="A bundle from `shard compile --target thor` "
                                                                  "(or cuda).")) -> None:
    """Build each stage's TensorRT engine here (on the device that will run it), then read back what
    every engine really runs and fail where a layer asked for FP8 came out FP16 or FP32."""
    from shard.targets.gpu.engines import build_engines

    with progress_bar() as progress:
        checks = build_engines(bundle, progress)
    table = Table(title=f"{bundle.name}: engines, what their layers run")
    for col in ("stage", "layers", "by precision", "FP8 nodes not visible (Myelin regions)"):
        table.add_column(col)
    for c in checks:
        table.add_row(c.stage, str(c.layers), ", ".join(f"{k} {v}" for k, v in sorted(c.by_precision.items())),
                      str(len(c.unseen)))
    console.print(table)
    console.print(f"engines in {bundle / 'engines'}; run with `shard run {bundle} --backend tensorrt`")


@app.command("probe")
def probe_command(
    target: str = typer.Option(DEFAULT_TARGET, help="The chip whose compiler is probed (any Rockchip chip the toolkit "
                                              "builds for: its peak rates, quantized dtypes and limits; int8-only "
                                              "chips in int8; several: C1,C2,...; all: every one, each to "
                                              "./CHIP.profile.json); cuda measures the GPU at hand (bandwidth, "
                                              "matrix-product rates) for the roofline."),
    families: Optional[str] = typer.Option(None, help="Comma-separated families [default: all]; see --list."),
    jobs: int = typer.Option(2, "--jobs", "-j", help="Builds at a time (one toolkit worker each)."),
    ray: Optional[str] = typer.Option(None, "--ray", help=RAY_HELP),
    max_size: Optional[int] = typer.Option(None, help="Probe no size above this (caps every family)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Profile to write [default: ./TARGET.profile.json]. "
                                                                "An existing profile there keeps the limits not probed now."),
    replace: bool = typer.Option(False, help="Do not keep the limits of an existing --out profile."),
    cache_dir: Optional[Path] = typer.Option(None, help="Where probed points are kept [default: ~/.cache/shard/probes "
                                                        "or $SHARD_PROBE_CACHE]."),
    no_cache: bool = typer.Option(False, help="Build every point again (the cache is still written)."),
    slow_factor: float = typer.Option(4.0, help="A point is `slow` when the compiler's estimated cycles per MAC "
                                                "exceed the peak rate by this factor."),
    timeout: float = typer.Option(300.0, help="Seconds one probe build may take; past it the point fails (timeout)."),
    on_board: bool = typer.Option(False, help="Also run each clean point on NPU core 0 with rknn-toolkit-lite2 "
                                              "(on a board of the target chip); a failure there is class `board`."),
    list_families: bool = typer.Option(False, "--list", help="List the families and exit."),
    diff: Optional[tuple[str, str]] = typer.Option(None, "--diff", help="A B: the limits and facts that differ "
                                                                        "between two profiles (files, or shipped "
                                                                        "ones by target name), and exit."),
    ops: Optional[Path] = typer.Option(None, "--ops", help="--target cuda: also time every distinct op of this "
                                                           "thor/cuda bundle on the GPU, and each step of its "
                                                           "fused form (added to --out)."),
) -> None:
    """Learn a target's real limits: tiny ONNX graphs through the real compiler, double then bisect."""
    from shard.targets.rknn.cache import default_cache_dir
    from shard.probes.families import FAMILIES

    if diff:
        return print_profile_diff(*diff)
    if list_families:
        table = Table(title="probe families")
        for col in ("family", "graph (N is swept)", "settings", "kind"):
            table.add_column(col)
        for f in FAMILIES.values():
            kind = ("numeric (simulator)" if f.numeric else "slow + build" if f.macs else "build") \
                + (f", every N in {f.start}..{f.max_size} (not monotone)" if f.sweep else "")
            table.add_row(f.name, f.what, ", ".join(f.settings), kind)
        console.print(table)
        return
    if jobs < 1 or (max_size is not None and max_size < 1):
        raise ShardError("--jobs and --max-size must be at least 1")
    if target == "cuda":   # a GPU: measured rates and bandwidth, no compiler limits to search
        return probe_gpu(out or Path("cuda.profile.json"), ops)
    from shard.targets.chips import CHIPS

    chips = list(CHIPS) if target == "all" else target.split(",")
    if len(chips) > 1 and out is not None:
        raise ShardError("-o names one profile: with several chips each goes to ./CHIP.profile.json")
    for chip in chips:
        if len(chips) > 1:
            console.rule(chip)
        probe_chip(chip, out or Path(f"{chip}.profile.json"), replace, default_cache_dir() if cache_dir is None else
                   cache_dir, families=families.split(",") if families else None, jobs=jobs, max_size=max_size,
                   read_cache=not no_cache, slow_factor=slow_factor, timeout=timeout, on_board=on_board, ray=ray)


def probe_chip(target: str, out: Path, replace: bool, cache: Path, **how) -> None:
    """One chip's probe (shard.probes.runner.probe with `how`): its limits printed, its profile written."""
    from shard.probes.runner import merge_into, probe

    started = time.perf_counter()
    with progress_bar() as progress:
        profile, searches = probe(target, cache_dir=cache, progress=progress, **how)
    table = Table(title=f"{target} limits ({profile.toolkit})")
    for col in ("limit", "largest ok", "first failing", "class", "builds", "evidence"):
        table.add_column(col, justify="right" if col in ("largest ok", "first failing", "builds") else "left",
                         overflow="fold")
    builds = cached = 0
    for s in searches:
        b = s.boundary
        builds += b.builds
        cached += len(b.points) - b.builds
        lim = profile.limits[s.name]
        table.add_row(s.name, str(b.largest_ok), str(b.smallest_failing or "-"), lim.failure,
                      f"{b.builds}/{len(b.points)}", (b.failing_point.evidence if b.failing_point else "clean")[:160])
    console.print(table)
    if not replace:
        profile, kept = merge_into(out, profile)
        if kept:
            console.print(f"kept {kept} limits of {out} that this run did not probe")
    profile.save(out)
    console.print(f"{len(searches)} limits, {builds} builds, {cached} points from the cache ({cache}); "
                  f"{time.perf_counter() - started:.1f} s")
    console.print(f"profile: {out}")


def print_profile_diff(a_spec: str, b_spec: str) -> None:
    """`shard probe --diff A B`: what a user checks after a toolkit upgrade or on a new chip."""
    from shard.profile import diff_profiles, profile_at

    a, b = profile_at(a_spec), profile_at(b_spec)
    limits, facts = diff_profiles(a, b)
    table = Table(title=f"limits that differ: A = {a_spec} ({a.target}, {a.toolkit}), B = {b_spec} ({b.target}, "
                        f"{b.toolkit})")
    for col in ("limit", "A", "B", "A's evidence", "B's evidence"):
        table.add_column(col, overflow="fold", justify="right" if col in ("A", "B") else "left")
    from shard.probes.runner import compact

    def show(lim) -> str:
        if lim is None:
            return "-"
        return f"{lim.value} ({lim.failure})" if lim.passing is None else f"passes at {compact(lim.passing)} ({lim.failure})"
    for d in limits:
        table.add_row(d.name, show(d.a), show(d.b), d.a.evidence if d.a else "not probed",
                      d.b.evidence if d.b else "not probed")
    console.print(table)
    for name, (x, y) in facts.items():
        console.print(f"fact {name}: A {x!r}, B {y!r}")
    same = len({*a.limits, *b.limits}) - len(limits)
    console.print(f"{len(limits)} limits differ, {same} agree; {len(facts)} facts differ")


def probe_gpu(out: Path, ops: Path | None) -> None:
    from shard.probes.cuda import add_measured_ops, probe_cuda
    from shard.profile import load_profile

    with progress_bar() as progress:
        profile = load_profile("cuda", out) if ops and out.exists() else probe_cuda(progress)
        if ops:
            console.print(f"{add_measured_ops(profile, ops, progress)} distinct ops of {ops} timed")
    f = profile.facts
    console.print(f"{f['gpu']}: {f['sms']} SMs, DRAM {f['bandwidth_gbs']:.0f} GB/s, shortest kernel "
                  f"{1e6 * f['min_kernel_s']:.2f} us")
    table = Table(title="matrix products, TFLOP/s by size")
    table.add_column("precision")
    for gflop, _ in next(iter(f["gemm_tflops"].values())):
        table.add_column(f"{gflop:g} GFLOP", justify="right")
    for precision, points in f["gemm_tflops"].items():
        table.add_row(precision, *(f"{t:.1f}" for _, t in points))
    console.print(table)
    profile.save(out)
    console.print(f"profile: {out} (use it with --target cuda --profile {out})")


def cache_folders() -> dict[str, tuple[Path, str]]:
    """{cache: (folder, glob of one entry)}."""
    from shard.targets.rknn.cache import POINTS
    from shard.targets.rknn.cache import default_cache_dir as probe_cache
    from shard.cache_folder import default_cache_dir as build_cache

    return {"builds": (build_cache(), "*/build.json"), "probes": (probe_cache(), POINTS)}


@cache_app.command("info")
def cache_info() -> None:
    """Where the caches are and what they hold (vendor builds by content; probe points by toolkit and target)."""
    from shard.bundle_cache import MARKER
    from shard.cache_folder import folder_size, size_limit

    table = Table(title="shard caches")
    for col in ("cache", "folder", "entries", "MB"):
        table.add_column(col, justify="right" if col in ("entries", "MB") else "left")
    folders = cache_folders()
    for name, (folder, entry) in folders.items():
        entries, size = folder_size(folder, entry)
        table.add_row(name, str(folder), str(entries), f"{size / 1e6:.1f}")
    console.print(table)
    builds, _ = folders["builds"]
    bundles = sum(1 for _ in builds.glob(f"bundle-*/{MARKER}")) if builds.is_dir() else 0
    console.print(f"builds: at most {size_limit() / 2**30:g} GiB ($SHARD_BUILD_CACHE_SIZE), the least recently "
                  f"used go first; beside vendor builds, range statistics and the fidelity check's shard runs it holds "
                  f"{bundles} whole bundles "
                  "(a recompile of an unchanged model takes its bundle from there); $SHARD_BUILD_CACHE, "
                  "$SHARD_PROBE_CACHE move them; `shard cache clear` empties them")


@cache_app.command("clear")
def cache_clear(builds: bool = typer.Option(True, "--builds/--no-builds", help="Remove the vendor builds."),
                probes: bool = typer.Option(True, "--probes/--no-probes", help="Remove the probe points.")) -> None:
    """Remove cached vendor builds and probe points (the next compile or probe builds again); only what
    shard wrote, and only in a folder shard made its cache."""
    from shard.cache_folder import clear, entry_folders

    folders = cache_folders()
    for name, variable in (("builds", "SHARD_BUILD_CACHE"), ("probes", "SHARD_PROBE_CACHE")):
        if {"builds": builds, "probes": probes}[name]:
            folder, entry = folders[name]
            entries = entry_folders(folder) if name == "builds" else sorted(folder.glob(entry))
            count, size = clear(folder, entries, variable)
            console.print(f"{name}: removed {count} entries, {size / 1e6:.1f} MB ({folder})")


@toolkit_app.command("install")
def toolkit_install(target: str = typer.Argument(DEFAULT_TARGET),
                    force: bool = typer.Option(False, help="Recreate it even if installed.")) -> None:
    """Create the vendor toolkit environment for TARGET (idempotent)."""
    from shard.targets.rknn.env import get_spec, install, read_marker

    spec = get_spec(target)
    if read_marker(target) and not force:
        console.print(f"{spec.package} {spec.version} already installed")
    else:
        with err.status(f"installing {spec.package} {spec.version}") as status:
            install(target, on_step=lambda step: status.update(f"installing {spec.package}: {step}"), force=force)
    toolkit_status()


@toolkit_app.command("status")
def toolkit_status() -> None:
    """What toolkit environments are installed, their versions, and where."""
    from shard.targets.rknn.env import status

    table = Table(title="vendor toolkits")
    for col in ("target", "toolkit", "installed", "packages", "path"):
        table.add_column(col)
    for row in status():
        packages = ", ".join(f"{k} {v}" for k, v in row["packages"].items() if v)
        table.add_row(row["target"], f"{row['package']} {row['version']}", "yes" if row["installed"] else "no",
                      packages, row["path"])
    console.print(table)


@zoo_app.command("list")
def zoo_list() -> None:
    """The models `shard zoo export` builds."""
    from shard.zoo import MODELS

    table = Table(title="zoo")
    for col in ("name", "layers", "image", "what"):
        table.add_column(col)
    for m in MODELS.values():
        table.add_row(m.name, str(m.layers), str(m.image_size), m.description)
    console.print(table)


@zoo_app.command("export")
def zoo_export(
    name: str = typer.Argument(..., help="A name from `shard zoo list`."),
    output: Path = typer.Option(..., "--output", "-o", help="The ONNX file to write."),
    layers: Optional[int] = typer.Option(None, help="Encoder layers [default: the real model's]."),
    image_size: Optional[int] = typer.Option(None, help="Input image side, at least one patch (16; 14 for so400m)."),
    outliers: float = typer.Option(0.0, help="Plant a massive-activation channel of this magnitude."),
    seed: int = typer.Option(0, help="Seed of the random weights."),
    dynamic_batch: bool = typer.Option(False, help="Leave the batch axis dynamic (for `shard compile --batch`)."),
) -> None:
    """Export a zoo model (seeded random weights, eager attention, opset 17) to ONNX, offline."""
    import warnings

    from shard.zoo import export_model

    with err.status(f"exporting {name}"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = export_model(name, output, layers=layers, image_size=image_size, outliers=outliers, seed=seed,
                            dynamic_batch=dynamic_batch)
    console.print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")


STOPPED: list[int] = []   # the signals terminate() took


def terminate(signum, frame) -> None:
    """SIGTERM, raised where the process is as Ctrl-C would be: every command cleans up as it does then
    (a compile removes its staging folder and kills its toolkit workers). Raised while the process runs
    a finalizer (a `__del__` the garbage collector calls), Python prints it and goes on: stop_point()
    raises it again at the next progress step."""
    STOPPED.append(signum)
    raise KeyboardInterrupt()


def stop_point() -> None:
    """Raise the interrupt a signal asked for, on the main thread, if a finalizer swallowed it."""
    if STOPPED and threading.current_thread() is threading.main_thread():
        raise KeyboardInterrupt()


def main() -> None:
    import signal

    signal.signal(signal.SIGTERM, terminate)
    try:
        app()
    except ShardError as exc:
        from shard.runtime.scheduler import exit_now_if_stuck

        err.print(f"[red]error[/]: {escape(str(exc))}", highlight=False, soft_wrap=True)  # shapes look like markup
        exit_now_if_stuck(1)
        sys.exit(1)
