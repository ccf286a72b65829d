"""Manifest and Bundle: the compiled artifact, a directory with a versioned manifest.json.

Standard library only: the runtime on the device reads bundles with nothing but numpy installed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, TypeVar

from shard.errors import BundleError

T = TypeVar("T")

# 6: each artifact's build record (ShardSpec.built_from); 5: every file a run reads with its size and
# sha256, the manifest's digest; 4: a shard's own precision, build options, quantization samples,
# scaled edges; 3: host steps, shards with edge shapes and the build they kept
SCHEMA_VERSION = 6
MANIFEST = "manifest.json"

# The ONNX ops an "onnx" host step may hold (the runtime runs each in numpy: shard.runtime.host_ops,
# whose table a test holds to this one); compile moves only these to the host (shard.passes.host_edges).
HOST_ONNX_OPS = frozenset({
    "Cast", "Not", "And", "Or", "Xor", "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Where",
    "Add", "Sub", "Mul", "Div", "Neg", "Cos", "Sin", "Min", "Max", "Unsqueeze", "Squeeze", "Reshape", "Expand",
    "CumSum", "Flatten", "Slice", "Concat", "Transpose", "Gather", "GatherElements", "ArgMax", "ArgMin",
    "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "Clip", "Softmax", "LogSoftmax"})


def step_inputs(step: dict) -> list[str]:
    """The tensors a host step reads (its own constants aside)."""
    names = step.get("inputs") or [step["input"]]
    return [n for n in names if n not in step.get("constants", {})]


def step_outputs(step: dict) -> list[str]:
    """The tensors a host step makes."""
    return step.get("outputs") or [step["output"]]


@dataclass
class TensorSpec:
    name: str
    shape: list[int]
    dtype: str


@dataclass
class ShardSpec:
    name: str
    onnx: str                      # paths are relative to the bundle and never leave it
    artifact: str | None
    log: str | None
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    core: int
    precision: str
    macs: int = 0
    source_nodes: list[str] = field(default_factory=list)
    build: str = ""                # which build compile kept: the rewritten shard, its unrewritten twin, the vendor alone
    edge_shapes: dict[str, list[int]] = field(default_factory=dict)  # inputs the graph takes in another (4-D) shape
    build_options: dict = field(default_factory=dict)  # its toolkit options where not the manifest's (int8)
    dataset: list[list[str]] = field(default_factory=list)  # its quantization samples: per sample, .npy per input
    edge_scales: dict[str, list] = field(default_factory=dict)  # edge: [the model's tensor, k], held / 2^k
    built_from: dict[str, str] = field(default_factory=dict)  # sha256 of the build's "onnx", "onnx.data", "artifact"


@dataclass
class Manifest:
    target: str
    source: dict                   # {"name": file name, "sha256": ...}
    profile: dict                  # {"target", "toolkit", "file"}
    build: dict                    # toolkit options every shard was built with
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    shards: list[ShardSpec]
    # Layout steps the runtime does on the host, in numpy, before the first shard and after the
    # last: tensors at the model's edges that no shard could take whole (see shard.runtime.host).
    host_pre: list[dict] = field(default_factory=list)
    host_post: list[dict] = field(default_factory=list)
    executors: list[str] = field(default_factory=list)   # the backends its target runs it on, default first
    input_values: dict[str, list] = field(default_factory=dict)   # inputs fixed at compile (--input-value)
    batch: int = 1   # frames a run takes at once (--batch): every input and output leads with this axis
    schema_version: int = SCHEMA_VERSION
    shard_version: str = ""
    files: dict[str, dict] = field(default_factory=dict)   # {path: {"bytes", "sha256"}} of every file a run reads
    runtime: dict[str, str] = field(default_factory=dict)  # a pack's: {its runtime's files: sha256} (runtime.packed)
    digest: str = ""   # the sha256 of this manifest's JSON with digest empty: a changed byte shows

    def to_json(self) -> str:
        """The manifest as written, sealed first: its digest set over everything else it says."""
        self.digest = self.own_digest()
        return json.dumps(self.written(), indent=2) + "\n"

    def own_digest(self) -> str:
        return sealed_digest(self.written())

    def written(self) -> dict:
        """What the file holds: without input_values where none was fixed, batch where it is 1 and runtime
        outside a pack, so a bundle written before those fields existed keeps its digest."""
        data = asdict(self)
        if not data["input_values"]:
            del data["input_values"]
        if data["batch"] == 1:
            del data["batch"]
        if not data["runtime"]:
            del data["runtime"]
        return data

    @property
    def rknn(self) -> bool:
        """Built by rknn-toolkit2 for a Rockchip chip (its shards are .rknn files)."""
        return "target_platform" in self.build.get("config", {})

    @classmethod
    def from_dict(cls, data: dict) -> Manifest:
        tensors = lambda items: [TensorSpec(**t) for t in items]  # noqa: E731
        shards = [ShardSpec(**{**s, "inputs": tensors(s["inputs"]), "outputs": tensors(s["outputs"])})
                  for s in data["shards"]]
        return cls(**{**data, "inputs": tensors(data["inputs"]), "outputs": tensors(data["outputs"]),
                      "shards": shards})


def sealed_digest(data: dict) -> str:
    """The sha256 a JSON file of a bundle is sealed with (a manifest, generative.json): of its indented
    JSON with `digest` empty, so a changed byte shows."""
    return hashlib.sha256(json.dumps({**data, "digest": ""}, indent=2).encode()).hexdigest()


def run_files(root: Path, manifest: Manifest) -> list[str]:
    """The bundle's files a run reads (shard ONNX and their external weights, artifacts, host tables,
    quantization samples, the profile); not the logs and the report, which it does not."""
    named = [rel for s in manifest.shards for rel in (s.onnx, s.artifact) if rel]
    named += [f"{s.onnx}.data" for s in manifest.shards if s.onnx and (root / f"{s.onnx}.data").is_file()]
    named += [c["file"] for step in manifest.host_pre + manifest.host_post
              for c in step.get("constants", {}).values() if "file" in c]
    named += [rel for s in manifest.shards for sample in s.dataset for rel in sample]
    named += [manifest.profile["file"]] if manifest.profile.get("file") and (root / manifest.profile["file"]).is_file() \
        else []
    return sorted(set(named))


def file_record(path: Path) -> dict:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def record_files(root: Path, manifest: Manifest) -> None:
    """Give the manifest the size and sha256 of every file a run reads; written by whoever writes the
    manifest, once those files are final."""
    manifest.files = {rel: file_record(root / rel) for rel in run_files(root, manifest)}


def check_files(bundle: str | Path, manifest: Manifest | None = None) -> dict[str, str]:
    """Every file a run reads against the size and sha256 the manifest records: {path: "ok"}, or a
    BundleError naming the first that differs (a byte flipped in a pack ran with a different answer,
    and two swapped .rknn files verified)."""
    root = Path(bundle)
    manifest = manifest or read_manifest(root)
    checked = {}
    for rel in sorted(set(run_files(root, manifest)) | set(manifest.files)):   # a recorded file gone counts too
        want = manifest.files.get(rel)
        if want is None:
            raise BundleError(f"{root}: {rel} has no recorded hash in the manifest: the bundle was changed after "
                              f"it was written; compile the model again")
        path = root / rel
        if not path.is_file() or not path.resolve().is_relative_to(root.resolve()):
            raise BundleError(f"{root}: {rel} is missing, or not a file of the bundle: compile the model again")
        got = file_record(path) if path.stat().st_size == want["bytes"] else None
        if got != want:
            raise BundleError(f"{root}: {rel} is not the file the compile wrote (its size or sha256 differs): "
                              f"the bundle was changed or damaged after it was written; compile it again")
        checked[rel] = f"ok (sha256 {want['sha256'][:12]}, {want['bytes']} bytes)"
    for rel, line in check_builds(root, manifest).items():
        checked[rel] += line
    return checked


def check_builds(root: Path, manifest: Manifest) -> dict[str, str]:
    """Each shard's artifact is the build of its ONNX: the hashes its build took of the files it read
    and wrote (ShardSpec.built_from) are those the manifest records for the shard's files, which
    check_files holds the files to. {artifact: a line}, or a BundleError (an artifact that a compile
    put in another shard's place would pass the file checks alone)."""
    lines = {}
    for shard in manifest.shards:
        if not shard.artifact:
            continue
        files = {"onnx": shard.onnx, "onnx.data": shard.onnx and f"{shard.onnx}.data", "artifact": shard.artifact}
        recorded = {role: manifest.files[rel]["sha256"] for role, rel in files.items() if rel in manifest.files}
        # a pack without the ONNX files (shard pack): the artifact against its own record alone
        built = {role: sha for role, sha in shard.built_from.items() if role in recorded or role == "artifact"}
        if built != recorded:
            raise BundleError(f"{root}: {shard.artifact} is not the build of {shard.onnx or 'its ONNX'} (the hashes "
                              f"its build recorded differ from the bundle's files); compile the model again")
        lines[shard.artifact] = (f"; the build of {shard.onnx} (sha256 {recorded['onnx'][:12]}), as recorded when it "
                                 f"was built" if shard.onnx else "; as recorded when it was built")
    return lines


def read_versioned(path: Path, version: int, what: str, build: Callable[[dict], T]) -> T:
    """build(data) of a JSON file a bundle holds beside its manifests (buckets.json, generative.json),
    refused in one line where it is unreadable or of another schema."""
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise BundleError(f"{path}: unreadable {what} file (not a JSON object)")
        if data.get("schema_version") != version:
            raise BundleError(f"{path}: {what} schema {data.get('schema_version')!r}, this shard reads {version}; "
                              f"recompile the model")
        return build(data)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:   # ValueError: JSON, UTF-8
        raise BundleError(f"{path}: unreadable {what} file ({exc})") from None


def read_manifest(bundle: str | Path) -> Manifest:
    """Load and check a bundle's manifest: known schema, every file present and inside the bundle."""
    root = Path(bundle)
    path = root / MANIFEST
    if not path.is_file():
        if not root.exists():
            raise BundleError(f"{root}: no such bundle (nothing there); make one with `shard compile`")
        if (root / "generative.json").is_file():
            raise BundleError(f"{root}: a decoder's bundle of several programs: write text with `shard generate`, check "
                              f"it with `shard verify`, run one program with `shard run {root}/decode`")
        if (root / "vla.json").is_file():
            if (root / "vision" / MANIFEST).is_file():
                raise BundleError(f"{root}: a VLA's bundle of three programs: act with `shard act {root}`; each "
                                  f"program runs and verifies on its own (`shard run {root}/step`)")
            raise BundleError(f"{root}: a VLA folder, its programs as ONNX: compile it with "
                              f"`shard compile {root} --target thor`")
        raise BundleError(f"{root}: not a shard bundle (no {MANIFEST}); make one with `shard compile`")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BundleError(f"{path}: unreadable manifest ({exc})") from None
    if not isinstance(data, dict):
        raise BundleError(f"{path}: malformed manifest (not a JSON object)")
    if data.get("schema_version") != SCHEMA_VERSION:
        raise BundleError(f"{path}: schema version {data.get('schema_version')!r}, this shard reads "
                          f"{SCHEMA_VERSION}; recompile the model")
    try:
        manifest = Manifest.from_dict(data)
    except (KeyError, TypeError, AttributeError) as exc:
        raise BundleError(f"{path}: malformed manifest ({exc})") from None
    if manifest.digest != manifest.own_digest():
        raise BundleError(f"{path}: the manifest is not the one the compile wrote (its digest differs): the bundle was "
                          f"changed or damaged after it was written; compile the model again")
    base = root.resolve()
    files = [(f"shard {shard.name}", rel) for shard in manifest.shards for rel in (shard.onnx, shard.artifact, shard.log)]
    files += [(f"host step {step.get('type', step.get('op'))}", c["file"]) for step in manifest.host_pre + manifest.host_post
              for c in step.get("constants", {}).values() if "file" in c]
    files += [(f"shard {shard.name}'s quantization samples", rel) for shard in manifest.shards
              for sample in shard.dataset for rel in sample]
    files += [(f"shard {shard.name}'s weights", f"{shard.onnx}.data") for shard in manifest.shards
              if shard.onnx and (root / f"{shard.onnx}.data").exists()]   # a link out of the bundle, too
    for owner, rel in files:
        if rel is None:
            continue
        full = (root / rel).resolve()
        if not full.is_relative_to(base):
            raise BundleError(f"{path}: {owner} points outside the bundle ({rel})")
        if not full.is_file():
            raise BundleError(f"{path}: {owner} file missing: {rel}")
    return manifest
