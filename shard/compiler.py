"""compile_model: ONNX in, bundle out. The stages, in order, are in this one function."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import onnx_graphsurgeon as gs

from shard import __version__
from shard.bundle import MANIFEST, Manifest, ShardSpec
from shard.errors import ShardError
from shard.graph import default_opset, load_model, quiet_graphsurgeon, sha256_file, tensor_spec, to_toolkit_model
from shard.passes import PassContext, run_pipeline
from shard.passes.fit import Legality
from shard.profile import load_profile
from shard.targets import ShardBuild, ShardJob, get_target

Progress = Callable[[str, int, int], None]  # (step, done, total)


@dataclass
class CompileOptions:
    """The user's choices (hardware facts live in the profile)."""

    input_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    shards: int | None = None       # default: one per NPU core
    max_ops: int | None = None      # more shards if any would hold more ops than this
    jobs: int = 2                   # vendor builds in parallel
    timeout: float = 1800.0         # seconds one vendor build may take
    profile: str | None = None      # a profile file instead of the shipped one
    disable: tuple[str, ...] = ()   # optional passes to skip
    tile_attention: str = "auto"    # auto (only where a limit requires it), off, force
    fusion_barrier: str = "check"   # check, rules (with disable_rules), pill
    disable_rules: tuple[str, ...] = ()   # toolkit fusion rules to switch off (--fusion-barrier rules)
    dump_after: dict[str, str] = field(default_factory=dict)   # {pass: directory} for the graph after it


@dataclass
class CompileResult:
    bundle: Path
    manifest: Manifest
    report: dict


def default_output(model: Path) -> Path:
    return model.with_suffix(".shard")


