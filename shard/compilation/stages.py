"""compile_one: one bundle of one precision at fixed input shapes, as a short list of named stages, each
a function below it, in order, that takes the records of the stages before it and hands on its own
(shard.compilation.state); and run_passes, which inspect shares."""

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
from shard.compilation.state import (BuildQueue, Built, Chosen, CompileResult, Loaded, Rewritten, Setup, Standing,
                                     VendorAlone, Written)
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
from shard.targets import ShardBuild
from shard.targets.build_cache import structure_key
from shard.targets.chips import board_handoff
from shard.targets.registry import get_target


def compile_one(model: Path, target: str, output: Path, options: CompileOptions,
                progress: Progress) -> CompileResult:
    """One bundle of one precision at fixed input shapes: the stages, in order, each handing its record on."""
    s = start(model, target, output, options, progress)   # the target, its profile, the staging bundle
    with staged(s):                    # a failure leaves nothing at the output, and only the logs it names
        loaded = load(s)               # the model, and how the vendor alone will stand beside it
        with s.tgt.builds(options.jobs, options.timeout, loaded.cache, s.logs, options.ray) as builder:
            queue = BuildQueue(builder, progress)
            vendor = start_vendor_alone(s, loaded, queue)   # its build runs through the passes (or figures stand in)
            rewritten = rewrite(s, loaded, queue)           # the target's passes: the graph rewritten and partitioned
            built = build_shards(s, loaded, vendor, rewritten, queue)   # each shard built once written, and its twin
            chosen = choose(s, loaded, rewritten, built, queue)   # each shard's better build (rewritten or not, ...)
            standing = stand_beside_vendor(s, loaded, vendor, rewritten, built, chosen, queue)   # vendor's where worse
            written = write_bundle(s, loaded, rewritten, built, chosen, standing, queue)   # host steps, files, report
            written = check_fidelity(s, loaded, rewritten, built, chosen, standing, written, queue)   # on the simulator
        progress("write the bundle", 1, 1)
        replace_dir(s.staging, output)   # the last step: a stop a finalizer swallowed stops here, leaving nothing
    return CompileResult(bundle=output, manifest=written.manifest, report=written.report, rank=rewritten.rank)


def start(model: Path, target: str, output: Path, options: CompileOptions, progress: Progress) -> Setup:
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
    return Setup(model=model, target=target, tgt=tgt, output=output, options=options, progress=progress,
                 profile=profile, staging=staging, logs=logs, started=started, quantized=options.precision in QUANTIZED)


@contextmanager
def staged(s: Setup) -> Iterator[None]:
    """Whatever ends the compile, its temporary files go: on failure the staging bundles too, and the
    logs unless the message names them (a build that failed)."""
    try:
        yield
    except BaseException as exc:
        shutil.rmtree(s.staging, ignore_errors=True)
        shutil.rmtree(s.vendor_dir, ignore_errors=True)
        (scratch.keep if str(s.logs) in str(exc) else scratch.remove)(s.logs)
        raise
    else:
        scratch.remove(s.logs)
    finally:
        for folder in s.temporary:
            scratch.remove(folder)


def load(s: Setup) -> Loaded:
    """The model, its hash, the build options, and whether the vendor alone's build of the whole model
    is made (--vendor-alone, and whether it fits in memory) or it stands beside shard by shard."""
    options = s.options
    s.progress("load", 0, 1)
    proto = load_model(s.model)
    against_vendor = s.tgt.vendor and (options.vendor_baseline or options.vendor_only)
    # --check-fidelity asks for the whole model's check: the vendor alone built whole, unless told otherwise.
    how = "whole" if options.vendor_only or options.check_fidelity and options.vendor_alone == "auto" \
        else options.vendor_alone
    whole, why = whole_build_fits(proto, how, s.tgt, jobs=options.jobs, quantized=s.quantized) \
        if against_vendor else (False, "")
    cache = default_cache_dir() if options.build_cache else None
    checked = against_vendor if options.check_fidelity is None else options.check_fidelity
    chains = None
    if checked and s.tgt.vendor and not options.vendor_only:   # its runs made where each shard builds
        chains = Chains(Runs(cache, f"{s.target} {s.tgt.toolchain()}"))
    return Loaded(proto=proto, source={"name": s.model.name, "sha256": sha256_file(s.model)},
                  build=s.tgt.build_options(options), cache=cache, whole=against_vendor and whole,
                  per_shard=against_vendor and not whole, why=why, chains=chains)


