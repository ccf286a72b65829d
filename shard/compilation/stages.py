"""compile_one: one bundle of one precision at fixed input shapes, as a short list of named stages over
a Compilation; each stage a function below it, in order, and run_passes, which inspect shares."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Iterator

import numpy as np
import onnx_graphsurgeon as gs

from shard import scratch
from shard.cache_folder import default_cache_dir
from shard.compilation.choice import (against_unrewritten, against_vendor_alone, choose_versions, fidelity_baseline,
                                      fidelity_samples, first_overflow, host_steps, keep_better_edges,
                                      keep_the_more_faithful, unrewritten_versions, vendor_plan)
from shard.compilation.fidelity import Chains, Runs, composed_worst
from shard.compilation.jobs import (Datasets, data_inputs, quantization_values, relayout_jobs, vendor_alone_job,
                                    write_jobs, write_vendor_alone)
from shard.compilation.names import FIDELITY_SAMPLES, LOW_FIDELITY, QUANTIZED, UNREWRITTEN, VENDOR_ALONE, Progress
from shard.compilation.staging import replace_dir, scratch_folders
from shard.compilation.state import Compilation, CompileResult
from shard.compilation.writer import BundleWriter, confirm_tiles_in_logs, link_builds
from shard.errors import CompileError, ShardError
from shard.graph import default_opset, fix_input_values, load_model, own_values, quiet_graphsurgeon, sha256_file
from shard.never_worse import (AXES, HARD_AXES, fix_input_shapes, handoff_cycles, no_handoffs, original_plans,
                               whole_build_fits)
from shard.options import CompileOptions
from shard.passes import PassContext, run_pipeline
from shard.passes.canonicalize import prepare_model
from shard.passes.fit import Legality, OneOpBuilds
from shard.precision import rank_linears
from shard.profile import load_profile
from shard.summary import cut_of, passed
from shard.targets.build_cache import structure_key
from shard.targets.chips import board_handoff
from shard.targets.registry import get_target


def compile_one(model: Path, target: str, output: Path, options: CompileOptions,
                progress: Progress) -> CompileResult:
    """One bundle of one precision at fixed input shapes: the stages, in order."""
    c = start(model, target, output, options, progress)   # the target, its profile, the staging bundle
    with staged(c):                    # a failure leaves nothing at the output, and only the logs it names
        load(c)                        # the model, and how the vendor alone will stand beside it
        with c.tgt.builds(options.jobs, options.timeout, c.cache, c.logs, options.ray) as c.builder:
            start_vendor_alone(c)      # its build runs through the passes (or an earlier one's figures stand in)
            rewrite(c)                 # the target's passes: the graph rewritten and partitioned
            build_shards(c)            # each shard built once written, beside its unrewritten twin
            choose(c)                  # each shard's better build (rewritten or not, edges relaid or not)
            stand_beside_vendor(c)     # the whole beside the vendor alone: its build where shard is worse
            write_bundle(c)            # host steps, shard files, manifest, report
            check_fidelity(c)          # on the simulator, on the same workers: the bundle beside the vendor alone's
        progress("write the bundle", 1, 1)
        replace_dir(c.staging, output)   # the last step: a stop a finalizer swallowed stops here, leaving nothing
    return CompileResult(bundle=output, manifest=c.manifest, report=c.report, rank=c.rank)


def start(model: Path, target: str, output: Path, options: CompileOptions, progress: Progress) -> Compilation:
    """The target and its profile checked against the options; the staging bundle beside the output
    (same filesystem, so the final rename is atomic) and the logs outside it."""
    tgt = get_target(target)
    if options.precision not in tgt.precisions and (options.precision != "fp16" or tgt.vendor):  # cpu: fp32 as asked
        raise ShardError(f"--precision {options.precision}: target {target} builds {', '.join(tgt.precisions)}"
                         + (" (pass --precision int8 with --calib FILE.npz)" if "fp16" not in tgt.precisions else ""))
    profile = load_profile(target, options.profile)
    if options.precision in QUANTIZED and "w8a8" not in profile.facts.get("quantized_dtypes", ["w8a8"]):
        raise ShardError(f"--precision {options.precision}: the {target} profile's probe found no int8 (w8a8) "
                         f"build: {profile.facts.get('quantized_dtypes_source', '')}")
    if options.vendor_only and not tgt.vendor:
        raise ShardError(f"--vendor-only: target {target} has no vendor compiler")
    quiet_graphsurgeon()
    started = time.monotonic()
    staging, logs = scratch_folders(output)
    (staging / "shards").mkdir()
    return Compilation(model=model, target=target, tgt=tgt, output=output, options=options, progress=progress,
                       profile=profile, staging=staging, logs=logs, started=started,
                       quantized=options.precision in QUANTIZED)


@contextmanager
def staged(c: Compilation) -> Iterator[None]:
    """Whatever ends the compile, its temporary files go: on failure the staging bundles too, and the
    logs unless the message names them (a build that failed)."""
    try:
        yield
    except BaseException as exc:
        shutil.rmtree(c.staging, ignore_errors=True)
        shutil.rmtree(c.vendor_dir, ignore_errors=True)
        (scratch.keep if str(c.logs) in str(exc) else scratch.remove)(c.logs)
        raise
    else:
        scratch.remove(c.logs)
    finally:
        if c.datasets:
            scratch.remove(c.datasets.root)


def load(c: Compilation) -> None:
    """The model, its hash, the build options, and whether the vendor alone's build of the whole model
    is made (--vendor-alone, and whether it fits in memory) or it stands beside shard by shard."""
    options = c.options
    c.progress("load", 0, 1)
    c.proto = load_model(c.model)
    c.source = {"name": c.model.name, "sha256": sha256_file(c.model)}
    against_vendor = c.tgt.vendor and (options.vendor_baseline or options.vendor_only)
    # --check-fidelity asks for the whole model's check: the vendor alone built whole, unless told otherwise.
    how = "whole" if options.vendor_only or options.check_fidelity and options.vendor_alone == "auto" \
        else options.vendor_alone
    whole, c.why = whole_build_fits(c.proto, how, c.tgt, jobs=options.jobs, quantized=c.quantized) \
        if against_vendor else (False, "")
    c.per_shard = against_vendor and not whole   # the vendor alone from the shards' unrewritten builds
    c.whole = against_vendor and whole
    c.build = c.vendor_build = c.tgt.build_options(options)
    c.cache = default_cache_dir() if options.build_cache else None
    checked = against_vendor if options.check_fidelity is None else options.check_fidelity
    if checked and c.tgt.vendor and not options.vendor_only:   # its runs made where each shard builds
        c.chains = Chains(Runs(c.cache, f"{c.target} {c.tgt.toolchain()}"))


def start_vendor_alone(c: Compilation) -> None:
    """The vendor alone's build of the model as it came, started before the passes (the longest build
    runs through them); in fp16, built before with other weights, those figures stand in, and the
    build is made only if its artifact is needed (the fidelity check, or a bundle falling back to it)."""
    if not c.whole:
        return
    fix_input_shapes(c.proto, c.options.input_shapes)
    c.vendor_inputs = data_inputs(c.proto.graph)
    c.vendor_runs = c.chains.whole(c.proto.graph) if c.chains else None
    if not c.quantized:
        c.vendor_job = vendor_alone_job(c.staging, c.logs, c.tgt, c.vendor_inputs)
        c.vendor_job.figures_key = structure_key(c.proto)
        c.vendor_job.runs = c.vendor_runs
        if not (c.options.vendor_only or c.options.check_fidelity):
            c.stand_in = c.builder.figures(c.vendor_job, c.build)
    if not c.stand_in:   # written now, so its weights are not held twice through the passes
        write_vendor_alone(c.proto, c.staging)
    if c.vendor_job and not c.stand_in:
        c.early = c.builder.submit([c.vendor_job], c.build, c.done.append)


def rewrite(c: Compilation) -> None:
    """The target's passes; the canonical graph is kept so each rewritten shard can also be built as
    the vendor would take it (its twin); quantized, every shard input's value on each sample."""
    fix_input_values(c.proto, c.options.input_values)   # after the vendor alone took the model as it came
    proto, prepared = prepare_model(c.proto, c.tgt.min_opset)
    c.proto = None
    c.opset = default_opset(proto)
    graph = own_values(gs.import_onnx(proto))
    del proto
    c.graph, c.ctx = run_passes(graph, c.tgt, c.profile, c.options, c.progress,
                                snapshot=("canonicalize",) if c.tgt.vendor else (),
                                until="slow_paths" if c.options.vendor_only else None)
    c.ctx.reports["canonicalize"]["prepared"] = prepared
    c.plans = c.ctx.plan or []
    c.builder.at_once(cut_of(c.ctx.reports).builds_at_once or c.options.jobs)
    c.canonical = c.ctx.snapshots.pop("canonicalize", None)
    c.originals = original_plans(c.canonical, c.plans, c.ctx.host_post) if c.canonical is not None \
        else [None] * len(c.plans)
    if c.quantized:
        c.values, c.feeds = quantization_values(c.ctx, c.graph, c.canonical, c.plans, c.originals, c.progress)
    if c.chains:
        c.samples = fidelity_samples(c.ctx, c.canonical or c.graph, c.quantized)
        c.chains.start(c.samples, c.ctx.host_pre, c.ctx.host_tables)
    if c.options.precision == "mixed":
        c.ctx.reports["mixed"] = {"promoted": sorted(c.options.promote)}
        graph, feeds, progress = c.graph, c.feeds, c.progress
        c.rank = lambda: mixed_ranking(graph, feeds, progress)   # for compile_mixed, if it needs one
    c.seconds["passes"] = time.monotonic() - c.started


