"""Compiles that run compile_one more than once: a bundle per bucket of input shapes, and the rounds of
mixed precision."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import onnx

from shard.bundle import TensorSpec, read_manifest
from shard.calibration import compile_samples
from shard.compilation.choice import simulator_cosine
from shard.compilation.stages import compile_one
from shard.compilation.staging import replace_dir, staging_folder
from shard.compilation.state import FIDELITY_SAMPLES, CompileResult, Progress
from shard.graph import fix_input_values, load_model
from shard.never_worse import fix_input_shapes
from shard.options import CompileOptions
from shard.precision import next_count
from shard.runtime.buckets import BUCKETS, Bucket, Buckets, crop_axes


def compile_uncached(model: Path, target: str, output: Path, options: CompileOptions,
                     progress: Progress) -> CompileResult:
    if options.buckets:
        return compile_buckets(model, target, output, options, progress)
    if options.precision == "mixed" and options.promote is None:
        return compile_mixed(model, target, output, options, progress)
    return compile_one(model, target, output, options, progress)


HELD_OUT = 4   # mixed precision: one calibration sample in this many is held out of the ranges, to accept on


def split_samples(samples: list[dict]) -> tuple[list[dict], list[dict]]:
    """(the samples the int8 ranges come from, those a round is accepted on): the last quarter held
    out, at least one; a single sample does both."""
    if len(samples) < 2:
        return samples, samples
    held = max(1, len(samples) // HELD_OUT)
    return samples[:-held], samples[-held:]


def mixed_samples(model: Path, options: CompileOptions) -> tuple[list[dict], str | None]:
    """compile_samples of a quantized compile, for the model's inputs as the compile fixes them."""
    from dataclasses import replace

    proto = load_model(model)
    fix_input_shapes(proto, options.input_shapes)
    fix_input_values(proto, options.input_values)
    weights = {t.name for t in proto.graph.initializer}
    specs = [TensorSpec(i.name, [d.dim_value for d in i.type.tensor_type.shape.dim],
                        onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type).name)
             for i in proto.graph.input if i.name not in weights]
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
    and measure the bundle on the simulator with the quarter held out (split_samples: ranges fit
    the samples they came from, and the next input is not one of them). Where that falls short of
    options.min_cosine, rank the linears once with the int8 replica (shard.precision) and move,
    round by round, as many of the most harmful to fp16 as the replica predicts the target needs
    (scaled by how far the last round missed its prediction); once one reaches it, the rounds left
    bisect towards more int8 (next_count). Builds are cached by content, so a round rebuilds only
    the shards it changed. The round with the most int8 that reaches the target is kept (else the
    most faithful; where that has no linear left in int8, the model compiled in fp16), its report
    listing every round with both cosines."""
    from dataclasses import replace

    work = Path(tempfile.mkdtemp(prefix=f".{output.name}.mixed-{os.getpid()}-", dir=output.parent))
    rounds, best, ranking = [], None, None
    try:
        samples, warning = mixed_samples(model, options)
        fit, held = split_samples(samples)
        np.savez(work / "fit.npz", **{name: np.stack([s[name] for s in fit]) for name in fit[0]})
        fitted = replace(options, calib=str(work / "fit.npz"), check_fidelity=False)
        promoted: list[str] = []
        while True:
            k = len(rounds)
            progress(f"mixed precision, round {k + 1}: {len(promoted)} linears in fp16", 0, 1)
            result = compile_one(model, target, work / f"round{k}.shard", replace(fitted, promote=tuple(promoted)),
                                 progress)
            cosine = simulator_cosine(result.bundle, Path(model), held)   # every sample held out: what --min-cosine holds on
            on_fit = simulator_cosine(result.bundle, Path(model), fit[:FIDELITY_SAMPLES]) if held is not fit else cosine
            if ranking is None and cosine < options.min_cosine:   # ranked once, where the first round falls short
                ranking = result.rank()
            result.rank = None   # lets go of the round's graph
            int8 = result.report["totals"].get("int8_mac_share") or 0.0
            linears = ranking["linears"] if ranking else []
            predicted = (linears[len(promoted) - 1]["cosine_after"] if promoted else ranking["replica_cosine"]) \
                if ranking else None
            rounds.append({"round": k + 1, "promoted": tuple(promoted), "predicted": predicted, "cosine": cosine,
                           "cosine_calibration": on_fit, "int8_mac_share": int8,
                           "estimated_cycles": result.report["totals"]["estimated_cycles"]})
            progress(f"mixed precision, round {k + 1}: cosine {cosine:.5f} held out ({on_fit:.5f} on the "
                     f"calibration samples), int8 MACs {100 * int8:.1f} %", 1, 1)
            if best is None or kept_before(rounds[-1], best[0], options.min_cosine):
                best = (rounds[-1], result)
            count = next_count(rounds, linears, options.min_cosine)
            if count is None:
                break
            promoted = [c["node"] for c in linears[:count]]
        cosine, result = best[0]["cosine"], best[1]
        # No linear left in int8: its outlier splits would cost cycles for nothing (all-mpnet-base-v2 with
        # every linear in fp16: 25.4 M estimated cycles against 22.0 M compiled in fp16).
        plain = not best[0]["int8_mac_share"] and rounds[0]["int8_mac_share"]
        if plain:
            result = compile_one(model, target, work / "fp16.shard", replace(options, precision="fp16"), progress)
        report = result.report
        report["mixed"] = {"min_cosine": options.min_cosine, "samples": {"calibration": len(fit), "held_out": len(
            held) if held is not fit else 0, "compared": len(held)},
                           "ranking": ranking,
                           "rounds": [{**r, "promoted": list(r["promoted"])} for r in rounds], "cosine": cosine,
                           "kept": None if plain else best[0]["round"], "reached": cosine >= options.min_cosine}
        if warning:
            report["warnings"].append(warning)
        if plain:
            report["warnings"].append(f"mixed precision: no round with linears in int8 reached cosine "
                                      f"{options.min_cosine} on the held-out samples; the bundle is fp16")
        elif cosine < options.min_cosine:
            report["warnings"].append(f"mixed precision: no round reached cosine {options.min_cosine} on the "
                                      f"held-out samples; kept the most faithful ({cosine:.5f})")
        (result.bundle / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        replace_dir(result.bundle, output)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return CompileResult(bundle=output, manifest=read_manifest(output), report=report)


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
    return CompileResult(bundle=output, manifest=results[-1].manifest,
                         report={"buckets": {b.name: r.report for b, r in zip(buckets, results)}})
