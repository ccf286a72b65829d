"""Vendor builds kept by content: the same shard, toolkit and build configuration never build twice.

The key is the hash of what decides a build: the shard's ONNX bytes (and its external weights), the
build options, the toolkit version and the target. An entry holds the artifact, the build log and
what shard read from it; a failed build is kept too (the compiler fails the same way again), a
timeout or a dead worker is not. Entries are written whole or not at all. `~/.cache/shard/builds`,
or `$SHARD_BUILD_CACHE`.

A job with a `figures_key` (the vendor alone, in fp16) is also kept by its model's structure
(`structure_key`: its weights by name, dtype, shape and kind only): a model that differs only in weights
gets the figures of that build (overflow lines, CPU ops, fallbacks, cycles), not its artifact
(`figures`). On SigLIP-512 with one linear's weights changed, every figure of the two vendor
builds is the same.

The cache holds at most `$SHARD_BUILD_CACHE_SIZE` (10G unless set; K, M, G suffixes): after a
compile, the entries used least recently go first, never one the compile itself used. A hit marks
its entry used (its build.json's modification time).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from shard.bundle import file_record
from shard.cache_folder import prune, size_limit, store_entry
from shard.graph import sha256_file
from shard.targets import ShardBuild, ShardJob

VERSION = 2   # 2: diagnostics hold macs_by_dtype
NAME, LOG = "\x00name\x00", "\x00log\x00"   # stand-ins in a stored error message
FIGURES = "f"   # the prefix of an entry kept by structure (figures, no artifact)
WEIGHT_ELEMENTS = 16   # a float initializer this large is a weight: only weight_kind of its values decides a build
FP16_MAX = 65504.0
FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}


class BuildCache:
    def __init__(self, root: Path, target: str, toolkit: str):
        self.root = Path(root)
        self.salt = json.dumps([VERSION, target, toolkit], sort_keys=True).encode()
        self.used: set[str] = set()   # keys this compile read or wrote: never evicted by its prune()
        self.limit = size_limit()

    def key(self, job: ShardJob, build: dict) -> str:
        """The hash of the shard's files, its build options and its quantization samples, in order."""
        digest = hashlib.sha256(self.salt)
        digest.update(json.dumps(build, sort_keys=True).encode())
        for path in sorted([job.onnx, *job.onnx.parent.glob(f"{job.onnx.name}.data")]):
            sha256_file(path, digest)
        for sample in job.dataset or []:
            for path in sample:
                sha256_file(path, digest)
        return digest.hexdigest()[:32]

    def figures_key(self, job: ShardJob, build: dict) -> str | None:
        """The key of the job's figures by structure, None where its figures are not kept that way
        (no figures_key, or quantized: the samples and the weights decide the ranges)."""
        if job.figures_key is None or job.dataset:
            return None
        digest = hashlib.sha256(self.salt)
        digest.update(json.dumps([build, job.figures_key], sort_keys=True).encode())
        return FIGURES + digest.hexdigest()[:32]

    def figures(self, job: ShardJob, build: dict) -> ShardBuild | None:
        """The figures of an earlier build of a model of the same structure (its log put where the job
        wants it; no artifact), or None."""
        key = self.figures_key(job, build)
        found = self.get(replace(job, artifact=None), key) if key else None
        return found and replace(found, figures_only=True)

    def get(self, job: ShardJob, key: str) -> ShardBuild | None:
        """The cached build, its log and artifact put where the job wants them; None on a miss."""
        entry = self.root / key
        self.used.add(key)
        try:
            data = json.loads((entry / "build.json").read_text())
            artifact = data.pop("artifact", None)   # its size and sha256, as put() found it
            if job.artifact is not None and data["error"] is None and file_record(entry / "artifact") != artifact:
                shutil.rmtree(entry, ignore_errors=True)   # damaged or replaced: built again, and kept anew
                return None
            os.utime(entry / "build.json")   # used now: the last to be evicted
            shutil.copyfile(entry / "build.log", job.log)
            if job.artifact is not None and data["error"] is None:
                shutil.copyfile(entry / "artifact", job.artifact)   # a copy: editing a bundle never reaches the cache
        except OSError:   # a miss, or evicted under our feet
            return None
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
            shutil.rmtree(entry, ignore_errors=True)   # a damaged record: built again and kept anew, not every time
            return None
        if data["error"]:  # the message names the shard and its log: this job's, not the first one's
            data["error"] = data["error"].replace(NAME, job.name).replace(LOG, str(job.log))
        return ShardBuild(**{**data, "name": job.name, "seconds": 0.0, "peak_bytes": None, "cached": True})

    def put(self, job: ShardJob, key: str, build: ShardBuild, figures: str | None = None) -> None:
        """Keep a build under its key, and its figures alone under `figures` (figures_key) if given."""
        if build.error and ("timed out" in build.error or "died" in build.error):
            return  # not a property of the shard
        for entry, artifact in ((key, job.artifact), (figures, None)):
            if entry is None:
                continue
            self.used.add(entry)

            def write(staging: Path, artifact: Path | None = artifact) -> None:
                data = {k: v for k, v in asdict(build).items() if k not in ("name", "cached", "figures_only")}
                if build.error:
                    data["error"] = build.error.replace(str(job.log), LOG).replace(f"{job.name}:", f"{NAME}:")
                shutil.copyfile(job.log, staging / "build.log")
                if artifact is not None and build.error is None:
                    shutil.copyfile(artifact, staging / "artifact")
                    data["artifact"] = file_record(staging / "artifact")
                else:   # figures alone: no artifact to tie to its ONNX
                    data["built_from"] = {}
                (staging / "build.json").write_text(json.dumps(data))

            store_entry(self.root, entry, write)

    def prune(self, limit: int | None = None) -> tuple[int, int]:
        """Evict the least recently used entries (not this compile's) until the cache holds at most
        `limit` bytes ($SHARD_BUILD_CACHE_SIZE if None); returns what was evicted (entries, bytes)."""
        return prune(self.root, self.limit if limit is None else limit, self.used)


def structure_key(model: onnx.ModelProto) -> str:
    """The hash of a model with each weight (a float initializer of WEIGHT_ELEMENTS or more) standing
    as its name, dtype, shape and what a compiler may treat apart (all zeros, all ones, values past
    fp16's range); everything else (nodes, shapes, opsets, small constants such as a Reshape's
    shape or a scale) by value."""
    digest = hashlib.sha256()
    graph = model.graph
    digest.update(json.dumps([model.ir_version, sorted((o.domain, o.version) for o in model.opset_import)]).encode())
    for part in (graph.input, graph.output, graph.node, graph.sparse_initializer):
        for item in part:
            digest.update(item.SerializeToString())
    for tensor in graph.initializer:
        if tensor.data_type in FLOAT_TYPES and math.prod(tensor.dims) >= WEIGHT_ELEMENTS:
            digest.update(json.dumps([tensor.name, tensor.data_type, list(tensor.dims), weight_kind(tensor)]).encode())
        else:
            digest.update(tensor.SerializeToString())
    return digest.hexdigest()


def weight_kind(tensor: onnx.TensorProto) -> str:
    """What of a weight's values a compiler may treat apart: all zeros, all ones, past fp16, or values."""
    values = numpy_helper.to_array(tensor)
    if not values.any():
        return "zeros"
    if (values == 1).all():
        return "ones"
    return "values" if np.isfinite(values).all() and np.abs(values).max() <= FP16_MAX else "past fp16"
