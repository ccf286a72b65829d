"""Run a bundle or a pack with nothing but the runtime (numpy and the executor's library):

    python -m shard.runtime model.shard --input x.npy --save out/
    python -m shard.runtime model.tar.gz                      # a pack from `shard pack`
    python run.py --input pixel_values=x.npy                  # inside an unpacked pack

Without --backend: board where rknn-toolkit-lite2 is installed (an RK3588), tensorrt or cuda on a GPU
for thor and cuda bundles, else the cpu executor (onnxruntime), which needs the shards' ONNX files.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tarfile
import time
import zlib
from pathlib import Path

import numpy as np

from shard import scratch
from shard.bundle import read_manifest
from shard.errors import RunError, ShardError
from shard.packed import SPECS
from shard.runtime import load, random_inputs
from shard.runtime.buckets import is_bucketed, read_buckets
from shard.runtime.executors import traits_of
from shard.runtime.generate import GenerativeSession
from shard.runtime.generative_bundle import PREDICTION, PREFILL_TOKENS, GenerativeSpec, is_generative, read_generative
from shard.runtime.scheduler import exit_now_if_stuck
from shard.runtime.session import pick_backend

BENCH_NEW = 32   # the tokens --bench decodes


def read_inputs(items: list[str], names: list[str]) -> dict[str, np.ndarray]:
    """--input NAME=FILE.npy (repeatable), or --input FILE.npy for a model with one input."""
    arrays = {}
    for text in items:
        name, sep, path = text.partition("=")
        if not sep:
            if len(names) != 1:
                raise RunError(f"--input {text!r}: expected NAME=FILE.npy (the inputs: {', '.join(names)})")
            name, path = names[0], text
        try:
            arrays[name] = np.load(path, allow_pickle=False)
        except (OSError, ValueError, EOFError) as exc:
            raise RunError(f"--input {name}: cannot read {path} as .npy ({exc})") from None
        if arrays[name].dtype.kind not in "biuf":   # complex lost its imaginary part, strings raised
            raise RunError(f"--input {name}: {path} holds {arrays[name].dtype} values; the model takes numbers "
                           f"(integers or floats)")
    return arrays


def check_save(folder: Path | None, bundle: Path | None = None) -> None:
    """Refuse a --save path that is not a folder, or lies inside the bundle run, before the run rather
    than after it."""
    if folder is not None and folder.exists() and not folder.is_dir():
        raise RunError(f"--save {folder}: a file is there; --save names a folder to write NAME.npy files in")
    if folder is not None and bundle is not None and folder.resolve().is_relative_to(Path(bundle).resolve()):
        raise RunError(f"--save {folder}: inside the bundle {bundle}, which this reads; write the outputs elsewhere")


def save_outputs(outputs: dict[str, np.ndarray], folder: Path) -> list[Path]:
    """Each output as FOLDER/NAME.npy ('/' in a name becomes '_')."""
    check_save(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, array in outputs.items():
        paths.append(folder / f"{name.replace('/', '_')}.npy")
        np.save(paths[-1], array)
    return paths


# What a pack may unpack to: a bundle is its weights and little else, which gzip barely shrinks (a
# 1 MB pack of zeros unpacked to 1 GiB).
MAX_MEMBERS = 10_000
MAX_BYTES = 64 * 2**30
MAX_RATIO = 100   # unpacked bytes over the pack's


def unpack(path: Path, into: Path) -> Path:
    """The bundle inside a pack (NAME/bundle), extracted into `into`: the whole gzip stream read and
    its CRC and length checked first, within MAX_MEMBERS entries and MAX_BYTES (and MAX_RATIO times
    the pack), regular files and folders only, one bundle; anything else a RunError in one line."""
    limit = min(MAX_BYTES, MAX_RATIO * max(path.stat().st_size, 1 << 20))
    try:
        with gzip.open(path, "rb") as stream:   # tarfile stops before gzip's trailer: its CRC went unseen
            total = 0
            for block in iter(lambda: stream.read(1 << 20), b""):
                total += len(block)
                if total > limit:
                    raise RunError(f"{path}: unpacks to more than {limit / 2**30:.1f} GiB: not a shard pack")
        with tarfile.open(path, "r:gz") as tar:
            members = tar.getmembers()
            if len(members) > MAX_MEMBERS:
                raise RunError(f"{path}: {len(members)} entries, more than a shard pack holds ({MAX_MEMBERS})")
            odd = next((m.name for m in members if not (m.isfile() or m.isdir())), None)
            if odd is not None:
                raise RunError(f"{path}: entry {odd!r} is not a file: not a shard pack")
            try:
                tar.extractall(into, filter="data")
            except TypeError:   # a Python without extraction filters (before 3.9.17): check the names ourselves
                root = into.resolve()
                if any(not (root / m.name).resolve().is_relative_to(root) for m in members):
                    raise RunError(f"{path}: an entry leaves the pack's folder: not a shard pack") from None
                tar.extractall(into)
    except (tarfile.TarError, OSError, EOFError, zlib.error, UnicodeError, ValueError) as exc:
        raise RunError(f"{path}: not a shard pack, or a damaged one ({type(exc).__name__}: {exc})") from None
    found = sorted(p for spec in SPECS for p in into.glob(f"*/bundle/{spec}"))
    if len(found) != 1:
        raise RunError(f"{path}: not a shard pack ({len(found)} NAME/bundle/manifest.json or generative.json inside, "
                       f"one expected)")
    return found[0].parent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shard.runtime", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", help="a bundle directory or a pack (.tar.gz)")
    ap.add_argument("--input", "-i", action="append", default=[], help="NAME=FILE.npy, or FILE.npy for one input "
                                                                        "[default: seeded random inputs]")
    ap.add_argument("--backend", help="board, cpu, cuda or tensorrt [default: what this machine has]")
    ap.add_argument("--repeat", type=int, default=1, help="frames to run one after another")
    ap.add_argument("--save", type=Path, help="write the last frame's outputs here as NAME.npy")
    ap.add_argument("--timeout", type=float, help="stop with an error if one shard runs longer (seconds)")
    ap.add_argument("--prompt", default="What is the capital of France?", help="a generative bundle: the chat "
                                                                                 "prompt to answer")
    ap.add_argument("--max-new", type=int, default=32, help="a generative bundle: new tokens at most")
    ap.add_argument("--bench", action="store_true", help="a generative bundle: time prefill and decode on each "
                                                         "cache path, beside the compile's prediction")
    args = ap.parse_args(argv)
    try:
        check_save(args.save, Path(args.bundle))
        with scratch.temporary("pack") as tmp:
            path = Path(args.bundle)
            bundle = unpack(path, Path(tmp)) if path.is_file() else path
            if is_generative(bundle):
                run_generative(bundle, args)
                return 0
            if args.bench:
                raise RunError("--bench times a generative bundle's steps; time this one with --repeat")
            # a bundle of shape buckets: random inputs fill its smallest bucket, given ones pick theirs
            manifest = read_manifest(bundle / read_buckets(bundle).buckets[0].name if is_bucketed(bundle) else bundle)
            backend = args.backend or pick_backend(manifest)
            given = read_inputs(args.input, [t.name for t in manifest.inputs])
            with load(bundle, backend, timeout=args.timeout) as session:
                started = time.perf_counter()
                for _ in range(max(1, args.repeat)):
                    outputs = session.run(given or random_inputs(manifest.inputs))
                wall = time.perf_counter() - started
            print(f"{bundle.parent.name or bundle.name}: {len(manifest.shards)} shards on {backend}, "
                  f"{1000 * wall / max(1, args.repeat):.1f} ms per frame")
            for name, array in outputs.items():
                print(f"output {name}: shape {list(array.shape)} {array.dtype}")
            if args.save:
                save_outputs(outputs, args.save)
    except ShardError as exc:
        print(f"error: {exc}", file=sys.stderr)
        exit_now_if_stuck(1)
        return 1
    return 0


def run_generative(bundle: Path, args: argparse.Namespace) -> None:
    """A generative bundle: the prompt's answer, or (--bench) each cache path timed."""
    spec = read_generative(bundle)
    backend = args.backend or pick_backend(read_manifest(bundle / spec.programs[0].name))
    if args.bench:
        bench_generative(bundle, spec, backend, args.timeout)
        return
    with GenerativeSession(bundle, backend=backend, timeout=args.timeout) as session:
        done = session.generate(args.prompt, max_new_tokens=args.max_new, chat=True)
    print(done.text)
    print(f"{len(done.prompt)} prompt tokens in {sum(done.prefill_ms):.1f} ms ({done.prefill_steps} steps), "
          f"{len(done.tokens)} new at {done.decode_tokens_per_s or '-'} tokens/s on {backend}")