def start_vendor_alone(s: Setup, ld: Loaded, queue: BuildQueue) -> VendorAlone:
    """The vendor alone's build of the model as it came, started before the passes (the longest build
    runs through them); in fp16, built before with other weights, those figures stand in, and the
    build is made only if its artifact is needed (the fidelity check, or a bundle falling back to it)."""
    vendor = VendorAlone()
    if not ld.whole:
        return vendor
    fix_input_shapes(ld.proto, s.options.input_shapes)
    vendor.inputs = data_inputs(ld.proto.graph)
    vendor.runs = ld.chains.whole(ld.proto.graph) if ld.chains else None
    if not s.quantized:
        vendor.job = vendor_alone_job(s.staging, s.logs, s.tgt, vendor.inputs)
        vendor.job.figures_key = structure_key(ld.proto)
        vendor.job.runs = vendor.runs
        if not (s.options.vendor_only or s.options.check_fidelity):
            vendor.stand_in = queue.builder.figures(vendor.job, ld.build)
    if not vendor.stand_in:   # written now, so its weights are not held twice through the passes
        write_vendor_alone(ld.proto, s.staging)
    if vendor.job and not vendor.stand_in:
        vendor.early = queue.builder.submit([vendor.job], ld.build, queue.done.append)
    return vendor


def rewrite(s: Setup, ld: Loaded, queue: BuildQueue) -> Rewritten:
    """The target's passes; the canonical graph is kept so each rewritten shard can also be built as
    the vendor would take it (its twin); quantized, every shard input's value on each sample."""
    fix_input_values(ld.proto, s.options.input_values)   # after the vendor alone took the model as it came
    proto, prepared = prepare_model(ld.proto, s.tgt.min_opset)
    ld.proto = None
    opset = default_opset(proto)   # the shards' (a pass may need a newer one: w4a16_linears)
    graph = own_values(gs.import_onnx(proto))
    del proto
    graph, ctx = run_passes(graph, s.tgt, s.profile, s.options, s.progress,
                            snapshot=("canonicalize",) if s.tgt.vendor else (),
                            until="slow_paths" if s.options.vendor_only else None)
    ctx.reports["canonicalize"]["prepared"] = prepared
    plans = ctx.plan or []
    queue.builder.at_once(cut_of(ctx.reports).builds_at_once or s.options.jobs)
    canonical = ctx.snapshots.pop("canonicalize", None)
    originals = original_plans(canonical, plans, ctx.host_post) if canonical is not None else [None] * len(plans)
    values, feeds = quantization_values(ctx, graph, canonical, plans, originals, s.progress) if s.quantized \
        else (None, None)
    samples = fidelity_samples(ctx, canonical or graph, s.quantized) if ld.chains else []
    if ld.chains:
        ld.chains.start(samples, ctx.host_pre, ctx.host_tables)
    rank, progress = None, s.progress
    if s.options.precision == "mixed":
        ctx.reports["mixed"] = {"promoted": sorted(s.options.promote)}
        rank = lambda: mixed_ranking(graph, feeds, progress)   # noqa: E731 - for compile_mixed, if it needs one
    return Rewritten(graph=graph, ctx=ctx, opset=max(opset, graph.opset), plans=plans, canonical=canonical, originals=originals,
                     passes_seconds=time.monotonic() - s.started, samples=samples, values=values, feeds=feeds,
                     rank=rank)