def build_shards(c: Compilation) -> None:
    """Write the shards and build each as soon as it is written (the vendor alone too, quantized from
    the samples the passes took). The workers load the toolkit while the first shard is written: not
    earlier, where they would hold memory beside the passes' peak and share its cores."""
    c.builder.start()
    if c.quantized:
        c.datasets = Datasets(scratch.folder("calib"), c.values, c.options.precision,
                              set(c.options.promote or ()))
    if c.whole and c.quantized:
        c.vendor_job = vendor_alone_job(c.staging, c.logs, c.tgt, c.vendor_inputs, c.datasets)
        c.vendor_job.runs = c.vendor_runs
    if c.ctx.build_config and "config" in c.build:   # the passes' toolkit config is the shards' only
        c.build = {**c.build, "config": {**c.build["config"], **c.ctx.build_config}}
    c.jobs = [c.vendor_job] if c.vendor_job and not c.stand_in else []
    under_way = [*c.early, *c.builder.submit(c.jobs[len(c.early):], c.vendor_build, c.on_done("compile shards"))]
    # Each shard's weights go once no shard still to be written reads them; mixed ranks its linears
    # on the graph after the build and keeps them.
    held = () if c.options.precision == "mixed" else tuple(g for g in (c.graph, c.canonical) if g is not None)
    runs = c.chains.shards(c.plans, c.originals, c.per_shard) if c.chains else {}
    for job in write_jobs(c.staging, c.logs, c.tgt, c.plans, c.originals, c.opset, c.progress, c.datasets, held):
        job.runs = runs.get(job.name)
        c.jobs.append(job)
        under_way += c.builder.submit([job], c.build, c.on_done("compile shards"))
    c.builds = c.compile_jobs([], "compile shards", under_way)
    if c.stand_in:
        c.builds[VENDOR_ALONE] = c.stand_in
    c.seconds["build"] = time.monotonic() - c.started - c.seconds["passes"]


