"""Which build each shard keeps, and the whole beside the vendor alone: never worse on the measured axes
(never_worse.py), and on the simulator's fidelity."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import networkx as nx
import numpy as np
import onnx_graphsurgeon as gs

from shard.bundle import Manifest, read_manifest
from shard.calibration import calibration_samples, domain_samples
from shard.compare import Comparison, worst_of
from shard.compilation.names import FIDELITY_SAMPLES, RELAID, SHARD_BY_SHARD, UNREWRITTEN, VENDOR_ALONE
from shard.errors import CompileError
from shard.graph import tensor_spec
from shard.macs import estimate_macs
from shard.never_worse import (AXES, HARD_AXES, LABELS, Figures, comparison_line, fidelity_verdict, no_handoffs,
                               per_axis, prune_host_steps, verdict)
from shard.passes import PassContext
from shard.passes.context import ShardPlan
from shard.runtime import default_backend
from shard.targets import ShardBuild
from shard.verifier import verify_bundle


def keep_the_more_faithful(staging: Path, vendor_dir: Path, versus: dict, ours: Comparison, theirs: Comparison,
                           spent_for_fidelity: bool = False, labels: dict[str, str] = LABELS
                           ) -> tuple[Manifest, dict, Comparison]:
    """Shard's bundle (staging) and the vendor alone's (vendor_dir) by their worst outputs on the
    simulator on the same inputs (`ours`, `theirs`); where shard's worst cosine is lower, the vendor's
    becomes the staging bundle. The verdict counts the cosines first. `spent_for_fidelity`: shard was
    judged without the cycle axes, its cycles spent for fidelity (range rescales, mixed precision's fp16
    ops); where that bought nothing (both NaN), they count again. Returns the staging bundle's manifest
    and report, `versus` updated in both, and the kept bundle's worst output."""
    versus["fidelity"] = {"shard": ours.cosine, "vendor": theirs.cosine}
    said = fidelity_verdict(ours.cosine, theirs.cosine)
    versus["line"] = comparison_line(Figures(**versus["shard"]), Figures(**versus["vendor"]),
                                     f"shard / {versus['vendor_alone']}", (ours.cosine, theirs.cosine),
                                     labels) + versus.get("note", "")
    if said in ("better", "worse"):
        versus["verdict"] = said
    worse = said == "worse"
    if spent_for_fidelity and said == "both NaN":
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
    return read_manifest(staging), report, theirs if worse else ours


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


def bundle_worst(bundle: Path, model: Path, samples: list | None = None) -> Comparison:
    """The bundle's worst output against onnxruntime on its target's own runtime here (checked_on: a
    vendor target's simulator; the samples, or one seeded input); a NaN is the worst. The shards are
    not checked alone: nothing here reads it."""
    return worst_of(verify_bundle(bundle, model, backend=checked_on(bundle), samples=samples, shards=False).outputs)


def checked_on(bundle: Path) -> str:
    """The backend a compile checks a bundle on: its target's first (the vendor's simulator on a Rockchip
    chip: what runs the NPU's own numbers here)."""
    return default_backend(read_manifest(bundle))


def first_overflow(bundle: Path, model: Path, samples: list) -> str | None:
    """The first shard output (in the bundle's order) holding a NaN or an Inf on the simulator where
    onnxruntime's has none: each shard fed the reference's tensors, else end to end; None if none does."""
    report = verify_bundle(bundle, model, backend=checked_on(bundle), samples=samples)
    for alone, seen in ((True, report.shards), (False, report.chained)):
        for shard, comparisons in seen.items():
            for c in comparisons:
                if c.overflowed:
                    return f"{c.name}, an output of {shard}" + ("" if alone else " (end to end)")
    return None


def bundle_cosine_of(bundle: Path, model: Path, samples: list | None = None) -> float:
    """bundle_worst's cosine."""
    return bundle_worst(bundle, model, samples).cosine


def bundle_cosines(bundle: Path, model: Path, *groups: list[dict]) -> list[float]:
    """The worst output cosine of a bundle against onnxruntime on the simulator over each group of
    samples, all run in one simulator session (setting one up builds every shard for the simulator),
    the shards not checked alone. A NaN is the worst."""
    report = verify_bundle(bundle, model, backend=checked_on(bundle), samples=[s for group in groups for s in group],
                           shards=False)
    per_sample = [worst_of(comparisons) for comparisons in report.samples]
    bounds = np.cumsum([0, *map(len, groups)])
    return [worst_of(per_sample[a:b]).cosine for a, b in zip(bounds, bounds[1:])]


