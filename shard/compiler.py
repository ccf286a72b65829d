"""compile_model: ONNX in, bundle out. The stages, in order, are in this one function."""

from __future__ import annotations

import gc
import glob
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from shard import __version__, scratch
from shard.bundle import MANIFEST, Manifest, ShardSpec, check_files, read_manifest, record_files
from shard.edges import SUFFIX as EDGES
from shard.edges import relayout
from shard.errors import CompileError, ShardError
from shard.graph import (default_opset, fits_protobuf, graph_tensors, load_model, own_values, quiet_graphsurgeon,
                         release_weights, sha256_file, tensor_spec, to_toolkit_model)
from shard.never_worse import (AXES, BASELINES, HARD_AXES, LABELS, Figures, comparison_line, fidelity_worse,
                               fix_input_shapes, original_plans, per_axis, prune_host_steps, verdict, whole_build_fits)
from shard.options import CompileOptions
from shard.passes import PassContext, run_pipeline
from shard.passes.canonicalize import prepare_model
from shard.passes.fit import Legality, OneOpBuilds
from shard.precision import MAX_MIXED_ROUNDS, next_prefix
from shard.passes.partition import ShardPlan, estimate_macs
from shard.profile import load_profile
from shard.runtime.host import step_files
from shard.targets import ShardBuild, ShardJob, get_target
from shard.targets.build_cache import default_cache_dir, link_or_copy, structure_key

Progress = Callable[[str, int, int], None]  # (step, done, total)


@dataclass
class CompileResult:
    bundle: Path
    manifest: Manifest
    report: dict
    rank: Callable[[], dict] | None = field(default=None, repr=False)   # mixed: mixed_ranking of its graph


def default_output(model: Path) -> Path:
    return model.with_suffix(".shard")


def compile_model(model: str | Path, target: str = "rk3588", output: str | Path | None = None,
                  options: CompileOptions | None = None, progress: Progress = lambda *a: None) -> CompileResult:
    """Compile an ONNX model into a bundle directory; on failure nothing is left at `output`. The same
    model compiled again the same way comes back from the bundle cache (shard.bundle_cache)."""
    from shard import bundle_cache

    options = options or CompileOptions()
    check_options(options)
    model = Path(model)
    output = Path(output) if output else default_output(model)
    tgt = get_target(target)
    check_output_path(output, model)
    tgt.check_environment()               # a missing toolkit fails before minutes of work
    t0 = time.monotonic()
    root = default_cache_dir()
    key = bundle_cache.bundle_key(model, target, tgt.toolchain(), options) if model.is_file() else None
    if key:
        staging = staging_folder(output)
        try:
            record = bundle_cache.restore(root, key, staging)
            if record is not None:
                return restored(staging, output, record, time.monotonic() - t0)
        except (OSError, ValueError, KeyError, ShardError):   # a damaged entry: dropped, the model compiled
            bundle_cache.discard(root, key)
        finally:
            shutil.rmtree(staging, ignore_errors=True)   # where the bundle took its place, gone already
    result = compile_uncached(model, target, output, options, progress)
    if key:
        bundle_cache.store(root, key, result.bundle, time.monotonic() - t0)
    return result