def choose(c: Compilation) -> None:
    """Each shard's better build: rewritten or its unrewritten twin, each with its edges as they were
    or in the vendor's layout, whichever is better on the measured axes. Forced tiles and mixed
    precision's fp16 ops cost cycles by choice (cores, fidelity), so cycles are not judged there."""
    c.axes = HARD_AXES if c.options.tile_attention == "force" or c.options.precision == "mixed" else AXES
    stop_where_both_fail(c)
    c.in_range = {ch.node for ch in passed(c.ctx.reports, "scale_sandwich").changes if ch.form == "range"}
    versions = [(plan.name, plan) for plan in c.plans] + [
        (f"{plan.name}{UNREWRITTEN}", original) for plan, original in zip(c.plans, c.originals)
        if original is not None]
    c.relaid = relayout_jobs(c.staging, c.logs, c.tgt, versions, c.datasets)
    best, edge_choices = {}, []
    if c.relaid:
        c.jobs += [job for job, _ in c.relaid]
        c.builds.update(c.compile_jobs([job for job, _ in c.relaid], "compile shards (edges in the vendor's layout)"))
        best, edge_choices = keep_better_edges(c.relaid, c.builds, c.axes)
    scaled = {name for name, (_, k) in c.ctx.scales.items() if k}
    c.own, c.choices = choose_versions(c.plans, c.originals, c.builds, c.axes, c.in_range, best, scaled)
    kept = {name for name, _ in c.own}
    c.choices += [ch for ch in edge_choices if ch["build"] in kept or ch["relaid"] in kept]