def build_shards(s: Setup, ld: Loaded, vendor: VendorAlone, rw: Rewritten, queue: BuildQueue) -> Built:
    """Write the shards and build each as soon as it is written (the vendor alone too, quantized from
    the samples the passes took). The workers load the toolkit while the first shard is written: not
    earlier, where they would hold memory beside the passes' peak and share its cores."""
    queue.builder.start()
    datasets = None
    if s.quantized:
        datasets = Datasets(scratch.folder("calib"), rw.values, s.options.precision, set(s.options.promote or ()))
        s.temporary.append(datasets.root)
    if ld.whole and s.quantized:
        vendor.job = vendor_alone_job(s.staging, s.logs, s.tgt, vendor.inputs, datasets)
        vendor.job.runs = vendor.runs
    build = ld.build
    if rw.ctx.build_config and "config" in build:   # the passes' toolkit config is the shards' only
        build = {**build, "config": {**build["config"], **rw.ctx.build_config}}
    queue.jobs[:] = [vendor.job] if vendor.job and not vendor.stand_in else []
    under_way = [*vendor.early, *queue.submit(queue.jobs[len(vendor.early):], ld.build, "compile shards")]
    # Each shard's weights go once no shard still to be written reads them; mixed ranks its linears
    # on the graph after the build and keeps them.
    held = () if s.options.precision == "mixed" else tuple(g for g in (rw.graph, rw.canonical) if g is not None)
    runs = ld.chains.shards(rw.plans, rw.originals, ld.per_shard) if ld.chains else {}
    for job in write_jobs(s.staging, s.logs, s.tgt, rw.plans, rw.originals, rw.opset, s.progress, datasets, held):
        job.runs = runs.get(job.name)
        queue.jobs.append(job)
        under_way += queue.submit([job], build, "compile shards")
    builds = queue.wait([], "compile shards", build, under_way)
    if vendor.stand_in:
        builds[VENDOR_ALONE] = vendor.stand_in
    seconds = {"passes": rw.passes_seconds, "build": time.monotonic() - s.started - rw.passes_seconds}
    return Built(builds=builds, build=build, datasets=datasets, seconds=seconds)


def choose(s: Setup, ld: Loaded, rw: Rewritten, built: Built, queue: BuildQueue) -> Chosen:
    """Each shard's better build: rewritten or its unrewritten twin, each with its edges as they were
    or in the vendor's layout, whichever is better on the measured axes. Forced tiles and mixed
    precision's fp16 ops cost cycles by choice (cores, fidelity), so cycles are not judged there."""
    axes = HARD_AXES if s.options.tile_attention == "force" or s.options.precision == "mixed" else AXES
    stop_where_both_fail(ld, rw, built.builds)
    in_range = {ch.node for ch in passed(rw.ctx.reports, "scale_sandwich").changes if ch.form == "range"}
    versions = [(plan.name, plan) for plan in rw.plans] + [
        (f"{plan.name}{UNREWRITTEN}", original) for plan, original in zip(rw.plans, rw.originals)
        if original is not None]
    relaid = relayout_jobs(s.staging, s.logs, s.tgt, versions, built.datasets)
    best, edge_choices = {}, []
    if relaid:
        queue.jobs += [job for job, _ in relaid]
        built.builds.update(queue.wait([job for job, _ in relaid], "compile shards (edges in the vendor's layout)",
                                       built.build))
        best, edge_choices = keep_better_edges(relaid, built.builds, axes, s.labels)
    scaled = {name for name, (_, k) in rw.ctx.scales.items() if k}
    own, choices = choose_versions(rw.plans, rw.originals, built.builds, axes, in_range, best, scaled, s.labels)
    kept = {name for name, _ in own}
    choices += [ch for ch in edge_choices if ch["build"] in kept or ch["relaid"] in kept]
    return Chosen(axes=axes, in_range=in_range, relaid=relaid, own=own, choices=choices)


def stop_where_both_fail(ld: Loaded, rw: Rewritten, builds: dict[str, ShardBuild]) -> None:
    """A shard whose build and unrewritten twin are unusable where the vendor alone's is too (its whole
    build, or that twin shard by shard): nothing shard can keep builds, so the compile stops now, in
    one line naming both, rather than building the shards' edges in the vendor's layout first (a
    902-node model took 9 minutes to say it failed, in a message naming only an internal variant)."""
    vendor = builds.get(VENDOR_ALONE)
    if ld.whole and (vendor is None or not vendor.error):
        return
    for plan in rw.plans:
        ours, twin = builds[plan.name], builds.get(f"{plan.name}{UNREWRITTEN}")
        if not ours.error or twin is not None and not twin.error:
            continue
        if ld.whole:
            theirs = f"the vendor alone's build of the whole model is unusable too: {vendor.error}"
        elif twin is not None:
            theirs = f"the vendor alone's build of it (the shard as it came) is unusable too: {twin.error}"
        else:
            theirs = "the passes did not change it: the vendor alone's build of it is this one"
        raise CompileError(f"both fail: shard's build of {plan.name} is unusable ({ours.error}); {theirs}; "
                           f"nothing written")


