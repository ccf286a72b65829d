"""The real-model corpus (bench/corpus.py's models) through the GPU pipeline, on this CPU machine.

    python bench/corpus_gpu.py [--set all|onnx|transformers|packaged|ci] [--only NAME,...] [--precision fp16|fp8]

For each model: `shard compile --target thor --shards 2` (strongly typed fp16 stages, FP8 Q/DQ with
--precision fp8), then the bundle on one seeded input against onnxruntime fp32 on the original model,
twice: the cpu executor (onnxruntime over the stage files) and the cuda executor's torch form of each
stage run on the CPU (what a GPU runs, less CUDA graphs and streams). A model passes an executor at
cosine >= 0.999 (fp16 throughout). A model shard cannot take ends in one ShardError line (counted as
`refused`); a Python traceback is a bug (`tracebacks`).

Ends with: RESULT models=N compiled=A cpu_ok=B torch_ok=C refused=D tracebacks=E
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

import numpy as np

from corpus import PACKAGED, exported_models

MIN_COSINE = 0.999


def cosine(a, b) -> float:
    """Over the reference's finite values (sqrt of a random normal is NaN in onnxruntime too); NaN where
    the bundle is not finite at the same places."""
    from shard.verifier import compare

    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    finite = np.isfinite(a)
    if not np.array_equal(finite, np.isfinite(b)):
        return float("nan")
    return compare("output", a[finite], b[finite]).cosine


def torch_outputs(bundle: Path, inputs: dict) -> dict:
    """The bundle's outputs through the cuda executor's torch form, on the CPU, shard after shard."""
    from shard.bundle import read_manifest
    from shard.runtime.executors.cuda import CudaExecutor
    from shard.runtime.host import load_tables, run_host

    manifest = read_manifest(bundle)
    executor = CudaExecutor(bundle, manifest.shards, {t.name for t in manifest.outputs}, device="cpu")
    tensors = run_host(manifest.host_pre, dict(inputs), load_tables(bundle, manifest.host_pre))
    for shard in manifest.shards:
        tensors.update(executor.run(shard, tensors))
    run_host(manifest.host_post, tensors)
    return {t.name: tensors[t.name] for t in manifest.outputs}


def evaluate(name: str, model: Path, precision: str) -> dict:
    import onnx

    import shard
    from shard.calibration import run_each
    from shard.compare import lowest
    from shard.options import CompileOptions
    from shard.errors import ShardError
    from shard.runtime import random_inputs

    row = {"name": name, "compiled": False, "cpu": None, "torch": None, "error": None, "traceback": None}
    shapes = PACKAGED[name][2] if name in PACKAGED else {}
    with tempfile.TemporaryDirectory(prefix=f"gpu-corpus-{name}-") as work:
        try:
            compiled = shard.compile(model, "thor", Path(work) / "b.shard",
                                     CompileOptions(shards=2, precision=precision, input_shapes=shapes))
            row["compiled"] = True
            manifest = compiled.manifest
            x = random_inputs(manifest.inputs, seed=3)
            from shard.passes.canonicalize import prepare_model

            reference, _ = prepare_model(onnx.load(str(model)))
            want = next(run_each(reference, [x], [t.name for t in manifest.outputs]))
            with shard.load(compiled.bundle, backend="cpu") as session:
                got = session.run(x)
            row["cpu"] = lowest(cosine(want[k], got[k]) for k in want)
            got = torch_outputs(compiled.bundle, x)
            row["torch"] = lowest(cosine(want[k], got[k]) for k in want)
        except ShardError as exc:
            row["error"] = str(exc).splitlines()[0]
        except Exception:  # noqa: BLE001 - a bug: kept, counted, and the corpus goes on
            row["traceback"] = traceback.format_exc()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", default="all", choices=["all", "onnx", "transformers", "packaged", "ci"])
    parser.add_argument("--only", help="comma-separated model names")
    parser.add_argument("--precision", default="fp16", choices=["fp16", "fp8"])
    args = parser.parse_args()
    from shard.graph import quiet_graphsurgeon

    quiet_graphsurgeon()
    rows = []
    with tempfile.TemporaryDirectory(prefix="corpus-models-") as folder:
        for name, family, path in exported_models(args.set, args.only.split(",") if args.only else None, Path(folder)):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                row = evaluate(name, path, args.precision)
            rows.append(row)
            fmt = lambda c: "-" if c is None else f"{c:.6f}"  # noqa: E731
            status = "TRACEBACK" if row["traceback"] else (row["error"] or "")[:90]
            print(f"{name:44} {family:18} cpu {fmt(row['cpu']):>9} torch {fmt(row['torch']):>9} {status}", flush=True)
    for row in rows:
        if row["traceback"]:
            print(f"TRACEBACK {row['name']}:\n{row['traceback']}")
    ok = lambda key: sum(1 for r in rows if r[key] is not None and r[key] >= MIN_COSINE)  # noqa: E731
    print(f"RESULT models={len(rows)} compiled={sum(r['compiled'] for r in rows)} cpu_ok={ok('cpu')} "
          f"torch_ok={ok('torch')} refused={sum(1 for r in rows if r['error'])} "
          f"tracebacks={sum(1 for r in rows if r['traceback'])}")


if __name__ == "__main__":
    sys.exit(main())