def stop_where_both_fail(c: Compilation) -> None:
    """A shard whose build and unrewritten twin are unusable where the vendor alone's is too (its whole
    build, or that twin shard by shard): nothing shard can keep builds, so the compile stops now, in
    one line naming both, rather than building the shards' edges in the vendor's layout first (a
    902-node model took 9 minutes to say it failed, in a message naming only an internal variant)."""
    vendor = c.builds.get(VENDOR_ALONE)
    if c.whole and (vendor is None or not vendor.error):
        return
    for plan in c.plans:
        ours, twin = c.builds[plan.name], c.builds.get(f"{plan.name}{UNREWRITTEN}")
        if not ours.error or twin is not None and not twin.error:
            continue
        if c.whole:
            theirs = f"the vendor alone's build of the whole model is unusable too: {vendor.error}"
        elif twin is not None:
            theirs = f"the vendor alone's build of it (the shard as it came) is unusable too: {twin.error}"
        else:
            theirs = "the passes did not change it: the vendor alone's build of it is this one"
        raise CompileError(f"both fail: shard's build of {plan.name} is unusable ({ours.error}); {theirs}; "
                           f"nothing written")


def stand_beside_vendor(c: Compilation) -> None:
    """The kept shards beside the vendor alone (its whole build, or shard by shard): its build is the
    bundle where shard is worse. Range rescales exist because the model as it came leaves fp16's
    range: the simulator judges that (fidelity, on by default then), not the cycles they cost."""
    judged = HARD_AXES if c.in_range else c.axes
    handoffs = board_handoffs(c)
    if c.per_shard:
        c.chosen, c.versus = against_unrewritten(c.own, c.plans, c.originals, c.builds, judged, handoffs)
    else:
        c.chosen, c.versus = against_vendor_alone(c.own, c.builds, judged, c.options.vendor_only,
                                                  c.canonical or c.graph, handoffs)
    if c.versus:
        c.versus["why"] = c.why
    # Fidelity is part of never worse: a rewrite or a cut can lose what the vendor's build keeps
    # (a trained decoder cut inside its RMSNorm: cosine 0.038 against the vendor's 0.99999).
    c.measure = bool(c.versus) if c.options.check_fidelity is None else c.options.check_fidelity
    if c.stand_in and (c.measure or c.versus["bundle"] == "vendor alone"):   # its artifact is needed now
        as_it_came = load_model(c.model)
        fix_input_shapes(as_it_came, c.options.input_shapes)
        write_vendor_alone(as_it_came, c.staging, keep=False)
        del as_it_came
        c.jobs.insert(0, c.vendor_job)
        c.builds.update(c.compile_jobs([c.vendor_job], "compile the model as it came (vendor alone)",
                                       config=c.vendor_build))
        c.chosen, c.versus = against_vendor_alone(c.own, c.builds, judged, c.options.vendor_only,
                                                  c.canonical or c.graph, handoffs)


def board_handoffs(c: Compilation) -> Callable[[list], int]:
    """What a list of plans hands off on the target's board, in NPU cycles (never_worse.handoff_cycles),
    for the comparison with the vendor alone; nothing where --shards fixed the cut: its hand-offs are
    the user's choice (a stream spread over the cores), as forced tiles' cycles are."""
    if c.options.shards:
        return no_handoffs
    return partial(handoff_cycles, handoff=board_handoff(c.target, c.profile.facts),
                   clock_hz=c.profile.facts.get("npu_clock_hz"))


