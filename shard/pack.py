"""pack: a bundle as one .tar.gz holding what a board needs and nothing else.

    NAME/bundle/     the manifest, the compiled artifacts, the host steps' tables (and, with
                     --with-onnx, the shard ONNX files, so the cpu executor runs it anywhere)
    NAME/shard/      the runtime package itself (numpy-only; executors import their library lazily)
    NAME/run.py      python run.py --input x.npy
    NAME/README.txt

Reproducible: entries sorted, times, owners and modes fixed, gzip without a timestamp, so the same
bundle packs to the same bytes. The packed manifest drops what a board never reads (build logs,
quantization samples) and the ONNX files unless asked for.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import inspect
import io
import tarfile
from pathlib import Path

import shard
from shard.bundle import MANIFEST, Manifest, check_files, read_manifest
from shard.errors import ShardError
from shard.packed import check_runtime
from shard.runtime.buckets import is_bucketed
from shard.runtime.generative_bundle import GENERATIVE, PREDICTION
from shard.runtime.generative_bundle import check_files as check_generative_files
from shard.runtime.generative_bundle import is_generative, read_checked, read_generative
from shard.runtime.host import step_files

RUNTIME = ("__init__.py", "bundle.py", "errors.py", "packed.py", "scratch.py", "runtime")   # what `import shard.runtime` needs
LEFT_OUT = ("rknn_sim.py",)   # the simulator executor needs the x86 toolkit environment, never on a board

RUN_PY = '''"""Run this pack's model with the runtime beside it: python run.py --help"""
import sys
from pathlib import Path

here = Path(__file__).resolve().parent
{check}

check_runtime(here)   # before anything of the pack is imported
sys.path.insert(0, str(here))
from shard.runtime.__main__ import main  # noqa: E402

sys.exit(main([str(here / "bundle"), *sys.argv[1:]]))
'''

README = '''{name}: {source}, compiled by shard {version} for {target}.

On the board ({board}, Python 3.9+):
    pip install rknn-toolkit-lite2 numpy
    python run.py --input x.npy                 # one input; NAME=x.npy for several
    python run.py --input x.npy --save out/     # outputs as out/NAME.npy
Anywhere else{onnx_note}:
    pip install numpy onnxruntime
    python run.py --backend cpu
As a library: sys.path.insert(0, "{name}"); import shard.runtime; shard.runtime.load("{name}/bundle").run(inputs)
Or, with the runtime installed: python -m shard.runtime {name}.tar.gz

Inputs: {inputs}
Outputs: {outputs}
Shards: {shards}
'''

GENERATIVE_README = '''{name}: {source}, a generative bundle compiled by shard {version} for {target}.

On the board ({board}, Python 3.9+):
    pip install rknn-toolkit-lite2 numpy transformers    # transformers: the model's own tokenizer
    python run.py --prompt "What is the capital of France?"
    python run.py --bench       # prefill and decode timed on each cache path, beside the compile's prediction
Anywhere else{onnx_note}:
    pip install numpy onnxruntime transformers
    python run.py --backend cpu --prompt "What is the capital of France?"

