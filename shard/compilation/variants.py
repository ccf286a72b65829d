"""Compiles that run compile_one more than once: a bundle per bucket of input shapes, and the rounds of
mixed precision."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np

from shard.bundle import read_manifest
from shard.calibration import compile_samples
from shard.compilation.choice import bundle_cosine_of, bundle_cosines
from shard.compilation.names import FIDELITY_SAMPLES, Progress
from shard.compilation.stages import compile_one
from shard.compilation.staging import replace_dir, staging_folder
from shard.compilation.state import CompileResult
from shard.graph import fix_input_values, load_model, value_spec
from shard.never_worse import fix_input_shapes
from shard.options import CompileOptions
from shard.precision import next_count
from shard.runtime.buckets import BUCKETS, Bucket, Buckets, crop_axes
from shard.summary import totals_of


def compile_uncached(model: Path, target: str, output: Path, options: CompileOptions,
                     progress: Progress) -> CompileResult:
    if options.buckets:
        return compile_buckets(model, target, output, options, progress)
    if options.precision == "mixed" and options.promote is None:
        return compile_mixed(model, target, output, options, progress)
    return compile_one(model, target, output, options, progress)


HELD_OUT = 4   # mixed precision: one calibration sample in this many is held out of the ranges, to accept on
IN_TURN = 4 * HELD_OUT   # fewer calibration samples than this are held out in turn, a quarter at a time


def sample_folds(samples: list[dict]) -> list[tuple[list[dict], list[dict]]]:
    """Mixed precision's (the samples the int8 ranges come from, those a round is accepted on), per
    fold. From IN_TURN samples on, one fold: the last quarter held out. Fewer are held out in turn, a
    quarter at a time (HELD_OUT folds, or one a sample where there are fewer), so that every sample
    accepts each round once: a held-out part of one or two samples says little about the next
    input. A single sample does both."""
    n = len(samples)
    if n < 2:
        return [(samples, samples)]
    if n >= IN_TURN:
        held = n // HELD_OUT
        return [(samples[:-held], samples[-held:])]
    k = min(n, HELD_OUT)
    bounds = [n * f // k for f in range(k + 1)]
    return [(samples[:a] + samples[b:], samples[a:b]) for a, b in zip(bounds, bounds[1:])]


def save_samples(path: Path, samples: list[dict]) -> Path:
    """Samples as a --calib file: one array per input, the samples along its first axis."""
    np.savez(path, **{name: np.stack([s[name] for s in samples]) for name in samples[0]})
    return path


def mixed_samples(model: Path, options: CompileOptions) -> tuple[list[dict], str | None]:
    """compile_samples of a quantized compile, for the model's inputs as the compile fixes them."""
    from dataclasses import replace

    proto = load_model(model)
    fix_input_shapes(proto, options.input_shapes)
    fix_input_values(proto, options.input_values)
    weights = {t.name for t in proto.graph.initializer}
    specs = [value_spec(i) for i in proto.graph.input if i.name not in weights]
    del proto
    return compile_samples(replace(options, precision="int8"), specs)


def kept_before(this: dict, best: dict, target: float) -> bool:
    """Whether mixed precision keeps round `this` before `best`: a round that reaches the target before
    one that does not, then the more int8 among those that reach it, else the more faithful."""
    if (this["cosine"] >= target) != (best["cosine"] >= target):
        return this["cosine"] >= target
    return this["int8_mac_share"] > best["int8_mac_share"] if this["cosine"] >= target else \
        this["cosine"] > best["cosine"]