def stand_beside_vendor(s: Setup, ld: Loaded, vendor: VendorAlone, rw: Rewritten, built: Built, ch: Chosen,
                        queue: BuildQueue) -> Standing:
    """The kept shards beside the vendor alone (its whole build, or shard by shard): its build is the
    bundle where shard is worse. Range rescales exist because the model as it came leaves fp16's
    range: the simulator judges that (fidelity, on by default then), not the cycles they cost."""
    judged = HARD_AXES if ch.in_range else ch.axes
    handoffs = board_handoffs(s)
    if ld.per_shard:
        chosen, versus = against_unrewritten(ch.own, rw.plans, rw.originals, built.builds, judged, handoffs, s.labels)
    else:
        chosen, versus = against_vendor_alone(ch.own, built.builds, judged, s.options.vendor_only, rw.reference,
                                              handoffs, s.labels)
    # Fidelity is part of never worse: a rewrite or a cut can lose what the vendor's build keeps
    # (a trained decoder cut inside its RMSNorm: cosine 0.038 against the vendor's 0.99999).
    measure = bool(versus) if s.options.check_fidelity is None else s.options.check_fidelity
    if vendor.stand_in and (measure or versus["bundle"] == "vendor alone"):   # its artifact is needed now
        as_it_came = load_model(s.model)
        fix_input_shapes(as_it_came, s.options.input_shapes)
        write_vendor_alone(as_it_came, s.staging, keep=False)
        del as_it_came
        queue.jobs.insert(0, vendor.job)
        built.builds.update(queue.wait([vendor.job], "compile the model as it came (vendor alone)", ld.build))
        chosen, versus = against_vendor_alone(ch.own, built.builds, judged, s.options.vendor_only, rw.reference,
                                              handoffs, s.labels)
    if versus:   # the comparison kept: made again where the vendor alone was built after its figures
        versus["why"] = ld.why
    return Standing(chosen=chosen, versus=versus, measure=measure)


def board_handoffs(s: Setup) -> Callable[[list], int]:
    """What a list of plans hands off on the target's board, in NPU cycles (never_worse.handoff_cycles),
    for the comparison with the vendor alone; nothing where --shards fixed the cut: its hand-offs are
    the user's choice (a stream spread over the cores), as forced tiles' cycles are."""
    if s.options.shards:
        return no_handoffs
    return partial(handoff_cycles, handoff=board_handoff(s.target, s.profile.facts),
                   clock_hz=s.profile.facts.get("npu_clock_hz"))


def write_bundle(s: Setup, ld: Loaded, rw: Rewritten, built: Built, ch: Chosen, st: Standing,
                 queue: BuildQueue) -> Written:
    """The host steps, the chosen builds' files, the manifest and the report; where fidelity is
    checked, the vendor alone's builds set aside first (the writer drops the other builds' files)."""
    ctx = rw.ctx
    host_pre, host_post = host_steps(ctx, st.chosen, built.builds, st.versus)
    baseline = None
    if st.measure:
        baseline = fidelity_baseline(st.versus, built.builds, st.chosen, unrewritten_versions(rw.plans, rw.originals)
                                     if ld.per_shard else [(VENDOR_ALONE, vendor_plan(rw.reference))])
    if st.measure and ld.per_shard:
        ctx.warnings.append(f"fidelity compared with the vendor alone shard by shard (its build of the whole model "
                            f"is not made here: {ld.why}; --vendor-alone whole makes it), which keeps every cut")
    if baseline:
        link_builds(s.staging / "shards", s.vendor_dir / "shards", [b for b, _ in baseline], s.tgt.artifact_suffix)
    writer = BundleWriter(target=s.target, tgt=s.tgt, profile=s.profile, build=built.build, ctx=ctx, graph=rw.graph,
                          source=ld.source, options=s.options, logs=s.logs, builds=built.builds, choices=ch.choices,
                          edge_shapes={job.name: shapes for job, shapes in ch.relaid}, started=s.started,
                          seconds=dict(built.seconds), versus=st.versus, jobs={job.name: job for job in queue.jobs})
    kept = {name for name, _ in st.chosen}
    undone = {node for choice in ch.choices for node in choice["dropped_nodes"]}
    confirm_tiles_in_logs(s.tgt, ctx.reports, [job for job in queue.jobs if job.name in kept], undone)
    manifest, report = writer.write(s.staging, st.chosen, host_pre, host_post)
    return Written(writer=writer, baseline=baseline, manifest=manifest, report=report)