def bound_groups(plans: list, scaled: set[str]) -> list[list[int]]:
    """The shards (indices into `plans`, in order) that must keep the same version: those joined by an
    edge the rewritten graph holds divided by 2^k (`scaled`: scale_sandwich's range rescales), which
    the unrewritten twins make and read at full scale. Mixed, SmolLM2-135M's prefill step (its
    residual held divided by 2 from layer 11) came out at cosine 0.620 on the simulator."""
    joined = nx.Graph()
    joined.add_nodes_from(range(len(plans)))
    makers = {t.name: k for k, plan in enumerate(plans) for t in plan.outputs}
    joined.add_edges_from((k, makers[t.name]) for k, plan in enumerate(plans) for t in plan.inputs
                          if t.name in scaled and t.name in makers)
    return sorted(sorted(group) for group in nx.connected_components(joined))


def choose_versions(plans: list, originals: list, builds: dict[str, ShardBuild],
                    axes: tuple[str, ...] = AXES, in_range: set[str] = frozenset(),
                    best: dict[str, str] | None = None, scaled: set[str] = frozenset(),
                    labels: dict[str, str] = LABELS) -> tuple[list, list[dict]]:
    """[(build name, plan)] with each shard's better build, and why: a rewritten shard is kept unless
    its build is worse than its unrewritten twin's on the measured `axes`; shards bound by a scaled
    edge (bound_groups) are judged together, on their summed figures, and one without a twin keeps
    its group rewritten. A shard holding a node of `in_range` (scale_sandwich's range rescales) is
    judged without the cycle axes: its twin would leave fp16's range, which no build figure shows.
    `best`: {build: a better build of the same shard} (edges in the vendor's layout), which stands
    for it."""
    best = best or {}
    picked: dict[int, tuple] = {}
    choices: dict[int, dict] = {}
    for group in bound_groups(plans, scaled):
        ours = [best.get(plans[k].name, plans[k].name) for k in group]
        if any(originals[k] is None for k in group):
            picked.update({k: (name, plans[k]) for k, name in zip(group, ours)})
            continue
        twins = [best.get(f"{plans[k].name}{UNREWRITTEN}", f"{plans[k].name}{UNREWRITTEN}") for k in group]
        rewritten, unrewritten = Figures.of([builds[n] for n in ours]), Figures.of([builds[n] for n in twins])
        judged = HARD_AXES if in_range & {n.name for k in group for n in plans[k].nodes} else axes
        keep = verdict(rewritten, unrewritten, judged) != "worse"
        for k, name, twin in zip(group, ours, twins):
            others = ", ".join(plans[j].name for j in group if j != k)
            picked[k] = (name, plans[k]) if keep else (twin, originals[k])
            choices[k] = {"shard": plans[k].name, "kept": "rewritten" if keep else "unrewritten",
                          "what": f"kept the {'rewritten' if keep else 'unrewritten'} build"
                                  + (f", judged with {others} (an edge held scaled joins them)" if others else ""),
                          "rewritten": asdict(rewritten), "unrewritten": asdict(unrewritten),
                          "dropped_nodes": [] if keep else sorted(set(originals[k].source_nodes)),
                          "line": comparison_line(rewritten, unrewritten, "rewritten / unrewritten", labels=labels)}
    return [picked[k] for k in range(len(plans))], [choices[k] for k in sorted(choices)]


def against_vendor_alone(chosen: list, builds: dict[str, ShardBuild], axes: tuple[str, ...], vendor_only: bool,
                         canonical: gs.Graph, handoffs: Callable[[list], int] = no_handoffs,
                         labels: dict[str, str] = LABELS) -> tuple[list, dict | None]:
    """The kept shards beside the vendor alone's build of the model as it came: where shard is
    worse and the vendor's build is usable (or --vendor-only), the bundle becomes the vendor's build.
    `handoffs`: the cycles a list of plans hands off on the board (never_worse.handoff_cycles), in
    each side's cost. Returns the shards to bundle and the comparison for the report (None without a
    vendor build)."""
    vendor = builds.get(VENDOR_ALONE)
    if vendor is None:
        return chosen, None
    if vendor_only and vendor.error:
        raise CompileError(vendor.error)
    whole = vendor_plan(canonical)
    ours = Figures.of([builds[name] for name, _ in chosen]).with_handoffs(handoffs([plan for _, plan in chosen]))
    theirs = Figures.of([vendor]).with_handoffs(handoffs([whole]))
    fall_back = vendor_only or (vendor.error is None and verdict(ours, theirs, axes) == "worse")
    versus = comparison(ours, theirs, axes, fall_back, "vendor alone", labels)
    if vendor_only:   # nothing of shard's was built: no side to stand beside it, no verdict to print
        versus["line"] = "vendor alone (--vendor-only, no comparison made): " + ", ".join(
            f"{labels[a]} {theirs.show(a)}" for a in AXES)
    return ([(VENDOR_ALONE, whole)] if fall_back else chosen), versus


