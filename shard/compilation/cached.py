"""compile_one_model: one ONNX model into one bundle, through the bundle cache (a model compiled the
same way again comes back from it). The package's compile_model sends a decoder's checkpoint to
generative.py instead, which compiles each of its programs here."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from shard import bundle_cache
from shard.bundle import check_files, read_manifest
from shard.cache_folder import default_cache_dir, mark_folder
from shard.compilation.names import Progress
from shard.compilation.staging import check_output_path, replace_dir, staging_folder
from shard.compilation.state import CompileResult
from shard.compilation.variants import compile_uncached
from shard.errors import ShardError
from shard.options import CompileOptions
from shard.runtime.buckets import is_bucketed, read_buckets
from shard.targets.registry import get_target


def default_output(model: Path) -> Path:
    return model.with_suffix(".shard")


def compile_one_model(model: Path, target: str, output: Path, options: CompileOptions,
                      progress: Progress = lambda *a: None) -> CompileResult:
    """Compile an ONNX model into a bundle directory; on failure nothing is left at `output`."""
    tgt = get_target(target)
    check_output_path(output, model)
    tgt.check_environment()               # a missing toolkit fails before minutes of work
    t0 = time.monotonic()
    root = default_cache_dir()
    if options.build_cache:
        mark_folder(root)                 # one that is not shard's, or read-only: one line, before any work
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
    if folders[0] != staging:
        return CompileResult.of_buckets(output, manifests[-1], reports)
    return CompileResult(bundle=output, manifest=manifests[-1], report=reports[staging.name])