def write_bundle(c: Compilation) -> None:
    """The host steps, the chosen builds' files, the manifest and the report; where fidelity is
    checked, the vendor alone's builds set aside first (the writer drops the other builds' files)."""
    ctx = c.ctx
    host_pre, host_post = host_steps(ctx, c.chosen, c.builds, c.versus)
    if c.measure:
        c.baseline = fidelity_baseline(c.versus, c.builds, c.chosen, unrewritten_versions(c.plans, c.originals)
                                       if c.per_shard else [(VENDOR_ALONE, vendor_plan(c.canonical or c.graph))])
    if c.measure and c.per_shard:
        ctx.warnings.append(f"fidelity compared with the vendor alone shard by shard (its build of the whole model "
                            f"is not made here: {c.why}; --vendor-alone whole makes it), which keeps every cut")
    if c.baseline:
        link_builds(c.staging / "shards", c.vendor_dir / "shards", [b for b, _ in c.baseline], c.tgt.artifact_suffix)
    c.writer = BundleWriter(target=c.target, tgt=c.tgt, profile=c.profile, build=c.build, ctx=ctx, graph=c.graph,
                            source=c.source, options=c.options, logs=c.logs, builds=c.builds, choices=c.choices,
                            edge_shapes={job.name: shapes for job, shapes in c.relaid}, started=c.started,
                            seconds=dict(c.seconds), versus=c.versus, jobs={job.name: job for job in c.jobs})
    kept = {name for name, _ in c.chosen}
    undone = {node for choice in c.choices for node in choice["dropped_nodes"]}
    confirm_tiles_in_logs(c.tgt, ctx.reports, [job for job in c.jobs if job.name in kept], undone)
    c.manifest, c.report = c.writer.write(c.staging, c.chosen, host_pre, host_post)


def check_fidelity(c: Compilation) -> None:
    """On the simulator, the bundle beside the vendor alone's on the same inputs: the more faithful is
    kept (a quantized bundle that loses the model's accuracy gets a warning); where nothing stands
    beside it (the vendor alone did not build, or the bundle is its build), the bundle alone. Then
    the floor (hold_the_floor)."""
    if not c.measure or not c.tgt.vendor or c.options.vendor_only:
        return
    samples = c.samples or fidelity_samples(c.ctx, c.canonical or c.graph, c.quantized)
    if c.baseline:
        steps = host_steps(c.ctx, c.baseline, c.builds, None) if c.per_shard else ([], [])
        c.writer.write(c.vendor_dir, c.baseline, *steps)
    started = time.monotonic()
    runs = c.chains.runs if c.chains else Runs(c.cache, f"{c.target} {c.tgt.toolchain()}")
    with c.builder.simulator() as simulator:
        worst = composed_worst([c.staging, *([c.vendor_dir] if c.baseline else [])], c.model, samples, simulator,
                               c.progress, runs)
    seconds = round(time.monotonic() - started, 2)
    if c.baseline:
        c.manifest, c.report, c.kept = keep_the_more_faithful(
            c.staging, c.vendor_dir, c.versus, *worst,
            spent_for_fidelity=bool(c.in_range) or c.options.precision == "mixed")
    else:
        c.kept = worst[0]
        if c.versus is not None:   # the other side was not run: it did not build, or it is this bundle
            c.versus["fidelity"] = {"shard": None, "vendor": None,
                                    "shard" if c.versus["bundle"] == "shard" else "vendor": c.kept.cosine}
            c.report["versus_vendor"] = c.versus
        else:
            c.report["fidelity"] = {"bundle": c.kept.cosine}
    c.report["seconds"]["fidelity"] = seconds
    c.report["fidelity_builds"] = runs.built_again   # simulator builds of its own: the rest ran where built
    if c.quantized and not c.kept.cosine >= LOW_FIDELITY:
        c.report["warnings"].append(
            f"{c.options.precision} loses this model's accuracy: simulator cosine {c.kept.cosine:.4f} on "
            f"{min(len(c.ctx.samples), FIDELITY_SAMPLES)} calibration samples; "
            f"check it with `shard verify --inputs`, or compile in fp16")
    hold_the_floor(c, samples)
    c.report["seconds"]["total"] = round(time.monotonic() - c.started, 2)
    (c.staging / "report.json").write_text(json.dumps(c.report, indent=2) + "\n")