def against_unrewritten(chosen: list, plans: list, originals: list, builds: dict[str, ShardBuild],
                        axes: tuple[str, ...], handoffs: Callable[[list], int] = no_handoffs,
                        labels: dict[str, str] = LABELS) -> tuple[list, dict]:
    """The kept shards beside the vendor alone shard by shard, where the whole model's build is not
    made: each shard built without its rewrites (its twin where the passes changed it, else its own
    build), which is also the bundle where shard is worse."""
    unrewritten = unrewritten_versions(plans, originals)
    ours, theirs = (Figures.of([builds[name] for name, _ in kept]).with_handoffs(handoffs([p for _, p in kept]))
                    for kept in (chosen, unrewritten))
    fall_back = verdict(ours, theirs, axes) == "worse"
    versus = comparison(ours, theirs, axes, fall_back, SHARD_BY_SHARD, labels)
    return (unrewritten if fall_back else chosen), versus


def fidelity_baseline(versus: dict | None, builds: dict[str, ShardBuild], chosen: list, vendor: list) -> list | None:
    """The vendor alone's (build, plan) list that shard's bundle is checked against on the simulator:
    `vendor` (its whole build, or each shard without its rewrites), where it built and differs from
    the bundle; else None."""
    if not versus or versus["bundle"] != "shard" or any(name not in builds for name, _ in vendor):
        return None
    usable = Figures.of([builds[name] for name, _ in vendor])
    if not usable.builds or usable.overflow_lines:   # nothing to run: shard is better by construction
        return None
    return None if [b for b, _ in vendor] == [b for b, _ in chosen] else vendor


def unrewritten_versions(plans: list, originals: list) -> list:
    """(build, plan) of each shard as the vendor alone would take its region: its twin where the
    passes changed it, else its own build."""
    return [(f"{plan.name}{UNREWRITTEN}", original) if original is not None else (plan.name, plan)
            for plan, original in zip(plans, originals)]


def fidelity_samples(ctx: PassContext, graph: gs.Graph, quantized: bool) -> list[dict[str, np.ndarray]]:
    """What shard's bundle and the vendor alone's are compared on: the first calibration samples where
    the user gave them (or the compile quantizes from them), else seeded inputs of the model's own
    domain (shard.calibration.domain_samples: token ids from its vocabulary, masks of ones)."""
    inputs = ctx.model_inputs or [tensor_spec(t) for t in graph.inputs]
    if quantized or ctx.options.calib:
        return calibration_samples(ctx, inputs)[:FIDELITY_SAMPLES]
    return domain_samples(graph, inputs, FIDELITY_SAMPLES)


def comparison(ours: Figures, theirs: Figures, axes: tuple[str, ...], fall_back: bool, vendor: str,
               labels: dict[str, str] = LABELS) -> dict:
    """versus_vendor of the report: shard's figures (the vendor's where the bundle fell back to its
    builds) beside the vendor alone's (`vendor`: how it was built), the verdict and the printed line."""
    bundled = theirs if fall_back else ours
    note = "" if axes == AXES else (f"; judged on {', '.join(labels[a] for a in axes)} only (cycles spent by "
                                    "choice: forced tiles, fp16 ops of mixed precision, range rescales)")
    return {"shard": asdict(bundled), "vendor": asdict(theirs), "axes": per_axis(bundled, theirs), "judged_on": list(axes),
            "verdict": verdict(bundled, theirs), "line": comparison_line(ours, theirs, f"shard / {vendor}", labels=labels) + note,
            "note": note, "vendor_alone": vendor,
            "bundle": vendor if fall_back else "shard", "rewritten": asdict(ours) if fall_back else None}


def vendor_plan(graph: gs.Graph) -> ShardPlan:
    """The whole model as one shard: the bundle of the vendor alone (its build is VENDOR_ALONE's)."""
    return ShardPlan(name=VENDOR_ALONE, nodes=list(graph.nodes), inputs=list(graph.inputs),
                     outputs=list(graph.outputs), macs=sum(estimate_macs(n) for n in graph.nodes),
                     source_nodes=[n.name for n in graph.nodes])


def keep_better_edges(relaid: list, builds: dict[str, ShardBuild], axes: tuple[str, ...],
                      labels: dict[str, str] = LABELS) -> tuple[dict[str, str], list[dict]]:
    """{build: its relaid build} where the relaid one is better on the measured axes, and why."""
    better, choices = {}, []
    for job, _ in relaid:
        first = job.name[: -len(RELAID)]
        ours, theirs = Figures.of([builds[job.name]]), Figures.of([builds[first]])
        keep = verdict(ours, theirs, axes) == "better"
        if keep:
            better[first] = job.name
        choices.append({"shard": first.removesuffix(UNREWRITTEN), "build": first, "relaid": job.name,
                        "kept": "relaid edges" if keep else "edges as they were",
                        "what": "kept the build with its edges in the vendor's 4-D layout" if keep
                        else "kept its edges as they were", "dropped_nodes": [],
                        "line": comparison_line(ours, theirs, "edges relaid / as they were", labels=labels)})
    return better, choices
