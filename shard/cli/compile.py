"""`shard compile`: a model (or a decoder) into a bundle, and the summary it prints."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from shard.cli.common import (FIDELITY_HELP, MIN_COSINE_HELP, RAY_HELP, bucket_title, console, err, parse_batch,
                              parse_ids, parse_shape, parse_value, progress_bar)
from shard.compilation import compile_model
from shard.compilation.generative import compile_generative, is_causal_lm
from shard.compilation.vla import compile_vla
from shard.errors import ShardError
from shard.options import CompileOptions
from shard.runtime.buckets import read_buckets
from shard.runtime.vla import is_vla
from shard.summary import (SpeedRow, StageSummary, Summary, image_room_lines, shards_table, speed_lines, speed_table,
                           stage_lines, stage_table, staged, summary_lines)
from shard.targets.chips import DEFAULT_TARGET, targets_help

app = typer.Typer(add_completion=False)


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
        'cosine holds on the simulator). GPU targets (thor, cuda): fp16; fp8 (linears in FP8 E4M3 where --min-cosine '
        'holds); or w4a16 (linear weights in int4, one scale per 16-128 rows, where --min-cosine holds; activations fp16).',
    "allow_low_fidelity": 'Write a bundle under the fidelity floor, with a warning.',
    "calib": "Calibration samples: an .npz of arrays named after the model's inputs, each with a leading sample "
        'axis ([N, 1, 128] for input_ids) [default: 8 seeded random samples, with a warning]. A VLA folder: N '
        'observations (pixel_values, tokens, state; noise optional), each program\'s samples made from them '
        '[default: 8 seeded observations].',
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

    if is_causal_lm(model):
        return compile_decoder(model, target, output, options, steps)
    if is_vla(model):
        return compile_vla_command(model, target, output, options)
    with progress_bar() as progress:
        result = compile_model(model, target, output, options, progress)
    print_compile_result(result)


def print_compile_result(result) -> None:
    if result.bucket_reports:
        for bucket in read_buckets(result.bundle).buckets:
            console.rule(bucket_title(bucket))
            print_compile_report(result.bucket_reports[bucket.name])
    else:
        print_compile_report(result.report)
    console.print(f"bundle: {result.bundle}")


def compile_decoder(model: Path, target: str, output: Path | None, options, steps: dict) -> None:
    """A GGUF checkpoint or transformers folder: a generative bundle, a program per step width."""

    with progress_bar() as progress:
        result = compile_generative(model, target, output or model.with_suffix(".shard"), options, **steps,
                                    progress=progress)
    vision = result.spec.vision
    if vision:
        console.rule(f"program vision: an image of {vision['image_size']} x {vision['image_size']} to its features")
        print_compile_report(result.reports[vision["program"]], engines=False)
    for program in result.spec.programs:
        console.rule(f"program {program.name}: {program.width} token{'s' * (program.width > 1)} a step over a "
                     f"cache of {program.capacity}")
        print_compile_report(result.reports[program.name], engines=False)
    if result.chunk is not None:
        console.print(f"--chunk auto: {result.chunk.chunk} tokens a prompt step: {result.chunk.why}")
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


def compile_vla_command(model: Path, target: str, output: Path | None, options) -> None:
    """A VLA folder (`shard zoo export pi0`): a bundle of its vision, prefix and denoising-step programs."""
    with progress_bar() as progress:
        result = compile_vla(model, target, output or model.with_suffix(".shard"), options, progress)
    for name, report in result.reports.items():
        console.rule(f"program {name}")
        print_compile_report(report, engines=False)
    if result.predicted is not None:
        console.print(escape(result.predicted.line(target)))
    if result.actions is not None:
        console.print(escape(result.actions.line()))
    elif options.precision != "fp16":
        console.print(f"--precision {options.precision}: the action chunk not checked against fp16's (--no-check-fidelity)")
    console.print(f"bundle: {result.bundle} (run it: shard act {result.bundle})")


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


def print_compile_report(report: dict, engines: bool = True) -> None:
    """The shards' table and the summary under it, from the report's typed records (shard.summary);
    `engines` False: a program of a VLA or decoder bundle, which no TensorRT engine runs."""
    if staged(report):   # a GPU target's pipeline stages
        stages = StageSummary.of(report)
        console.print(stage_table(stages.stages, f"{len(stages.stages)} pipeline stages, {stages.precision}"))
        for line in stage_lines(stages, engines):
            console.print(line)
        return
    summary = Summary.of(report)
    console.print(shards_table(summary))
    for line in summary_lines(summary):
        console.print(line)