def restored(staging: Path, output: Path, record: dict, seconds: float) -> CompileResult:
    """A bundle from the cache, put in place, its report (of each bucket) saying where it came from."""
    from shard.runtime.buckets import is_bucketed, read_buckets

    folders = [staging / b.name for b in read_buckets(staging).buckets] if is_bucketed(staging) else [staging]
    manifests = [read_manifest(folder) for folder in folders]   # every file there: else a damaged entry
    for folder, manifest in zip(folders, manifests):   # and each the bytes the compile wrote
        check_files(folder, manifest)
    reports = {}
    for folder in folders:
        report = json.loads((folder / "report.json").read_text())
        report["from_bundle_cache"] = {"seconds": round(seconds, 2), "compiled_in": record["seconds"]}
        (folder / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        reports[folder.name] = report
    replace_dir(staging, output)
    return CompileResult(bundle=output, manifest=manifests[-1],
                         report={"buckets": reports} if folders[0] != staging else reports[staging.name])


def compile_uncached(model: Path, target: str, output: Path, options: CompileOptions,
                     progress: Progress) -> CompileResult:
    if options.buckets:
        return compile_buckets(model, target, output, options, progress)
    if options.precision == "mixed" and options.promote is None:
        return compile_mixed(model, target, output, options, progress)
    return compile_one(model, target, output, options, progress)


def compile_one(model: Path, target: str, output: Path, options: CompileOptions,
                progress: Progress) -> CompileResult:
    """One bundle of one precision at fixed input shapes: the stages, in order."""
    tgt = get_target(target)
    if options.precision not in tgt.precisions and (options.precision != "fp16" or tgt.vendor):  # cpu: fp32 as asked
        raise ShardError(f"--precision {options.precision}: target {target} builds {', '.join(tgt.precisions)}"
                         + (" (pass --precision int8 with --calib FILE.npz)" if "fp16" not in tgt.precisions else ""))
    profile = load_profile(target, options.profile)
    if options.precision in QUANTIZED and "w8a8" not in profile.facts.get("quantized_dtypes", ["w8a8"]):
        raise ShardError(f"--precision {options.precision}: the {target} profile's probe found no int8 (w8a8) "
                         f"build: {profile.facts.get('quantized_dtypes_source', '')}")
    quiet_graphsurgeon()
    t0 = time.monotonic()
    # The staging bundle beside the output (same filesystem, so the final rename is atomic); logs
    # live outside it so a failure keeps them.
    staging, logs = scratch_folders(output)
    (staging / "shards").mkdir()
    datasets = None
    try:
        progress("load", 0, 1)
        proto = load_model(model)
        source = {"name": model.name, "sha256": sha256_file(model)}
        if options.vendor_only and not tgt.vendor:
            raise ShardError(f"--vendor-only: target {target} has no vendor compiler")
        against_vendor = tgt.vendor and (options.vendor_baseline or options.vendor_only)
        # --check-fidelity asks for the whole model's check: the vendor alone built whole, unless told otherwise.
        how = "whole" if options.vendor_only or options.check_fidelity and options.vendor_alone == "auto" \
            else options.vendor_alone
        whole, why = (whole_build_fits(proto, how,
                                       jobs=options.jobs, quantized=options.precision in QUANTIZED)
                      if against_vendor else (False, ""))
        per_shard = against_vendor and not whole   # the vendor alone from the shards' unrewritten builds
        against_vendor = against_vendor and whole
        quantized = options.precision in QUANTIZED
        build = tgt.build_options(options)
        done: list[ShardBuild] = []
        cache = default_cache_dir() if options.build_cache else None
        with tgt.builds(options.jobs, options.timeout, cache, logs) as builder:
            vendor_inputs, vendor_job, early, stand_in = None, None, [], None   # the vendor alone's build
            if against_vendor:
                fix_input_shapes(proto, options.input_shapes)
                vendor_inputs = data_inputs(proto.graph)
            if against_vendor and not quantized:
                vendor_job = vendor_alone_job(staging, logs, tgt, vendor_inputs)
                vendor_job.figures_key = structure_key(proto)
                # Built before with other weights: those figures stand in, and the build is made only
                # if its artifact is needed (the fidelity check, or a bundle falling back to it).
                if not (options.vendor_only or options.check_fidelity):
                    stand_in = builder.figures(vendor_job, build)
            if against_vendor and not stand_in:   # written now, so its weights are not held twice through the passes
                write_vendor_alone(proto, staging)
            if vendor_job and not stand_in:   # the longest build runs through the passes
                early = builder.submit([vendor_job], build, done.append)
            proto, prepared = prepare_model(proto, tgt.min_opset)
            opset = default_opset(proto)
            graph = own_values(gs.import_onnx(proto))
            del proto

            # 1. Rewrite and partition (the pass order lives in shard.passes.PIPELINE); the canonical graph
            #    is kept so each rewritten shard can also be built as the vendor would take it.
            graph, ctx = run_passes(graph, tgt, profile, options, progress,
                                    snapshot=("canonicalize",) if tgt.vendor else (),
                                    until="slow_paths" if options.vendor_only else None)
            ctx.reports["canonicalize"]["prepared"] = prepared
            plans = ctx.plan or []
            canonical = ctx.snapshots.pop("canonicalize", None)
            originals = original_plans(canonical, plans, ctx.host_post) if canonical is not None else [None] * len(plans)
            values, feeds = (quantization_values(ctx, graph, canonical, plans, originals, progress) if quantized
                             else (None, None))
            rank = None
            if options.precision == "mixed":
                ctx.reports["mixed"] = {"promoted": sorted(options.promote)}
                rank = lambda: mixed_ranking(graph, feeds, progress)  # noqa: E731  (for compile_mixed, if it needs one)
            t_passes = time.monotonic() - t0

            # 2. Write the shards and compile them (the vendor alone, quantized, from the samples the passes took).
            #    The workers load the toolkit while the first shard is written: not earlier, where they would
            #    hold memory beside the passes' peak (the range statistics) and share its cores.
            builder.start()
            datasets = Datasets(scratch.folder("calib"), values, options.precision,
                                set(options.promote or ())) if quantized else None
            if against_vendor and quantized:
                vendor_job = vendor_alone_job(staging, logs, tgt, vendor_inputs, datasets)
            vendor_build = build   # the vendor alone builds as it is; ctx.build_config is the shards' only
            if ctx.build_config and "config" in build:
                build = {**build, "config": {**build["config"], **ctx.build_config}}
            jobs = [vendor_job] if vendor_job and not stand_in else []

            def compile_jobs(batch: list[ShardJob], step: str, under_way: list = (), config: dict | None = None
                             ) -> dict[str, ShardBuild]:
                progress(step, len(done), len(jobs))
                return {b.name: b for b in builder.results([*under_way, *builder.submit(batch, config or build,
                                                                                        on_done(step))])}

            def on_done(step: str) -> Callable[[ShardBuild], None]:
                def done_one(result: ShardBuild) -> None:
                    done.append(result)
                    progress(step, len(done), len(jobs))
                return done_one

            under_way = [*early, *builder.submit(jobs[len(early):], vendor_build, on_done("compile shards"))]
            # Each shard builds as soon as it is written, and its weights go once no shard still to be
            # written reads them; mixed ranks its linears on the graph after the build and keeps them.
            held = () if options.precision == "mixed" else tuple(g for g in (graph, canonical) if g is not None)
            for job in write_jobs(staging, logs, tgt, plans, originals, opset, progress, datasets, held):
                jobs.append(job)
                under_way += builder.submit([job], build, on_done("compile shards"))
            builds = compile_jobs([], "compile shards", under_way)
            if stand_in:
                builds[VENDOR_ALONE] = stand_in
            t_build = time.monotonic() - t0 - t_passes

            # 3. Keep the better build of each shard (rewritten or not; each with its edges as they were or
            #    in the vendor's layout, whichever is better), then stand the whole beside the vendor alone.
            # Forced tiles and mixed precision's fp16 ops cost cycles by choice (cores, fidelity).
            axes = HARD_AXES if options.tile_attention == "force" or options.precision == "mixed" else AXES
            in_range = {c["node"] for c in ctx.reports.get("scale_sandwich", {}).get("changes", [])
                        if c["form"] == "range"}
            versions = [(plan.name, plan) for plan in plans] + [
                (f"{plan.name}{UNREWRITTEN}", original) for plan, original in zip(plans, originals)
                if original is not None]
            relaid = relayout_jobs(staging, logs, tgt, versions, datasets)
            best, edge_choices = {}, []
            if relaid:
                jobs += [job for job, _ in relaid]
                builds.update(compile_jobs([job for job, _ in relaid], "compile shards (edges in the vendor's layout)"))
                best, edge_choices = keep_better_edges(relaid, builds, axes)
            own, choices = choose_versions(plans, originals, builds, axes, in_range, best)
            kept_names = {name for name, _ in own}
            choices += [c for c in edge_choices if c["build"] in kept_names or c["relaid"] in kept_names]
            # Range rescales exist because the model as it came leaves fp16's range: the simulator judges
            # that (fidelity, on by default then), not the cycles they cost.
            judged = HARD_AXES if in_range else axes
            if per_shard:
                chosen, versus = against_unrewritten(own, plans, originals, builds, judged)
            else:
                chosen, versus = against_vendor_alone(own, builds, judged, options.vendor_only, canonical or graph)
            if versus:
                versus["why"] = why
            # Fidelity is part of never worse: a rewrite or a cut can lose what the vendor's build keeps
            # (a trained decoder cut inside its RMSNorm: cosine 0.038 against the vendor's 0.99999).
            measure = bool(versus) if options.check_fidelity is None else options.check_fidelity
            if stand_in and (measure or versus["bundle"] == "vendor alone"):   # its artifact is needed now
                as_it_came = load_model(model)
                fix_input_shapes(as_it_came, options.input_shapes)
                write_vendor_alone(as_it_came, staging, keep=False)
                del as_it_came
                jobs.insert(0, vendor_job)
                builds.update(compile_jobs([vendor_job], "compile the model as it came (vendor alone)", config=vendor_build))
                chosen, versus = against_vendor_alone(own, builds, judged, options.vendor_only, canonical or graph)
        host_pre, host_post = host_steps(ctx, chosen, builds, versus)
        baseline = fidelity_baseline(versus, builds, chosen, unrewritten_versions(plans, originals) if per_shard
                                     else [(VENDOR_ALONE, vendor_plan(canonical or graph))]) if measure else None
        if measure and per_shard:
            ctx.warnings.append(f"fidelity compared with the vendor alone shard by shard (its build of the whole model "
                                f"is not made here: {why}; --vendor-alone whole makes it), which keeps every cut")
        vendor_dir = staging.with_name(f"{staging.name}-vendor") if baseline else None
        if vendor_dir:  # before the writer drops the other builds' files from the staging bundle
            link_builds(staging / "shards", vendor_dir / "shards", [b for b, _ in baseline], tgt.artifact_suffix)

        writer = BundleWriter(target, tgt, profile, build, ctx, graph, source, options, logs, builds, choices,
                              {job.name: shapes for job, shapes in relaid}, t0, {"passes": t_passes, "build": t_build},
                              versus, {job.name: job for job in jobs})
        kept = {name for name, _ in chosen}
        undone = {node for choice in choices for node in choice["dropped_nodes"]}
        confirm_tiles_in_logs(ctx.reports, [job for job in jobs if job.name in kept], undone)
        manifest, report = writer.write(staging, chosen, host_pre, host_post)
        if vendor_dir:
            # 4. Fidelity, on the simulator: the bundle beside the vendor alone's, the same seeded inputs.
            writer.write(vendor_dir, baseline, *(host_steps(ctx, baseline, builds, None) if per_shard else ([], [])))
            manifest, report = keep_the_more_faithful(staging, vendor_dir, model, versus, progress,
                                                      fidelity_samples(ctx, canonical or graph, quantized),
                                                      spent_for_fidelity=bool(in_range) or options.precision == "mixed")
            kept = report["versus_vendor"]["fidelity"]["shard" if versus["bundle"] == "shard" else "vendor"]
            if quantized and not kept >= LOW_FIDELITY:
                report["warnings"].append(
                    f"{options.precision} loses this model's accuracy: simulator cosine {kept:.4f} on "
                    f"{min(len(ctx.samples), FIDELITY_SAMPLES)} calibration samples; "
                    f"check it with `shard verify --inputs`, or compile in fp16")
            report["seconds"]["total"] = round(time.monotonic() - t0, 2)
            (staging / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        # The last step before the bundle takes the output's place: where the command stops on a signal
        # that a finalizer swallowed on the way (shard.cli.stop_point), it stops here, leaving nothing.
        progress("write the bundle", 1, 1)
        replace_dir(staging, output)
    except BaseException as exc:
        if datasets:
            scratch.remove(datasets.root)
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(staging.with_name(f"{staging.name}-vendor"), ignore_errors=True)
        # kept only where the message names them (a build that failed)
        (scratch.keep if str(logs) in str(exc) else scratch.remove)(logs)
        raise
    scratch.remove(logs)
    if datasets:
        scratch.remove(datasets.root)
    return CompileResult(bundle=output, manifest=manifest, report=report, rank=rank)


def scratch_folders(output: Path) -> tuple[Path, Path]:
    """The staging bundle beside the output and a folder for the build logs."""
    logs = scratch.folder(f"logs-{output.stem}")
    logs.chmod(0o755)
    return staging_folder(output), logs


def staging_folder(output: Path) -> Path:
    """A folder beside the output (.NAME.tmp-PID-*: same filesystem, so the final rename is atomic;
    removed by a later compile of the same output if this process dies)."""
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-{os.getpid()}-", dir=output.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; a bundle is an ordinary directory
    return staging


PRECISIONS = ("fp16", "int8", "mixed", "fp8")
QUANTIZED = ("int8", "mixed")   # precisions that need calibration samples


def mixed_ranking(graph, feeds: list[dict[str, np.ndarray]], progress: Progress) -> dict:
    """The replica's ranking of a compiled graph's int8 linears (shard.precision.rank_linears)."""
    from shard.precision import rank_linears

    progress("mixed precision: each linear's loss in int8", 0, 1)
    ranked, every = rank_linears(graph, feeds)
    progress("mixed precision: each linear's loss in int8", 1, 1)
    return {"linears": [asdict(c) for c in ranked], "replica_cosine": every}


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

    from shard.calibration import compile_samples

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

    from shard.runtime.buckets import BUCKETS, Bucket, Buckets, crop_axes

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


VENDOR_ALONE = "vendor_alone"     # the job building the model as it came, as the vendor alone would
SHARD_BY_SHARD = "vendor alone shard by shard"   # its figures where the whole model's build is not made
UNREWRITTEN = ".unrewritten"      # a shard's twin without the passes' rewrites
FIDELITY_SAMPLES = 4              # calibration samples the quantized bundle and the vendor's are compared on
LOW_FIDELITY = 0.99               # a quantized bundle below this simulator cosine gets a warning


def quantization_values(ctx: PassContext, graph: gs.Graph, canonical: gs.Graph | None, plans: list,
                        originals: list, progress: Progress) -> tuple[dict[str, list[np.ndarray]], list[dict]]:
    """Every shard input's value on each calibration sample, from onnxruntime: the rewritten graph
    (after the host's steps) for the shards, the canonical one for inputs only the unrewritten twins
    have; the model's inputs themselves for the vendor alone. Also the rewritten graph's inputs per
    sample (the host's steps run), which mixed precision ranks its linears on."""
    from shard.calibration import calibration_samples, run_each
    from shard.runtime.host import run_host

    samples = calibration_samples(ctx, ctx.model_inputs or [tensor_spec(t) for t in graph.inputs])
    progress("calibration values of the shards' inputs", 0, 1)
    values = {name: [s[name] for s in samples] for name in samples[0]}
    feeds = [run_host(ctx.host_pre, dict(sample), ctx.host_tables) for sample in samples]
    wanted = [t.name for plan in plans for t in plan.inputs]
    for runs, graph_, wanted_ in ((feeds, graph, wanted), (samples, canonical, [
            t.name for plan in originals if plan is not None for t in plan.inputs])):
        names = [n for n in dict.fromkeys(wanted_) if n not in values]
        if not names or graph_ is None:
            continue
        known = {t.name for t in graph_.inputs}
        for name in names:
            if name in known:
                values[name] = [run[name] for run in runs]
        names = [n for n in names if n not in values]
        if names:
            model = gs.export_onnx(graph_.copy(), do_type_check=False)
            for got in run_each(model, runs, names):
                for name, value in got.items():
                    values.setdefault(name, []).append(value)
    progress("calibration values of the shards' inputs", 1, 1)
    return values, feeds


@dataclass
class Datasets:
    """Quantization samples of shard inputs as .npy files (the vendor's list file names them), one
    set per tensor and shape, written once however many builds take the tensor."""

    root: Path
    values: dict[str, list[np.ndarray]]
    precision: str
    promoted: set[str] = field(default_factory=set)   # mixed: linears kept in fp16
    written: dict[tuple, list[Path]] = field(default_factory=dict)

    def files(self, inputs: list[tuple[str, list[int]]]) -> list[list[Path]]:
        """[sample][input] paths for a shard's inputs in order, each value in the given shape."""
        columns = []
        for name, shape in inputs:
            key = (name, tuple(shape))
            if key not in self.written:
                folder = self.root / str(len(self.written))
                folder.mkdir()
                self.written[key] = []
                for k, value in enumerate(self.values[name]):
                    value = np.asarray(value).reshape(shape)
                    self.written[key].append(folder / f"{k}.npy")
                    np.save(self.written[key][-1], value.astype(np.float32) if value.dtype == np.float64 else value)
            columns.append(self.written[key])
        return [list(sample) for sample in zip(*columns)]


@dataclass
class BundleWriter:
    """What a finished compile knows; `write` puts a bundle of some of its builds into a folder."""

    target: str
    tgt: object
    profile: object
    build: dict
    ctx: PassContext
    graph: gs.Graph
    source: dict
    options: CompileOptions
    logs: Path
    builds: dict[str, ShardBuild]
    choices: list[dict]
    edge_shapes: dict[str, dict]
    started: float
    seconds: dict
    versus: dict | None = None       # shard / vendor alone, for the report
    jobs: dict[str, ShardJob] = field(default_factory=dict)   # every build's job: its precision and samples

    def write(self, folder: Path, chosen: list, host_pre: list[dict], host_post: list[dict]) -> tuple[Manifest, dict]:
        """The bundle of the chosen builds in `folder`: shard files, host tables, logs, manifest, report."""
        ctx = self.ctx
        cores = len(chosen) if self.tgt.stage_streams else self.profile.cores   # GPU: a stream per stage
        specs = keep_files(folder, self.tgt, chosen, cores, self.build, self.edge_shapes, self.jobs, self.builds)
        fp8 = {c["node"] for c in ctx.reports.get("fp8_linears", {}).get("changes", [])}
        for spec in specs if fp8 else []:   # what build-engines checks each engine runs in FP8
            spec.build_options = {**spec.build_options, "fp8_nodes": sorted(fp8 & set(spec.source_nodes))}
        for spec in specs:  # edges scale_sandwich holds divided by a power of two (verify feeds them so)
            if spec.build.endswith(UNREWRITTEN) or spec.build == VENDOR_ALONE:   # the model's own tensors
                continue
            spec.edge_scales = {t.name: list(ctx.scales[t.name]) for t in (*spec.inputs, *spec.outputs)
                                if t.name in ctx.scales}
        for path in (f for step in host_pre for f in step_files(step)):
            (folder / path).parent.mkdir(exist_ok=True)
            np.save(folder / path, ctx.host_tables[path], allow_pickle=False)
        shutil.copytree(self.logs, folder / "logs")
        self.profile.save(folder / "profile.json")
        inputs = ctx.model_inputs or [tensor_spec(t) for t in self.graph.inputs]
        manifest = Manifest(
            target=self.target, source=self.source, shard_version=__version__,
            profile={"file": "profile.json", "target": self.profile.target, "toolkit": self.profile.toolkit,
                     "cores": self.profile.cores},
            build=self.build, inputs=inputs, outputs=ctx.model_outputs or [tensor_spec(t) for t in self.graph.outputs],
            host_pre=host_pre, host_post=host_post, shards=specs)
        report = make_report(ctx.reports, manifest, self.builds,
                             {**self.seconds, "total": time.monotonic() - self.started})
        report["predicted"] = npu_prediction(manifest, report["shards"], self.profile)
        vendor = self.builds.get(VENDOR_ALONE)
        dates = sorted({lim.date for lim in self.profile.limits.values() if lim.date})
        report["profile"] = {"target": self.profile.target, "file": str(self.options.profile or "shipped"),
                             "toolkit": self.profile.toolkit, "cores": self.profile.cores,
                             "probed": dates[-1] if dates else None}
        report.update(precision=self.options.precision, warnings=self.ctx.warnings, choices=self.choices,
                      versus_vendor=self.versus, vendor_only=self.options.vendor_only, host_pre=host_pre,
                      host_post=host_post, host_ms=time_host_steps(host_pre, inputs, folder),
                      host_post_ms=time_host_steps(host_post, [t for spec in specs for t in spec.outputs], folder,
                                                   before=False),
                      vendor_alone=vendor and {"seconds": vendor.seconds, "error": vendor.error,
                                               "diagnostics": vendor.diagnostics,
                                               "figures_only": vendor.figures_only})
        record_files(folder, manifest)
        (folder / MANIFEST).write_text(manifest.to_json())
        (folder / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        return manifest, report


def keep_the_more_faithful(staging: Path, vendor_dir: Path, model: Path, versus: dict,
                           progress: Progress, samples: list | None = None,
                           spent_for_fidelity: bool = False) -> tuple[Manifest, dict]:
    """Run shard's bundle (staging) and the vendor alone's (vendor_dir) on the simulator with the same
    inputs (`samples`, or seeded ones); where shard's worst cosine is lower, the vendor's becomes the
    staging bundle. `spent_for_fidelity`: shard was judged without the cycle axes, its cycles spent
    for fidelity (range rescales, mixed precision's fp16 ops); where that bought nothing (both NaN),
    they count again. Returns the staging bundle's manifest and report, `versus` updated in both."""
    progress("fidelity on the simulator (shard, vendor alone)", 0, 2)
    ours = simulator_cosine(staging, model, samples)
    progress("fidelity on the simulator (shard, vendor alone)", 1, 2)
    theirs = simulator_cosine(vendor_dir, model, samples)
    versus["fidelity"] = {"shard": ours, "vendor": theirs}
    worse = fidelity_worse(ours, theirs)
    if spent_for_fidelity and ours != ours and theirs != theirs:
        versus["judged_on"] = list(AXES)
        versus["line"] += "; both NaN on the simulator, so the cycles count"
        worse = verdict(Figures(**versus["shard"]), Figures(**versus["vendor"])) == "worse"
    if worse:
        versus.update(bundle=versus["vendor_alone"], rewritten=versus["shard"], shard=versus["vendor"], verdict="equal",
                      axes=dict.fromkeys(versus["axes"], "equal"))
        shutil.rmtree(staging)
        vendor_dir.rename(staging)
    else:
        shutil.rmtree(vendor_dir)
    report = json.loads((staging / "report.json").read_text())
    report["versus_vendor"] = versus
    return read_manifest(staging), report


def write_vendor_alone(model: onnx.ModelProto, staging: Path, keep: bool = True) -> None:
    """The model as it came (its input shapes fixed) as the vendor alone's file. keep: a model whose
    weights the file took into external data (past 2 GiB) reads them back, for the passes."""
    if save_onnx(model, staging / "shards" / f"{VENDOR_ALONE}.onnx") and keep:
        onnx.load_external_data_for_model(model, str(staging / "shards"))


def vendor_alone_job(staging: Path, logs: Path, tgt, inputs: list, datasets: Datasets | None = None) -> ShardJob:
    """The build of the model as it came (its file already written, with `inputs`); mixed is shard's
    own recipe, so the vendor alone quantizes the whole model to int8."""
    job = shard_job(staging, logs, tgt, VENDOR_ALONE, inputs, datasets)
    if job.precision == "mixed":
        job.precision, job.float16 = "int8", None
    return job


def write_jobs(staging: Path, logs: Path, tgt, plans: list, originals: list, opset: int, progress: Progress,
               datasets: Datasets | None = None, release: tuple[gs.Graph, ...] = ()) -> Iterator[ShardJob]:
    """The shard builds to make, each as soon as its file is written: each shard and, where the
    passes changed it, its unrewritten twin; quantized builds get their inputs' samples. release:
    the graphs whose weights go as the shards are written (graph.release_weights), each once no
    shard still to be written reads it."""
    versions = [[v for v in pair if v is not None] for pair in zip(plans, originals)]
    if release:   # the passes' discarded graphs still hold weights: collected once, not once a shard
        gc.collect()
    for k, (plan, original) in enumerate(zip(plans, originals)):
        progress("write shards", k, len(plans))
        for name, version in ((plan.name, plan), (f"{plan.name}{UNREWRITTEN}", original)):
            if version is not None:
                sub = gs.Graph(nodes=version.nodes, inputs=version.inputs, outputs=version.outputs, opset=opset,
                               name=plan.name)
                yield write_job(staging, logs, tgt, name, to_toolkit_model(sub, opset), datasets, version.nodes)
        if release:
            release_weights(*release, still_read=[v.nodes for later in versions[k + 1:] for v in later])


def host_steps(ctx: PassContext, chosen: list, builds: dict[str, ShardBuild], versus: dict | None
               ) -> tuple[list[dict], list[dict]]:
    """The host steps the bundle keeps; a CompileError if a kept build is unusable."""
    if versus and versus["bundle"] == "vendor alone":
        return [], []
    failed = next((builds[name].error for name, _ in chosen if builds[name].error), None)
    if failed:
        raise CompileError(failed)
    return prune_host_steps(ctx.host_pre, ctx.host_post, consumed={t.name for _, p in chosen for t in p.inputs},
                            produced={t.name for _, p in chosen for t in p.outputs},
                            outputs={t.name for t in ctx.model_outputs})


def simulator_cosine(bundle: Path, model: Path, samples: list | None = None) -> float:
    """The worst output cosine of a bundle against onnxruntime on the simulator (the samples, or
    one seeded input)."""
    from shard.verifier import verify_bundle

    return min(c.cosine for c in verify_bundle(bundle, model, backend="sim", samples=samples).outputs)


def time_host_steps(steps: list[dict], tensors: list, bundle: Path, before: bool = True) -> float | None:
    """Milliseconds the runtime spends on host steps (before the shards, or after them), on seeded
    values of the `tensors` they read (best of 3)."""
    from shard.runtime import random_inputs
    from shard.runtime.host import load_tables, run_host, step_inputs

    if not steps:
        return None
    read = {name for step in steps for name in step_inputs(step)}
    tables, feeds = load_tables(bundle, steps), random_inputs([t for t in tensors if t.name in read])
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        run_host(steps, dict(feeds), tables, contiguous=before)
        best = min(best, time.perf_counter() - started)
    return round(1000 * best, 3)


def write_job(staging: Path, logs: Path, tgt, name: str, model, datasets: Datasets | None = None,
              nodes: list | None = None) -> ShardJob:
    save_onnx(model, staging / "shards" / f"{name}.onnx")
    if nodes is None and datasets is not None and datasets.precision == "mixed":
        nodes = gs.import_onnx(model).nodes
    return shard_job(staging, logs, tgt, name, data_inputs(model.graph), datasets, nodes)


def data_inputs(graph: onnx.GraphProto) -> list[tuple[str, list[int]]]:
    """(name, shape) of each input a graph is fed (old exports list their weights as inputs too)."""
    weights = {t.name for t in graph.initializer}
    return [(i.name, [d.dim_value for d in i.type.tensor_type.shape.dim]) for i in graph.input if i.name not in weights]


def shard_job(staging: Path, logs: Path, tgt, name: str, inputs: list[tuple[str, list[int]]],
              datasets: Datasets | None = None, nodes: list | None = None) -> ShardJob:
    """The build of staging/shards/NAME.onnx, fed `inputs` (data_inputs); `nodes`, its nodes, for
    mixed precision's fp16 list."""
    onnx_path = staging / "shards" / f"{name}.onnx"
    artifact = staging / "shards" / f"{name}{tgt.artifact_suffix}" if tgt.artifact_suffix else None
    job = ShardJob(name=name, onnx=onnx_path, artifact=artifact, log=logs / f"{name}.log")
    if datasets is not None:
        job.precision, job.dataset = datasets.precision, datasets.files(inputs)
        if datasets.precision == "mixed":
            from shard.precision import float16_names

            job.float16 = float16_names(nodes or [], datasets.promoted, [name for name, _ in inputs])
    return job


def choose_versions(plans: list, originals: list, builds: dict[str, ShardBuild],
                    axes: tuple[str, ...] = AXES, in_range: set[str] = frozenset(),
                    best: dict[str, str] | None = None) -> tuple[list, list[dict]]:
    """[(build name, plan)] with each shard's better build, and why: a rewritten shard is kept unless
    its build is worse than its unrewritten twin's on the measured `axes`. A shard holding a node
    of `in_range` (scale_sandwich's range rescales) is judged without the cycle axes: its twin would
    leave fp16's range, which no build figure shows. `best`: {build: a better build of the same
    shard} (edges in the vendor's layout), which stands for it."""
    best = best or {}
    chosen, choices = [], []
    for plan, original in zip(plans, originals):
        ours = best.get(plan.name, plan.name)
        if original is None:
            chosen.append((ours, plan))
            continue
        twin = best.get(f"{plan.name}{UNREWRITTEN}", f"{plan.name}{UNREWRITTEN}")
        rewritten, unrewritten = Figures.of([builds[ours]]), Figures.of([builds[twin]])
        judged = HARD_AXES if in_range & {n.name for n in plan.nodes} else axes
        keep = verdict(rewritten, unrewritten, judged) != "worse"
        chosen.append((ours, plan) if keep else (twin, original))
        choices.append({"shard": plan.name, "kept": "rewritten" if keep else "unrewritten",
                        "what": f"kept the {'rewritten' if keep else 'unrewritten'} build",
                        "rewritten": asdict(rewritten), "unrewritten": asdict(unrewritten),
                        "dropped_nodes": [] if keep else sorted(set(original.source_nodes)),
                        "line": comparison_line(rewritten, unrewritten, "rewritten / unrewritten")})
    return chosen, choices


def against_vendor_alone(chosen: list, builds: dict[str, ShardBuild], axes: tuple[str, ...], vendor_only: bool,
                         canonical: gs.Graph) -> tuple[list, dict | None]:
    """The kept shards beside the vendor alone's build of the model as it came: where shard is
    worse and the vendor's build is usable (or --vendor-only), the bundle becomes the vendor's build. Returns the shards to bundle and
    the comparison for the report (None without a vendor build)."""
    vendor = builds.get(VENDOR_ALONE)
    if vendor is None:
        return chosen, None
    if vendor_only and vendor.error:
        raise CompileError(vendor.error)
    ours, theirs = Figures.of([builds[name] for name, _ in chosen]), Figures.of([vendor])
    fall_back = vendor_only or (vendor.error is None and verdict(ours, theirs, axes) == "worse")
    versus = comparison(ours, theirs, axes, fall_back, "vendor alone")
    return ([(VENDOR_ALONE, vendor_plan(canonical))] if fall_back else chosen), versus


def against_unrewritten(chosen: list, plans: list, originals: list, builds: dict[str, ShardBuild],
                        axes: tuple[str, ...]) -> tuple[list, dict]:
    """The kept shards beside the vendor alone shard by shard, where the whole model's build is not
    made: each shard built without its rewrites (its twin where the passes changed it, else its own
    build), which is also the bundle where shard is worse."""
    unrewritten = unrewritten_versions(plans, originals)
    ours, theirs = (Figures.of([builds[name] for name, _ in kept]) for kept in (chosen, unrewritten))
    fall_back = verdict(ours, theirs, axes) == "worse"
    versus = comparison(ours, theirs, axes, fall_back, SHARD_BY_SHARD)
    return (unrewritten if fall_back else chosen), versus


def fidelity_baseline(versus: dict | None, builds: dict[str, ShardBuild], chosen: list, vendor: list) -> list | None:
    """The vendor alone's (build, plan) list that shard's bundle is checked against on the simulator:
    `vendor` (its whole build, or each shard without its rewrites), where it built and differs from
    the bundle; else None."""
    if not versus or versus["bundle"] != "shard" or any(name not in builds for name, _ in vendor):
        return None
    usable = Figures.of([builds[name] for name, _ in vendor])
    if not usable.builds or usable.regtask_lines:   # nothing to run: shard is better by construction
        return None
    return None if [b for b, _ in vendor] == [b for b, _ in chosen] else vendor


def link_builds(folder: Path, into: Path, names: list[str], artifact_suffix: str) -> None:
    """Each named build's files (ONNX, external weights, artifact) linked from one shards folder into another."""
    into.mkdir(parents=True)
    for name in names:
        for suffix in (".onnx", ".onnx.data", artifact_suffix):
            if suffix and (folder / f"{name}{suffix}").exists():
                link_or_copy(folder / f"{name}{suffix}", into / f"{name}{suffix}")


def unrewritten_versions(plans: list, originals: list) -> list:
    """(build, plan) of each shard as the vendor alone would take its region: its twin where the
    passes changed it, else its own build."""
    return [(f"{plan.name}{UNREWRITTEN}", original) if original is not None else (plan.name, plan)
            for plan, original in zip(plans, originals)]


def fidelity_samples(ctx: PassContext, graph: gs.Graph, quantized: bool) -> list[dict[str, np.ndarray]]:
    """What shard's bundle and the vendor alone's are compared on: the first calibration samples where
    the user gave them (or the compile quantizes from them), else seeded inputs of the model's own
    domain (shard.calibration.domain_samples: token ids from its vocabulary, masks of ones)."""
    from shard.calibration import calibration_samples, domain_samples

    inputs = ctx.model_inputs or [tensor_spec(t) for t in graph.inputs]
    if quantized or ctx.options.calib:
        return calibration_samples(ctx, inputs)[:FIDELITY_SAMPLES]
    return domain_samples(graph, inputs, FIDELITY_SAMPLES)


def comparison(ours: Figures, theirs: Figures, axes: tuple[str, ...], fall_back: bool, vendor: str) -> dict:
    """versus_vendor of the report: shard's figures (the vendor's where the bundle fell back to its
    builds) beside the vendor alone's (`vendor`: how it was built), the verdict and the printed line."""
    bundled = theirs if fall_back else ours
    line = comparison_line(ours, theirs, f"shard / {vendor}") + (
        "" if axes == AXES else f"; judged on {', '.join(LABELS[a] for a in axes)} only (cycles spent by "
                                "choice: forced tiles, fp16 ops of mixed precision, range rescales)")
    return {"shard": asdict(bundled), "vendor": asdict(theirs), "axes": per_axis(bundled, theirs), "judged_on": list(axes),
            "verdict": verdict(bundled, theirs), "line": line, "vendor_alone": vendor,
            "bundle": vendor if fall_back else "shard", "rewritten": asdict(ours) if fall_back else None}


def vendor_plan(graph: gs.Graph) -> ShardPlan:
    """The whole model as one shard: the bundle of the vendor alone (its build is VENDOR_ALONE's)."""
    return ShardPlan(name=VENDOR_ALONE, nodes=list(graph.nodes), inputs=list(graph.inputs),
                     outputs=list(graph.outputs), macs=sum(estimate_macs(n) for n in graph.nodes),
                     source_nodes=[n.name for n in graph.nodes])


def relayout_jobs(staging: Path, logs: Path, tgt, chosen: list, datasets: Datasets | None = None
                  ) -> list[tuple[ShardJob, dict]]:
    """For each kept build whose log shows the vendor reshaping an edge on the CPU: a job building the
    shard with that edge in the vendor's 4-D layout, and the input shapes the runtime then feeds."""
    relaid = []
    for built, plan in chosen:
        inputs, outputs = tgt.edge_layouts(logs / f"{built}.log", {t.name: [int(d) for d in t.shape] for t in plan.inputs},
                                           {t.name: [int(d) for d in t.shape] for t in plan.outputs})
        if inputs or outputs:
            model = relayout(onnx.load(str(staging / "shards" / f"{built}.onnx")), inputs, outputs)
            relaid.append((write_job(staging, logs, tgt, f"{built}{EDGES}", model, datasets), inputs))
    return relaid


def keep_better_edges(relaid: list, builds: dict[str, ShardBuild], axes: tuple[str, ...]
                      ) -> tuple[dict[str, str], list[dict]]:
    """{build: its relaid build} where the relaid one is better on the measured axes, and why."""
    better, choices = {}, []
    for job, _ in relaid:
        first = job.name[: -len(EDGES)]
        ours, theirs = Figures.of([builds[job.name]]), Figures.of([builds[first]])
        keep = verdict(ours, theirs, axes) == "better"
        if keep:
            better[first] = job.name
        choices.append({"shard": first.removesuffix(UNREWRITTEN), "build": first, "relaid": job.name,
                        "kept": "relaid edges" if keep else "edges as they were",
                        "what": "kept the build with its edges in the vendor's 4-D layout" if keep
                        else "kept its edges as they were", "dropped_nodes": [],
                        "line": comparison_line(ours, theirs, "edges relaid / as they were")})
    return better, choices


def keep_files(staging: Path, tgt, chosen: list, cores: int, build: dict,
               edge_shapes: dict[str, dict], jobs: dict[str, ShardJob], builds: dict[str, ShardBuild]) -> list[ShardSpec]:
    """Give the chosen builds the shard names (shard_000, ...) and drop the others' files; the
    logs of every build stay. A quantized shard's samples go into calib/ (the simulator quantizes
    it from them again). Each shard carries what its build hashed (ShardBuild.built_from)."""
    folder = staging / "shards"
    keep = {}
    specs = []
    for k, (built, plan) in enumerate(chosen):
        name = f"shard_{k:03d}"
        for suffix in (".onnx", ".onnx.data", tgt.artifact_suffix):
            if suffix and (folder / f"{built}{suffix}").exists():
                keep[folder / f"{name}{suffix}"] = folder / f"{built}{suffix}"
        job = jobs.get(built)
        precision = job.precision if job and job.dataset else build.get("precision", "fp32")
        dataset = []
        for s, sample in enumerate(job.dataset if job and job.dataset else []):
            (staging / "calib" / name).mkdir(parents=True, exist_ok=True)
            dataset.append([f"calib/{name}/{s}_{i}.npy" for i in range(len(sample))])
            for src, rel in zip(sample, dataset[-1]):
                link_or_copy(src, staging / rel)
        specs.append(ShardSpec(name=name, onnx=f"shards/{name}.onnx",
                               artifact=f"shards/{name}{tgt.artifact_suffix}" if tgt.artifact_suffix else None,
                               log=f"logs/{built}.log", inputs=[tensor_spec(t) for t in plan.inputs],
                               outputs=[tensor_spec(t) for t in plan.outputs], core=k % cores,
                               precision=precision, macs=plan.macs, source_nodes=plan.source_nodes,
                               build=built, edge_shapes=edge_shapes.get(built, {}),
                               build_options=tgt.build_for(build, precision, job.float16 if job else None)
                               if precision != build.get("precision") else {}, dataset=dataset,
                               built_from=dict(builds[built].built_from) if built in builds else {}))
    moved = {}
    for dst, src in keep.items():  # through temporary names: shard_001 may be another file's old name
        tmp = src.with_name(f"{src.name}.keep")
        src.rename(tmp)
        moved[dst] = tmp
    for path in folder.iterdir():
        if not path.name.endswith(".keep"):
            path.unlink()
    for dst, tmp in moved.items():
        tmp.rename(dst)
    for spec in specs:
        if (staging / f"{spec.onnx}.data").is_file():   # the weights of a model past 2 GiB: the file names them
            relocate_weights(staging / spec.onnx, spec.built_from)
    return specs


def relocate_weights(path: Path, built_from: dict[str, str]) -> None:
    """Point an ONNX file's external tensors at PATH.data (the file was renamed, its weights with it).
    Where `built_from` holds the file as its build read it, it then holds the file as edited."""
    read = sha256_file(path)
    model = onnx.load(str(path), load_external_data=False)
    for tensor in graph_tensors(model.graph):
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = f"{path.name}.data"
    onnx.save(model, str(path))
    if built_from.get("onnx") == read:
        built_from["onnx"] = sha256_file(path)


def run_passes(graph: gs.Graph, tgt, profile, options: CompileOptions, progress: Progress = lambda *a: None,
               until: str | None = None, snapshot: tuple[str, ...] = ()) -> tuple[gs.Graph, PassContext]:
    """The pass pipeline (up to `until`); where the target has a toolkit, the passes ask it about
    single ops and small regions (cached builds), and its workers stop when the passes end."""
    ops = None
    try:
        ops = tgt.pass_toolkit(profile, options)
        ctx = PassContext(profile=profile, options=options, ops=ops, build_memory=tgt.build_memory,
                          legality=Legality(profile, ops and OneOpBuilds(ops)) if profile.limits else None)
        graph = run_pipeline(graph, ctx, options.disable, on_pass=lambda name: progress(name, 0, 1),
                             dump_after=options.dump_after, until=until, snapshot=snapshot, pipeline=tgt.pipeline)
    except BaseException:
        if ops is not None:   # interrupted or failed: the workers go at once, not after their build
            ops.close(kill=True)
        raise
    if ops is not None:
        ops.close()
    return graph, ctx


def confirm_tiles_in_logs(reports: dict, jobs: list[ShardJob], undone: set[str]) -> None:
    """Read the kept shard builds' layer tables: did the attention tiles stay apart? (Tilings undone
    in favour of an unrewritten shard have nothing to confirm.)"""
    from shard.passes.tile_attention import confirm_tiles
    from shard.toolkit.log import parse_build_log

    changes = [c for c in reports.get("tile_attention", {}).get("changes", []) if c["node"] not in undone]
    if not changes:
        return
    names = [layer.name for job in jobs if job.log.exists()
             for layer in parse_build_log(job.log.read_text(errors="replace")).layers]
    if names:  # targets without a layer table (cpu) have nothing to confirm
        confirm_tiles(changes, names)


def check_options(options: CompileOptions) -> None:
    from shard.passes import fusion_barrier, tile_attention

    for flag, value, modes in (("--tile-attention", options.tile_attention, tile_attention.MODES),
                               ("--fusion-barrier", options.fusion_barrier, fusion_barrier.MODES),
                               ("--vendor-alone", options.vendor_alone, BASELINES)):
        if value not in modes:
            raise ShardError(f"{flag} {value!r}: expected one of {', '.join(modes)}")
    if options.fusion_barrier == "rules" and not options.disable_rules:
        raise ShardError("--fusion-barrier rules needs the rule names: --disable-rule NAME (repeatable)")
    if options.precision not in PRECISIONS:
        raise ShardError(f"--precision {options.precision!r}: expected one of {', '.join(PRECISIONS)}")
    if not 0.0 < options.min_cosine <= 1.0:
        raise ShardError(f"--min-cosine {options.min_cosine}: expected a cosine in (0, 1]")


def save_onnx(model, path: Path) -> bool:
    """Write the model; one past protobuf's 2 GiB cap keeps its weights beside it (PATH.data), and then
    (True returned) the model in memory points at that file instead of holding them."""
    large = not fits_protobuf(model)
    onnx.save(model, str(path), save_as_external_data=large, location=f"{path.name}.data" if large else None)
    return large


def check_output_path(output: Path, model: Path | None = None) -> None:
    """Refuse to replace anything at `output` that is not a bundle, or that holds the model; make sure
    its folder exists; remove what compiles of the same output that no longer run left beside it."""
    from shard.runtime.buckets import is_bucketed

    if model is not None and model.resolve().is_relative_to(output.resolve()):
        raise ShardError(f"{model} lies inside the output {output}, which the bundle replaces; choose another -o")
    if output.exists() and not ((output / MANIFEST).is_file() or is_bucketed(output)):
        raise ShardError(f"{output} exists and is not a shard bundle; remove it or choose another -o")
    if not output.parent.is_dir():
        raise ShardError(f"{output.parent}: no such directory for the bundle")
    remove_stale_staging(output)


STAGING = re.compile(r"^\.(?P<name>.+)\.(tmp|mixed|old)-(?P<pid>\d+)(-|$)")


def remove_stale_staging(output: Path) -> list[Path]:
    """Staging folders of `output` (.NAME.tmp-PID-*, .NAME.mixed-PID-*, .NAME.old-PID) whose compile
    process is gone: what a compile killed outright (SIGKILL, a power cut) could not remove itself."""
    removed = []
    for path in output.parent.glob(f".{glob.escape(output.name)}.*-*"):
        match = STAGING.match(path.name)
        if match and match["name"] == output.name and not process_alive(int(match["pid"])):
            if path.name.endswith(f".old-{match['pid']}") and not output.exists():
                path.rename(output)   # the compile died between its two renames: this is the only bundle
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True   # someone else's
    return True


def replace_dir(staging: Path, output: Path) -> None:
    """Put the finished bundle in place: a rename, so readers never see half of one."""
    if output.exists():
        old = output.with_name(f".{output.name}.old-{os.getpid()}")
        output.rename(old)
        staging.rename(output)
        shutil.rmtree(old)
    else:
        staging.rename(output)


def make_report(passes: dict, manifest: Manifest, builds: dict[str, ShardBuild], seconds: dict) -> dict:
    shards = []
    for spec in manifest.shards:
        b = builds[spec.build]
        shards.append({"name": spec.name, "build": spec.build, "core": spec.core, "nodes": len(spec.source_nodes),
                       "macs": spec.macs,
                       "inputs": [t.name for t in spec.inputs], "outputs": [t.name for t in spec.outputs],
                       "build_seconds": b.seconds, "build_peak_bytes": b.peak_bytes, "cached": b.cached,
                       "diagnostics": b.diagnostics})
    def total(key: str) -> int:  # counts are ints, findings are lists of names
        values = [s["diagnostics"].get(key, 0) for s in shards]
        return sum(len(v) if isinstance(v, list) else v for v in values)

    after = total("estimated_cycles")
    by_dtype: dict[str, int] = {}
    for s in shards:
        for dtype, macs in s["diagnostics"].get("macs_by_dtype", {}).items():
            by_dtype[dtype] = by_dtype.get(dtype, 0) + macs
    vendor = builds.get(VENDOR_ALONE)
    before = vendor.diagnostics.get("estimated_cycles", 0) if vendor and vendor.error is None \
        else after + rewrite_delta(passes)
    return {"passes": passes, "shards": shards,
            "totals": {"shards": len(shards), "regtask_lines": total("regtask_lines"),
                       "error_lines": total("error_lines"), "cpu_ops": total("cpu_ops"),
                       "single_core_fallbacks": total("single_core_fallbacks"),
                       "estimated_cycles": after, "estimated_cycles_before_passes": before,
                       "macs_by_dtype": by_dtype,
                       "int8_mac_share": round(by_dtype.get("INT8", 0) / sum(by_dtype.values()), 4)
                       if by_dtype else None},
            "seconds": {k: round(v, 2) for k, v in seconds.items()},
            "builds": {"total": len(builds), "from_cache": sum(b.cached for b in builds.values())}}


def npu_prediction(manifest: Manifest, rows: list[dict], profile) -> dict | None:
    """One frame's NPU time and run_stream's frames/s on 1..cores cores, from each shard's estimated
    cycles at the NPU clock (its MACs at the fp16 peak where the vendor gives none), through the
    scheduler's own policy (shard.runtime.scheduler.predict_stream). Host steps not counted."""
    from shard.passes.partition import npu_seconds_per_mac
    from shard.runtime.scheduler import predict_stream

    clock, per_mac = profile.facts.get("npu_clock_hz"), npu_seconds_per_mac(profile.facts)
    if not clock or not manifest.shards:
        return None
    seconds = [(row["diagnostics"].get("estimated_cycles") or 0) / clock or row["macs"] * per_mac for row in rows]
    return {"shard_seconds": seconds, "latency_s": predict_stream(manifest.shards, seconds, [0])[0],
            "stream_fps": {str(n): predict_stream(manifest.shards, seconds, list(range(n)))[1]
                           for n in range(1, profile.cores + 1)}}


def cycle_note(change: dict) -> str:
    """A rewrite's cycles as the vendor estimates them, and with the ops it leaves at 0 costed."""
    if change.get("before_cycles") is None:
        return ""
    note = f" ({change['before_cycles'] / 1e6:.2f} M -> {change['after_cycles'] / 1e6:.2f} M estimated cycles"
    if change.get("ddr_cycles_per_kb"):
        note += (f"; {change['before_cost'] / 1e6:.2f} M -> {change['after_cost'] / 1e6:.2f} M with the ops the "
                 f"estimate leaves at 0 costed by bytes at {change['ddr_cycles_per_kb']} cycles/KB")
    return note + ")"


def rewrite_delta(passes: dict) -> int:
    """Cycles the rewrites saved, each measured by building its region before and after alone.
    The whole model before the passes is then the built shards' sum plus this."""
    return sum((c.get("before_cycles") or 0) - (c.get("after_cycles") or 0)
               for report in passes.values() for c in report.get("changes", []) if "before_cycles" in c)