def bench_generative(bundle: Path, spec: GenerativeSpec, backend: str, timeout: float | None = None) -> None:
    """Prefill and decode timed on each cache path this backend has (on the board: held in NPU memory,
    and handed to rknn-toolkit-lite2 every step), a prompt of PREFILL_TOKENS token ids (fewer where the
    smallest cache is smaller) and BENCH_NEW new tokens, no stop; then the compile's prediction as it
    wrote it (report.json), for the same figures."""
    capacity = spec.capacities[0]
    new = min(BENCH_NEW, capacity // 4)
    ids = [k % spec.vocab for k in range(3, 3 + min(PREFILL_TOKENS, capacity - new))]
    board = traits_of(backend).binds_inputs
    paths = {", the cache held in NPU memory": True, ", the cache handed over every step": False} if board else \
        {"": True}
    for name, held in paths.items():
        with GenerativeSession(bundle, backend=backend, held=held, timeout=timeout) as session:
            session.generate(ids[:spec.chunk], max_new_tokens=2, stop=set())   # warm: each program run once
            done = session.generate(ids, max_new_tokens=new, stop=set())
        print(f"measured on {backend}{name} (capacity {capacity}): prefill of {len(ids)} tokens "
              f"{sum(done.prefill_ms):.1f} ms in {done.prefill_steps} steps, decode {done.decode_tokens_per_s} "
              f"tokens/s over {len(done.decode_ms)} steps", flush=True)
    prediction = bundle / PREDICTION
    if not prediction.is_file():
        print(f"predicted by the compile: nothing ({PREDICTION} is not in this bundle)")
        return
    for row in json.loads(prediction.read_text()).get("predicted") or []:   # one row a cache capacity
        print("predicted by the compile: " + ", ".join(f"{k} {v}" for k, v in row.items()
                                                       if isinstance(v, (int, float)) and not isinstance(v, bool)))


if __name__ == "__main__":
    sys.exit(main())