def compile_mixed(model: Path, target: str, output: Path, options: CompileOptions, progress: Progress) -> CompileResult:
    """--precision mixed: compile with the linears in int8 (their outlier channels on fp16 side
    linears) and everything else in fp16, their ranges from three quarters of the calibration samples,
    and measure the bundle on the simulator with the quarter held out (sample_folds: ranges fit
    the samples they came from, and the next input is not one of them; few samples are held out in
    turn). Where that falls short of options.min_cosine, rank the linears once with the int8 replica
    (shard.precision) and move, round by round, as many of the most harmful to fp16 as the replica
    predicts the target needs (scaled by how far the last round missed its prediction); once one
    reaches it, the rounds left bisect towards more int8 (next_count). Builds are cached by content,
    so a round rebuilds only the shards it changed. The round with the most int8 that reaches the
    target is kept (else the most faithful; where that has no linear left in int8, the model compiled
    in fp16; where the samples were held out in turn, its linears compiled with ranges from all of
    them), its report listing every round with both cosines."""
    from dataclasses import replace

    work = Path(tempfile.mkdtemp(prefix=f".{output.name}.mixed-{os.getpid()}-", dir=output.parent))
    rounds, best, ranking = [], None, None
    try:
        samples, warning = mixed_samples(model, options)
        folds = sample_folds(samples)
        fitted = [replace(options, calib=str(save_samples(work / f"fit{f}.npz", fit)), check_fidelity=False)
                  for f, (fit, _) in enumerate(folds)]
        promoted: list[str] = []
        while True:
            k = len(rounds)
            step = f"mixed precision, round {k + 1}: {len(promoted)} linears in fp16"
            cosine, on_fit, result = measure_round(model, target, work / f"round{k}", folds, fitted, promoted,
                                                   lambda f: progress(step, f, len(folds)), progress)
            if ranking is None and cosine < options.min_cosine:   # ranked once, where the first round falls short
                ranking = result.rank()
            result.rank = None   # lets go of the round's graph
            totals = totals_of(result.report)
            int8 = totals.int8_mac_share or 0.0
            linears = ranking["linears"] if ranking else []
            predicted = (linears[len(promoted) - 1]["cosine_after"] if promoted else ranking["replica_cosine"]) \
                if ranking else None
            rounds.append({"round": k + 1, "promoted": tuple(promoted), "predicted": predicted, "cosine": cosine,
                           "cosine_calibration": on_fit, "int8_mac_share": int8,
                           "estimated_cycles": totals.estimated_cycles})
            progress(f"mixed precision, round {k + 1}: cosine {cosine:.5f} held out ({on_fit:.5f} on the "
                     f"calibration samples), int8 MACs {100 * int8:.1f} %", 1, 1)
            if best is None or kept_before(rounds[-1], best[0], options.min_cosine):
                best = (rounds[-1], result)
            count = next_count(rounds, linears, options.min_cosine)
            if count is None:
                break
            promoted = [c["node"] for c in linears[:count]]
        plain = not best[0]["int8_mac_share"] and bool(rounds[0]["int8_mac_share"])
        report = mixed_report(model, target, work, options, samples, folds, best, plain, progress)
        report["mixed"].update({"ranking": ranking, "rounds": [{**r, "promoted": list(r["promoted"])} for r in rounds]})
        report["warnings"] += mixed_warnings(warning, plain, best[0]["cosine"], options.min_cosine)
        (work / "kept.shard" / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        replace_dir(work / "kept.shard", output)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return CompileResult(bundle=output, manifest=read_manifest(output), report=report)


def mixed_warnings(samples_warning: str | None, plain: bool, cosine: float, target: float) -> list[str]:
    """What the kept round's report warns of: the samples, and a target no round with int8 reached."""
    said = [samples_warning] if samples_warning else []
    if plain:
        said.append(f"mixed precision: no round with linears in int8 reached cosine {target} on the held-out "
                    f"samples; the bundle is fp16")
    elif cosine < target:
        said.append(f"mixed precision: no round reached cosine {target} on the held-out samples; kept the most "
                    f"faithful ({cosine:.5f})")
    return said


def measure_round(model: Path, target: str, work: Path, folds: list, fitted: list[CompileOptions],
                  promoted: list[str], fold_done: Callable[[int], None],
                  progress: Progress) -> tuple[float, float, CompileResult]:
    """One round of mixed precision: `promoted` in fp16, compiled once a fold with that fold's int8
    ranges and measured on the simulator on its held-out samples (`fold_done(f)` before fold f, the
    round's own bar). Returns the worst held-out cosine, the worst on the calibration samples and the
    first fold's compile; the other folds' bundles are let go."""
    from dataclasses import replace

    held_out, on_fit, first = [], [], None
    for f, ((fit, held), options) in enumerate(zip(folds, fitted)):
        fold_done(f)
        result = compile_one(model, target, work.with_name(f"{work.name}-fold{f}.shard"),
                             replace(options, promote=tuple(promoted)), progress)
        # every sample held out (what --min-cosine holds on) and a few it was fitted on, in one session
        cosines = bundle_cosines(result.bundle, model, *([held] if held is fit else [held, fit[:FIDELITY_SAMPLES]]))
        held_out.append(cosines[0])
        on_fit.append(cosines[-1])
        if first is None:
            first = result
        else:
            shutil.rmtree(result.bundle)
    return min(held_out), min(on_fit), first


def mixed_report(model: Path, target: str, work: Path, options: CompileOptions, samples: list[dict],
                 folds: list, best: tuple[dict, CompileResult], plain: bool, progress: Progress) -> dict:
    """The report of the bundle mixed precision keeps, which it leaves at work/kept.shard: the best
    round's own where one fold held the samples out; its linears compiled with ranges from all the
    samples where they were held out in turn (its cosine on them under "bundle_cosine"); the model
    in fp16 where `plain`, the best round having no linear left in int8 (all-mpnet-base-v2 with
    every linear in fp16: 25.4 M estimated cycles against 22.0 M compiled in fp16, the outlier
    splits staying)."""
    from dataclasses import replace

    kept, result = best
    mixed = {"min_cosine": options.min_cosine, "cosine": kept["cosine"], "reached": kept["cosine"] >= options.min_cosine,
             "samples": samples_report(samples, folds)}
    if plain:
        result = compile_one(model, target, work / "fp16.shard", replace(options, precision="fp16"), progress)
        mixed["kept"] = None
    elif len(folds) > 1:
        every = replace(options, calib=str(save_samples(work / "all.npz", samples)), check_fidelity=False,
                        promote=kept["promoted"])
        result = compile_one(model, target, work / "all.shard", every, progress)
        mixed.update(kept=kept["round"], bundle_cosine=bundle_cosine_of(result.bundle, model, samples))
    else:
        mixed["kept"] = kept["round"]
    result.bundle.rename(work / "kept.shard")
    return {**result.report, "mixed": mixed}


def samples_report(samples: list[dict], folds: list) -> dict:
    """How mixed precision used the calibration samples: how many the bundle's int8 ranges come from,
    how many accepted each round without having set its ranges, in how many folds."""
    if len(folds) > 1:
        return {"calibration": len(samples), "held_out": len(samples), "compared": len(samples), "folds": len(folds)}
    ((fit, held),) = folds
    return {"calibration": len(fit), "held_out": len(held) if held is not fit else 0, "compared": len(held),
            "folds": 1}


def compile_buckets(model: Path, target: str, output: Path, options: CompileOptions, progress: Progress) -> CompileResult:
    """One bundle per bucket of input shapes (shard.runtime.buckets), smallest first, in one folder
    with buckets.json; written whole or not at all."""
    from dataclasses import replace

    staging = staging_folder(output)
    ordered = sorted(options.buckets, key=lambda shapes: sum(int(np.prod(s)) for s in shapes.values()))
    try:
        results, buckets = [], []
        for k, shapes in enumerate(ordered):
            step = lambda what, done, total, k=k: progress(f"bucket {k + 1}/{len(ordered)}: {what}", done, total)  # noqa: E731
            result = compile_uncached(model, target, staging / f"b{k}",
                                   replace(options, buckets=[], input_shapes={**options.input_shapes, **shapes}), step)
            results.append(result)
            buckets.append(Bucket(f"b{k}", {t.name: t.shape for t in result.manifest.inputs},
                                  {t.name: t.shape for t in result.manifest.outputs}))
        (staging / BUCKETS).write_text(Buckets(buckets, crop=crop_axes(buckets)).to_json())
        replace_dir(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return CompileResult.of_buckets(output, results[-1].manifest, {b.name: r.report for b, r in zip(buckets, results)})
