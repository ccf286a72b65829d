"""BundleWriter: the chosen builds as a bundle (shard files, host tables, logs, manifest, report), and the
report's figures."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from shard import __version__
from shard.bundle import MANIFEST, Manifest, ShardSpec, record_files, step_inputs
from shard.cache_folder import link_or_copy
from shard.compilation.names import UNREWRITTEN, VENDOR_ALONE
from shard.errors import ModelError
from shard.graph import graph_tensors, sha256_file, tensor_spec
from shard.options import CompileOptions
from shard.passes import PassContext
from shard.passes.partition import npu_seconds_per_mac
from shard.passes.tile_attention import confirm_tiles, tiled
from shard.profile import Profile
from shard.runtime import random_inputs
from shard.runtime.host import load_tables, run_host, step_files
from shard.runtime.scheduler import predict_stream
from shard.summary import fp8_nodes, rewrite_delta
from shard.targets import ShardBuild, ShardJob, Target
from shard.targets.chips import board_handoff


@dataclass
class BundleWriter:
    """What a finished compile knows; `write` puts a bundle of some of its builds into a folder."""

    target: str
    tgt: Target
    profile: Profile
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
        fp8 = fp8_nodes(ctx.reports)
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
            host_pre=host_pre, host_post=host_post, shards=specs, executors=list(self.tgt.executors),
            input_values={name: list(np.asarray(v).reshape(-1).tolist()) for name, v in self.options.input_values.items()
                          if name not in {t.name for t in inputs}}, batch=self.options.batch)
        check_outputs(manifest.outputs, manifest.batch)
        report = make_report(ctx.reports, manifest, self.builds,
                             {**self.seconds, "total": time.monotonic() - self.started})
        report["predicted"] = npu_prediction(manifest, report["shards"], self.profile)
        vendor = self.builds.get(VENDOR_ALONE)
        dates = sorted({lim.date for lim in self.profile.limits.values() if lim.date})
        report["profile"] = {"target": self.profile.target, "file": str(self.options.profile or "shipped"),
                             "toolkit": self.profile.toolkit, "cores": self.profile.cores,
                             "probed": dates[-1] if dates else None}
        report.update(precision=self.options.precision, batch=manifest.batch, warnings=self.ctx.warnings,
                      words=dict(self.tgt.words),
                      choices=self.choices, versus_vendor=self.versus, vendor_only=self.options.vendor_only, host_pre=host_pre,
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


def check_outputs(outputs, batch: int) -> None:
    """Every output of a batched bundle leads with the batch (run_stream cuts each frame's out of it)."""
    for t in outputs if batch > 1 else ():
        if not t.shape or t.shape[0] != batch:
            raise ModelError(f"--batch {batch}: output {t.name} has shape {t.shape}, not led by the batch, so one "
                             f"frame's part of it cannot be cut out; compile without --batch")


def time_host_steps(steps: list[dict], tensors: list, bundle: Path, before: bool = True) -> float | None:
    """Milliseconds the runtime spends on host steps (before the shards, or after them), on seeded
    values of the `tensors` they read (best of 3)."""
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


def link_builds(folder: Path, into: Path, names: list[str], artifact_suffix: str) -> None:
    """Each named build's files (ONNX, external weights, artifact) linked from one shards folder into another."""
    into.mkdir(parents=True)
    for name in names:
        for suffix in (".onnx", ".onnx.data", artifact_suffix):
            if suffix and (folder / f"{name}{suffix}").exists():
                link_or_copy(folder / f"{name}{suffix}", into / f"{name}{suffix}")


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
                               build_options=tgt.build_for(build, precision, job.float16 if job else None,
                                                           job.disable_rules if job else ())
                               if precision != build.get("precision") or (job and job.disable_rules) else {},
                               dataset=dataset,
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


def confirm_tiles_in_logs(tgt: Target, reports: dict, jobs: list[ShardJob], undone: set[str]) -> None:
    """Read the kept shard builds' layer tables: did the attention tiles stay apart? (Tilings undone
    in favour of an unrewritten shard have nothing to confirm.)"""
    if not tiled(reports, undone):
        return
    names = [name for job in jobs if job.log.exists() for name in tgt.layer_names(job.log)]
    if names:  # targets without a layer table (cpu) have nothing to confirm
        confirm_tiles(reports, names, undone)


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
            "totals": {"shards": len(shards), "overflow_lines": total("overflow_lines"),
                       "error_lines": total("error_lines"), "cpu_ops": total("cpu_ops"),
                       "fallbacks": total("fallbacks"),
                       "estimated_cycles": after, "estimated_cycles_before_passes": before,
                       "macs_by_dtype": by_dtype,
                       "int8_mac_share": round(by_dtype.get("INT8", 0) / sum(by_dtype.values()), 4)
                       if by_dtype else None},
            "seconds": {k: round(v, 2) for k, v in seconds.items()},
            "builds": {"total": len(builds), "from_cache": sum(b.cached for b in builds.values())}}


def npu_prediction(manifest: Manifest, rows: list[dict], profile) -> dict | None:
    """One frame's time and run_stream's frames/s on 1..cores cores, from each shard's estimated cycles
    at the NPU clock (its MACs at the fp16 peak where the vendor gives none) and, on a chip whose
    board's hand-off is known, each shard's inputs set and outputs got on the host
    (shard.targets.chips.Handoff: a cost every shard pays where the vendor's one graph pays it once),
    through the scheduler's own policy (shard.runtime.scheduler.predict_stream). Host steps not counted."""
    clock, per_mac = profile.facts.get("npu_clock_hz"), npu_seconds_per_mac(profile.facts)
    if not clock or not manifest.shards:
        return None
    npu = [(row["diagnostics"].get("estimated_cycles") or 0) / clock or row["macs"] * per_mac for row in rows]
    handoff = board_handoff(manifest.target, profile.facts)
    moves = [handoff.between(s.inputs, s.outputs) if handoff else 0.0 for s in manifest.shards]
    seconds = [a + b for a, b in zip(npu, moves)]
    predicted = {"shard_seconds": seconds, "latency_s": predict_stream(manifest.shards, seconds, [0])[0],
                 "stream_fps": {str(n): predict_stream(manifest.shards, seconds, list(range(n)))[1]
                                for n in range(1, profile.cores + 1)}}
    if handoff:
        predicted.update(npu_seconds=npu, handoff_seconds=moves, handoff_source=handoff.source, npu_clock_hz=clock,
                         vendor_handoff_s=handoff.between(manifest.inputs, manifest.outputs))
    return predicted