def hold_the_floor(c: Compilation, samples: list[dict]) -> None:
    """A bundle whose outputs overflow on the fidelity samples (a NaN or an Inf where onnxruntime's fp32
    has none) or, in fp16, fall under --min-cosine is not written: the compile stops in one line that
    names the first shard output to overflow when fed onnxruntime's tensors. --allow-low-fidelity
    writes it, saying so. Mixed precision's rounds are judged by compile_mixed (its floor is its fp16)."""
    kept, options = c.kept, c.options
    if options.precision == "mixed" or not (kept.overflowed or options.precision == "fp16" and kept.reference_finite
                                             and not kept.cosine >= options.min_cosine):
        return
    what = (f"its output {kept.name} holds a NaN or an Inf on the simulator where onnxruntime's fp32 holds none"
            if kept.overflowed else f"its output {kept.name} reaches cosine {kept.cosine:.6f} against onnxruntime's "
                                    f"fp32 on the simulator, under --min-cosine {options.min_cosine}")
    fidelity = (c.versus or {}).get("fidelity", {})
    tried = ("; the vendor alone's build does no better" if fidelity.get("vendor") is not None
             and fidelity.get("shard") is not None else "")
    c.progress("fidelity floor: the first output to overflow", 0, 1)
    first = first_overflow(c.staging, c.model, samples[:1])
    where = f"; the first to overflow, fed onnxruntime's tensors: {first}" if first else ""
    unfixed = passed(c.ctx.reports, "scale_sandwich").not_fixed
    why = f"; scale_sandwich: {unfixed[0].node} ({unfixed[0].op}): {unfixed[0].reason}" if unfixed else ""
    line = f"the bundle is under the fidelity floor: {what}{tried}{where}{why}"
    if not options.allow_low_fidelity:
        raise CompileError(f"{line}; nothing written (--allow-low-fidelity writes it anyway)")
    c.report["warnings"].append(f"{line}; written anyway (--allow-low-fidelity)")
    c.report["under_the_floor"] = True


def run_passes(graph: gs.Graph, tgt, profile, options: CompileOptions, progress: Progress = lambda *a: None,
               until: str | None = None, snapshot: tuple[str, ...] = ()) -> tuple[gs.Graph, PassContext]:
    """The pass pipeline (up to `until`); where the target has a toolkit, the passes ask it about
    single ops and small regions (cached builds), and its workers stop when the passes end."""
    ops = None
    try:
        ops = tgt.pass_toolkit(profile, options)
        ctx = PassContext(profile=profile, options=options, ops=ops, shards_for_memory=tgt.shards_for_memory,
                          replica=tgt.replica_runner,
                          legality=Legality(profile, ops and OneOpBuilds(ops)) if profile.limits else None)
        graph = run_pipeline(graph, ctx, options.disable, on_pass=lambda name: progress(f"passes: {name}", 0, 1),
                             dump_after=options.dump_after, until=until, snapshot=snapshot, pipeline=tgt.pipeline)
    except BaseException:
        if ops is not None:   # interrupted or failed: the workers go at once, not after their build
            ops.close(kill=True)
        raise
    if ops is not None:
        ops.close()
    return graph, ctx


def mixed_ranking(graph, feeds: list[dict[str, np.ndarray]], progress: Progress) -> dict:
    """The replica's ranking of a compiled graph's int8 linears (shard.precision.rank_linears)."""
    progress("mixed precision: each linear's loss in int8", 0, 1)
    ranked, every = rank_linears(graph, feeds)
    progress("mixed precision: each linear's loss in int8", 1, 1)
    return {"linears": [asdict(c) for c in ranked], "replica_cosine": every}