def compile_model(model: str | Path, target: str = "rk3588", output: str | Path | None = None,
                  options: CompileOptions | None = None, progress: Progress = lambda *a: None) -> CompileResult:
    """Compile an ONNX model into a bundle directory; on failure nothing is left at `output`."""
    options = options or CompileOptions()
    check_options(options)
    model = Path(model)
    output = Path(output) if output else default_output(model)
    tgt = get_target(target)
    check_output_path(output)
    tgt.check_environment()               # a missing toolkit fails before minutes of work
    profile = load_profile(target, options.profile)
    quiet_graphsurgeon()
    t0 = time.monotonic()

    progress("load", 0, 1)
    proto = load_model(model)
    opset = default_opset(proto)
    source = {"name": model.name, "sha256": sha256_file(model)}
    graph = gs.import_onnx(proto)
    del proto

    # 1. Rewrite and partition (the pass order lives in shard.passes.PIPELINE).
    graph, ctx = run_passes(graph, tgt, profile, options, progress)
    plans = ctx.plan
    t_passes = time.monotonic() - t0

    # 2. Write the shards and compile them, in a scratch bundle next to the output (same filesystem,
    #    so the final rename is atomic); logs live outside it so a failure keeps them.
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
    logs = Path(tempfile.mkdtemp(prefix=f"shard-logs-{output.stem}-"))
    for folder in (staging, logs):
        folder.chmod(0o755)  # mkdtemp makes them private; a bundle is an ordinary directory
    try:
        (staging / "shards").mkdir()
        jobs = []
        for k, plan in enumerate(plans):
            progress("write shards", k, len(plans))
            sub = gs.Graph(nodes=plan.nodes, inputs=plan.inputs, outputs=plan.outputs, opset=opset,
                           name=plan.name)
            onnx_path = staging / "shards" / f"{plan.name}.onnx"
            save_onnx(to_toolkit_model(sub, opset), onnx_path)
            artifact = staging / "shards" / f"{plan.name}{tgt.artifact_suffix}" if tgt.artifact_suffix else None
            jobs.append(ShardJob(name=plan.name, onnx=onnx_path, artifact=artifact, log=logs / f"{plan.name}.log"))
        build = tgt.build_options(options)
        if ctx.build_config and "config" in build:
            build["config"] = {**build["config"], **ctx.build_config}
        done: list[ShardBuild] = []

        def on_done(result: ShardBuild) -> None:
            done.append(result)
            progress("compile shards", len(done), len(jobs))

        progress("compile shards", 0, len(jobs))
        builds = tgt.compile_shards(jobs, build, options.jobs, options.timeout, on_done)
        t_build = time.monotonic() - t0 - t_passes

        confirm_tiles_in_logs(ctx.reports, jobs)
        shutil.copytree(logs, staging / "logs")
        profile.save(staging / "profile.json")
        manifest = Manifest(
            target=target, source=source, shard_version=__version__,
            profile={"file": "profile.json", "target": profile.target, "toolkit": profile.toolkit},
            build=build,
            inputs=ctx.model_inputs or [tensor_spec(t) for t in graph.inputs],
            outputs=ctx.model_outputs or [tensor_spec(t) for t in graph.outputs],
            host_pre=ctx.host_pre, host_post=ctx.host_post,
            shards=[ShardSpec(name=p.name, onnx=f"shards/{p.name}.onnx",
                              artifact=f"shards/{p.name}{tgt.artifact_suffix}" if tgt.artifact_suffix else None,
                              log=f"logs/{p.name}.log", inputs=[tensor_spec(t) for t in p.inputs],
                              outputs=[tensor_spec(t) for t in p.outputs], core=k % profile.cores,
                              precision=build.get("precision", "fp32"), macs=p.macs, source_nodes=p.source_nodes)
                    for k, p in enumerate(plans)],
        )
        report = make_report(ctx.reports, manifest, builds, {"passes": t_passes, "build": t_build,
                                                             "total": time.monotonic() - t0})
        (staging / MANIFEST).write_text(manifest.to_json())
        (staging / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        replace_dir(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if not any(logs.iterdir()):
            logs.rmdir()
        raise
    shutil.rmtree(logs, ignore_errors=True)
    return CompileResult(bundle=output, manifest=manifest, report=report)


def run_passes(graph: gs.Graph, tgt, profile, options: CompileOptions, progress: Progress = lambda *a: None,
               until: str | None = None) -> tuple[gs.Graph, PassContext]:
    """The pass pipeline (up to `until`); where the target has a toolkit, the passes ask it about
    single ops and small regions (cached builds), and its workers stop when the passes end."""
    ops = tgt.pass_toolkit(profile, options)
    ctx = PassContext(profile=profile, options=options, ops=ops,
                      legality=Legality(profile, ops) if profile.limits else None)
    try:
        graph = run_pipeline(graph, ctx, options.disable, on_pass=lambda name: progress(name, 0, 1),
                             dump_after=options.dump_after, until=until)
    finally:
        if ops is not None:
            ops.close()
    return graph, ctx


def confirm_tiles_in_logs(reports: dict, jobs: list[ShardJob]) -> None:
    """Read the shard build logs' layer tables: did the attention tiles stay apart?"""
    from shard.passes.tile_attention import confirm_tiles
    from shard.targets.rknn_log import parse_build_log

    changes = reports.get("tile_attention", {}).get("changes", [])
    if not changes:
        return
    names = [layer.name for job in jobs if job.log.exists()
             for layer in parse_build_log(job.log.read_text(errors="replace")).layers]
    if names:  # targets without a layer table (cpu) have nothing to confirm
        confirm_tiles(changes, names)


def check_options(options: CompileOptions) -> None:
    from shard.passes import fusion_barrier, tile_attention

    for flag, value, modes in (("--tile-attention", options.tile_attention, tile_attention.MODES),
                               ("--fusion-barrier", options.fusion_barrier, fusion_barrier.MODES)):
        if value not in modes:
            raise ShardError(f"{flag} {value!r}: expected one of {', '.join(modes)}")
    if options.fusion_barrier == "rules" and not options.disable_rules:
        raise ShardError("--fusion-barrier rules needs the rule names: --disable-rule NAME (repeatable)")


def save_onnx(model, path: Path) -> None:
    import onnx

    # Protobuf caps one message at 2 GiB; larger shards keep their weights beside them.
    large = model.ByteSize() > 1_800_000_000
    onnx.save(model, str(path), save_as_external_data=large, location=f"{path.name}.data" if large else None)


def check_output_path(output: Path) -> None:
    """Refuse to replace anything at `output` that is not a bundle; make sure its folder exists."""
    if output.exists() and not (output / MANIFEST).is_file():
        raise ShardError(f"{output} exists and is not a shard bundle; remove it or choose another -o")
    if not output.parent.is_dir():
        raise ShardError(f"{output.parent}: no such directory for the bundle")


def replace_dir(staging: Path, output: Path) -> None:
    """Put the finished bundle in place: a rename, so readers never see half of one."""
    if output.exists():
        old = output.with_name(f".{output.name}.old-{os.getpid()}")
        output.rename(old)
        staging.rename(output)
        shutil.rmtree(old)
    else:
        staging.rename(output)


def make_report(passes: dict, manifest: Manifest, builds: list[ShardBuild], seconds: dict) -> dict:
    by_name = {b.name: b for b in builds}
    shards = []
    for spec in manifest.shards:
        b = by_name[spec.name]
        shards.append({"name": spec.name, "core": spec.core, "nodes": len(spec.source_nodes), "macs": spec.macs,
                       "inputs": [t.name for t in spec.inputs], "outputs": [t.name for t in spec.outputs],
                       "build_seconds": b.seconds, "diagnostics": b.diagnostics})
    def total(key: str) -> int:  # counts are ints, findings are lists of names
        values = [s["diagnostics"].get(key, 0) for s in shards]
        return sum(len(v) if isinstance(v, list) else v for v in values)

    after = total("estimated_cycles")
    return {"passes": passes, "shards": shards,
            "totals": {"shards": len(shards), "regtask_lines": total("regtask_lines"),
                       "error_lines": total("error_lines"), "cpu_ops": total("cpu_ops"),
                       "single_core_fallbacks": total("single_core_fallbacks"),
                       "estimated_cycles": after, "estimated_cycles_before_passes": after + rewrite_delta(passes)},
            "seconds": {k: round(v, 2) for k, v in seconds.items()}}


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