Programs: {programs}; cache capacities {capacities}
'''


def pack_bundle(bundle: str | Path, output: str | Path, with_onnx: bool = False) -> Path:
    """Write the pack; returns its path (`output`, which must end in .tar.gz). A generative bundle packs
    each of its programs as a bundle is packed, beside its spec, embeddings, tokenizer and prediction."""
    bundle, output = Path(bundle), Path(output)
    if not output.name.endswith(".tar.gz"):
        raise ShardError(f"{output}: a pack is a .tar.gz file")
    if is_bucketed(bundle):
        raise ShardError(f"{bundle}: a bundle of shape buckets is packed bucket by bucket for now: "
                         f"shard pack {bundle}/b0 -o ..., and so on")
    name = output.name[: -len(".tar.gz")]
    if name in ("", ".", "..") or name.startswith("."):   # `-o .tar.gz` wrote absolute names, `...tar.gz` ../ ones
        raise ShardError(f"{output}: a pack's name is what its folder is called: NAME.tar.gz, NAME not starting "
                         f"with a dot")
    code = runtime_code()
    runtime = {rel: hashlib.sha256(data).hexdigest() for rel, data in sorted(code.items())}
    if is_generative(bundle):
        files, readme = generative_files(bundle, with_onnx, runtime, name)
    else:
        manifest, files = bundle_files(bundle, with_onnx, runtime)
        files = {f"bundle/{rel}": data for rel, data in files.items()}
        readme = README.format(
            name=name, source=manifest.source.get("name", "?"), version=shard.__version__, target=manifest.target,
            board=manifest.target.upper(),
            onnx_note="" if with_onnx or not manifest.rknn else " (this pack has no ONNX: pack with --with-onnx)",
            inputs=", ".join(f"{t.name} {t.shape} {t.dtype}" for t in manifest.inputs),
            outputs=", ".join(f"{t.name} {t.shape} {t.dtype}" for t in manifest.outputs),
            shards=len(manifest.shards))
    files.update(code)
    files["run.py"] = RUN_PY.format(check=inspect.getsource(check_runtime)).encode()
    files["README.txt"] = readme.encode()
    write_tar_gz(output, {f"{name}/{rel}": data for rel, data in files.items()})
    return output


def runtime_code() -> dict[str, bytes]:
    """The runtime package's files a pack carries, by their path in it (shard/...)."""
    package = Path(shard.__file__).parent
    code = {}
    for entry in RUNTIME:
        for path in ([package / entry] if entry.endswith(".py") else sorted((package / entry).rglob("*.py"))):
            if path.name not in LEFT_OUT:
                code[f"shard/{path.relative_to(package).as_posix()}"] = path.read_bytes()
    return code


def bundle_files(bundle: Path, with_onnx: bool, runtime: dict[str, str]) -> tuple[Manifest, dict[str, bytes]]:
    """A bundle's files for a board, by their path in it: its artifacts (and ONNX files where asked, or
    where they are what runs), its host steps' tables, and its manifest without what a board never reads
    (build logs, quantization samples), recording the pack's runtime code (`runtime`: path -> sha256)."""
    manifest = read_manifest(bundle)
    check_files(bundle, manifest)   # never pack what the compile did not write
    files: dict[str, bytes] = {}
    shards = []
    for spec in manifest.shards:
        keep_onnx = with_onnx or spec.artifact is None   # a GPU stage's ONNX is what the cuda executor runs
        for rel in (spec.artifact, spec.onnx if keep_onnx else None):
            if rel:
                files[rel] = (bundle / rel).read_bytes()
                data = bundle / f"{rel}.data"   # external weights of a large shard
                if data.exists():
                    files[f"{rel}.data"] = data.read_bytes()
        shards.append(dataclasses.replace(spec, onnx=spec.onnx if keep_onnx else None, log=None, dataset=[]))
    for step in manifest.host_pre + manifest.host_post:
        for rel in step_files(step):
            files[rel] = (bundle / rel).read_bytes()
    recorded = {rel: record for rel, record in manifest.files.items() if rel in files}
    files[MANIFEST] = dataclasses.replace(manifest, shards=shards, files=recorded, runtime=runtime).to_json().encode()
    return manifest, files


def generative_files(bundle: Path, with_onnx: bool, runtime: dict[str, str], name: str) -> tuple[dict[str, bytes], str]:
    """A generative bundle's files for a board (bundle/...): its spec, the files it records (embeddings,
    tokenizer), the compile's prediction, and each program as bundle_files packs it; and the README."""
    spec = read_generative(bundle)
    check_generative_files(bundle, spec.files)   # the tokenizer folder: only what it records, no link, no code
    files = {f"bundle/{rel}": read_checked(bundle, spec.files, rel) for rel in spec.files}   # read once, checked
    for rel in [GENERATIVE] + ([PREDICTION] if (bundle / PREDICTION).is_file() else []):
        files[f"bundle/{rel}"] = (bundle / rel).read_bytes()
    programs = [p.name for p in spec.programs] + ([spec.vision["program"]] if spec.vision else [])
    manifests = []
    for program in programs:
        manifest, program_files = bundle_files(bundle / program, with_onnx, runtime)
        manifests.append(manifest)
        files.update({f"bundle/{program}/{rel}": data for rel, data in program_files.items()})
    target = manifests[0].target
    onnx_note = "" if with_onnx or not any(m.rknn for m in manifests) else \
        " (this pack has no ONNX: pack with --with-onnx)"
    return files, GENERATIVE_README.format(
        name=name, source=spec.source.get("name", "?"), version=shard.__version__, target=target, board=target.upper(),
        onnx_note=onnx_note, programs=", ".join(programs), capacities=", ".join(map(str, spec.capacities)))


def write_tar_gz(path: Path, files: dict[str, bytes]) -> None:
    """Sorted entries, fixed metadata, no gzip timestamp: equal inputs give equal bytes."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel in sorted(files):
            info = tarfile.TarInfo(rel)
            info.size, info.mtime, info.mode = len(files[rel]), 0, 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(files[rel]))
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f, gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0) as gz:
        gz.write(raw.getvalue())
    tmp.replace(path)
