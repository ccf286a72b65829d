"""Compiles that run compile_one more than once: a bundle per bucket of input shapes, and the rounds of
mixed precision."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from shard.bundle import read_manifest
from shard.calibration import compile_samples
from shard.compilation.choice import simulator_cosine
from shard.compilation.stages import compile_one
from shard.compilation.staging import replace_dir, staging_folder
from shard.compilation.state import FIDELITY_SAMPLES, CompileResult, Progress
from shard.options import CompileOptions
from shard.precision import MAX_MIXED_ROUNDS, next_prefix
from shard.runtime.buckets import BUCKETS, Bucket, Buckets, crop_axes


def compile_uncached(model: Path, target: str, output: Path, options: CompileOptions,
                     progress: Progress) -> CompileResult:
    if options.buckets:
        return compile_buckets(model, target, output, options, progress)
    if options.precision == "mixed" and options.promote is None:
        return compile_mixed(model, target, output, options, progress)
    return compile_one(model, target, output, options, progress)


def compile_mixed(model: Path, target: str, output: Path, options: CompileOptions, progress: Progress) -> CompileResult:
    """--precision mixed: compile with the linears in int8 (their outlier channels on fp16 side
    linears) and everything else in fp16, and measure the bundle on the simulator with the
    calibration samples. Where that falls short of options.min_cosine, rank the linears once with
    the int8 replica (shard.precision) and move, round by round, as many of the most harmful to fp16
    as the replica predicts the target needs (scaled by how far the last round missed its
    prediction). Builds are cached by content, so a round rebuilds only the shards it changed. The
    bundle of the first round that reaches the target is kept (else the most faithful), its report
    listing every round."""
    from dataclasses import replace

    work = Path(tempfile.mkdtemp(prefix=f".{output.name}.mixed-{os.getpid()}-", dir=output.parent))
    rounds, best, ranking, samples = [], None, None, []
    try:
        promoted: list[str] = []
        while True:
            k = len(rounds)
            progress(f"mixed precision, round {k + 1}: {len(promoted)} linears in fp16", 0, 1)
            result = compile_one(model, target, work / f"round{k}.shard",
                                   replace(options, promote=tuple(promoted), check_fidelity=False), progress)
            if not rounds:
                samples, _ = compile_samples(options, result.manifest.inputs)   # its warning: in the report
            cosine = simulator_cosine(result.bundle, Path(model), samples[:FIDELITY_SAMPLES])
            if ranking is None and cosine < options.min_cosine:   # ranked once, where the first round falls short
                ranking = result.rank()
            result.rank = None   # lets go of the round's graph
            int8 = result.report["totals"].get("int8_mac_share") or 0.0
            linears = ranking["linears"] if ranking else []
            predicted = (linears[len(promoted) - 1]["cosine_after"] if promoted else ranking["replica_cosine"]) \
                if ranking else None
            rounds.append({"round": k + 1, "promoted": tuple(promoted), "predicted": predicted, "cosine": cosine,
                           "int8_mac_share": int8, "estimated_cycles": result.report["totals"]["estimated_cycles"]})
            progress(f"mixed precision, round {k + 1}: cosine {cosine:.5f}, int8 MACs {100 * int8:.1f} %", 1, 1)
            if best is None or not best[0] >= options.min_cosine and cosine > best[0]:
                best = (cosine, result)
            if cosine >= options.min_cosine or len(promoted) == len(linears) or k + 1 == MAX_MIXED_ROUNDS:
                break
            count = next_prefix(linears, 1.0 - options.min_cosine, 1.0 - predicted, 1.0 - cosine, len(promoted))
            promoted = [c["node"] for c in linears[:count if k + 2 < MAX_MIXED_ROUNDS else len(linears)]]
        cosine, result = best
        report = result.report
        report["mixed"] = {"min_cosine": options.min_cosine, "samples": min(len(samples), FIDELITY_SAMPLES),
                           "ranking": ranking,
                           "rounds": [{**r, "promoted": list(r["promoted"])} for r in rounds], "cosine": cosine,
                           "reached": cosine >= options.min_cosine}
        if cosine < options.min_cosine:
            report["warnings"].append(f"mixed precision: no round reached cosine {options.min_cosine} on the "
                                      f"calibration samples; kept the most faithful ({cosine:.5f})")
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