def check_fidelity(s: Setup, ld: Loaded, rw: Rewritten, built: Built, ch: Chosen, st: Standing, written: Written,
                   queue: BuildQueue) -> Written:
    """On the simulator, the bundle beside the vendor alone's on the same inputs: the more faithful is
    kept (a quantized bundle that loses the model's accuracy gets a warning); where nothing stands
    beside it (the vendor alone did not build, or the bundle is its build), the bundle alone. Then
    the floor (hold_the_floor)."""
    if not st.measure or not s.tgt.vendor or s.options.vendor_only:
        return written
    samples = rw.samples or fidelity_samples(rw.ctx, rw.reference, s.quantized)
    if written.baseline:
        steps = host_steps(rw.ctx, written.baseline, built.builds, None) if ld.per_shard else ([], [])
        written.writer.write(s.vendor_dir, written.baseline, *steps)
    started = time.monotonic()
    runs = ld.chains.runs if ld.chains else Runs(ld.cache, f"{s.target} {s.tgt.toolchain()}")
    with queue.builder.simulator() as simulator:
        worst = composed_worst([s.staging, *([s.vendor_dir] if written.baseline else [])], s.model, samples, simulator,
                               s.progress, runs)
    seconds = round(time.monotonic() - started, 2)
    manifest, report = written.manifest, written.report
    if written.baseline:
        manifest, report, kept = keep_the_more_faithful(
            s.staging, s.vendor_dir, st.versus, *worst,
            spent_for_fidelity=bool(ch.in_range) or s.options.precision == "mixed", labels=s.labels)
    else:
        kept = worst[0]
        if st.versus is not None:   # the other side was not run: it did not build, or it is this bundle
            st.versus["fidelity"] = {"shard": None, "vendor": None,
                                     "shard" if st.versus["bundle"] == "shard" else "vendor": kept.cosine}
            report["versus_vendor"] = st.versus
        else:
            report["fidelity"] = {"bundle": kept.cosine}
    report["seconds"]["fidelity"] = seconds
    report["fidelity_builds"] = runs.built_again   # simulator builds of its own: the rest ran where built
    if s.quantized and not kept.cosine >= LOW_FIDELITY:
        report["warnings"].append(
            f"{s.options.precision} loses this model's accuracy: simulator cosine {kept.cosine:.4f} on "
            f"{min(len(rw.ctx.samples), FIDELITY_SAMPLES)} calibration samples; "
            f"check it with `shard verify --inputs`, or compile in fp16")
    written = Written(writer=written.writer, baseline=written.baseline, manifest=manifest, report=report, kept=kept)
    hold_the_floor(s, rw, st.versus, written, samples)
    report["seconds"]["total"] = round(time.monotonic() - s.started, 2)
    (s.staging / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return written


def hold_the_floor(s: Setup, rw: Rewritten, versus: dict | None, written: Written, samples: list[dict]) -> None:
    """A bundle whose outputs overflow on the fidelity samples (a NaN or an Inf where onnxruntime's fp32
    has none) or, in fp16, fall under --min-cosine is not written: the compile stops in one line that
    names the first shard output to overflow when fed onnxruntime's tensors. --allow-low-fidelity
    writes it, saying so. Mixed precision's rounds are judged by compile_mixed (its floor is its fp16)."""
    kept, options = written.kept, s.options
    if options.precision == "mixed" or not (kept.overflowed or options.precision == "fp16" and kept.reference_finite
                                             and not kept.cosine >= options.min_cosine):
        return
    what = (f"its output {kept.name} holds a NaN or an Inf on the simulator where onnxruntime's fp32 holds none"
            if kept.overflowed else f"its output {kept.name} reaches cosine {kept.cosine:.6f} against onnxruntime's "
                                    f"fp32 on the simulator, under --min-cosine {options.min_cosine}")
    fidelity = (versus or {}).get("fidelity", {})
    tried = ("; the vendor alone's build does no better" if fidelity.get("vendor") is not None
             and fidelity.get("shard") is not None else "")
    s.progress("fidelity floor: the first output to overflow", 0, 1)
    first = first_overflow(s.staging, s.model, samples[:1])
    where = f"; the first to overflow, fed onnxruntime's tensors: {first}" if first else ""
    unfixed = passed(rw.ctx.reports, "scale_sandwich").not_fixed
    why = f"; scale_sandwich: {unfixed[0].node} ({unfixed[0].op}): {unfixed[0].reason}" if unfixed else ""
    line = f"the bundle is under the fidelity floor: {what}{tried}{where}{why}"
    if not options.allow_low_fidelity:
        raise CompileError(f"{line}; nothing written (--allow-low-fidelity writes it anyway)")
    written.report["warnings"].append(f"{line}; written anyway (--allow-low-fidelity)")
    written.report["under_the_floor"] = True


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
