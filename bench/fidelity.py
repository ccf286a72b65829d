"""Accuracy per precision on a trained transformer, the vendor's options and shard's side by side.

A trained sentence encoder (--model: all-mpnet-base-v2 or all-MiniLM-L6-v2, weights shipped in
packages of the index, see bench/trained.py), its sentence embedding at sequence length 128: 32
calibration sentences (--calib-count: the first N), 4 held-back test sentences, every variant on
rknn-toolkit2's simulator against onnxruntime fp32 on the test sentences.

    vendor fp16          the model as it came, do_quantization=False
    vendor int8          w8a8, quantized_algorithm normal, from the 32 calibration samples
    vendor mmse          w8a8, mmse
    vendor auto_hybrid   w8a8, normal, build(auto_hybrid=True): the vendor moves what it finds
                         sensitive to fp16
    shard int8           shard compile --precision int8 --calib (per-shard calibration from the
                         reference's own tensors, mask clamps)
    shard mixed          shard compile --precision mixed --calib: linears int8, the rest fp16, the
                         most sensitive linears moved to fp16 until cosine 0.999 on the quarter of the
                         calibration sentences held out of the int8 ranges (shard.precision)

Each line: mean and worst cosine over the test sentences, the int8 share of the Conv/MatMul MACs
(from the build's layer table) and the vendor's estimated cycles; for shard mixed also the compile's
own split and its two cosines (held out, calibration). Ends with one RESULT line.

    python bench/fidelity.py [--model NAME] [--work DIR] [--only NAME ...] [--calib-count N]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trained import ENCODERS, sentence_encoder  # noqa: E402

from shard.compare import lowest  # noqa: E402
from shard.targets.rknn.worker import infer  # noqa: E402
from shard.targets.rknn.log import macs_by_dtype, parse_build_log  # noqa: E402
from shard.targets.rknn.env import find_python  # noqa: E402
from shard.targets.rknn.worker import ToolkitWorker  # noqa: E402
from shard.verifier import compare  # noqa: E402

BASE = {"target_platform": "rk3588"}
INT8 = {**BASE, "quantized_dtype": "w8a8", "quantized_method": "channel"}
VENDOR = {
    "vendor fp16": (BASE, {"do_quantization": False}),
    "vendor int8": ({**INT8, "quantized_algorithm": "normal"}, {"do_quantization": True}),
    "vendor mmse": ({**INT8, "quantized_algorithm": "mmse"}, {"do_quantization": True}),
    "vendor auto_hybrid": ({**INT8, "quantized_algorithm": "normal"}, {"do_quantization": True, "auto_hybrid": True}),
}


def samples_of(arrays: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    n = len(next(iter(arrays.values())))
    return [{k: v[i] for k, v in arrays.items()} for i in range(n)]


def reference(model: Path, samples: list[dict]) -> list[np.ndarray]:
    from shard.calibration import ort_session
    import onnx

    session = ort_session(onnx.load(str(model)))
    return [session.run(None, s)[0] for s in samples]


def int8_share(by_dtype: dict[str, int]) -> float:
    total = sum(by_dtype.values())
    return by_dtype.get("INT8", 0) / total if total else 0.0


def vendor_row(name: str, model: Path, calib: list[dict], test: list[dict], expected: list, work: Path) -> dict:
    """Build the model as it came with one vendor configuration, keep it in the worker, run the test samples."""
    config, build = VENDOR[name]
    folder = work / name.replace(" ", "-")
    folder.mkdir(parents=True, exist_ok=True)
    dataset = []
    for k, sample in enumerate(calib):
        dataset.append([])
        for i, (key, value) in enumerate(sample.items()):
            np.save(folder / f"calib{k}_{i}.npy", value)
            dataset[-1].append(str(folder / f"calib{k}_{i}.npy"))
    (folder / "build.log").write_text("")   # the worker appends to it
    worker = ToolkitWorker(find_python("rk3588"), folder / "worker.log")
    try:
        started = time.monotonic()
        answer = worker.request(op="build", onnx=str(model), rknn=None, log=str(folder / "build.log"), config=config,
                                build=build, keep="m", dataset=dataset if build["do_quantization"] else [],
                                timeout=3600)
        seconds = time.monotonic() - started
        if not answer["ok"]:
            return {"name": name, "error": answer.get("error") or answer.get("rc")}
        parsed = parse_build_log((folder / "build.log").read_text(errors="replace"))
        cosines = []
        for k, sample in enumerate(test):
            run = folder / f"run{k}"
            run.mkdir(exist_ok=True)
            out = infer(lambda **req: worker.request(timeout=3600, **req), "m", list(sample.values()), run,
                        folder / "run.log")
            cosines.append(compare("embedding", expected[k], out[0]).cosine)
    finally:
        worker.close()
    return {"name": name, "cosines": cosines, "int8": int8_share(macs_by_dtype(parsed.layers)),
            "cycles": parsed.estimated_cycles, "cpu_ops": len(parsed.cpu_ops), "seconds": seconds}


def shard_row(name: str, precision: str, model: Path, calib_file: Path, test: list[dict], work: Path) -> dict:
    import shard
    from shard.options import CompileOptions

    started = time.monotonic()
    result = shard.compile(model, "rk3588", work / f"{precision}.shard",
                           CompileOptions(precision=precision, calib=str(calib_file), vendor_baseline=False),
                           progress=lambda step, done, total: print(f"  {step}", flush=True)
                           if done == total and step.startswith("mixed") else None)
    seconds = time.monotonic() - started
    report = shard.verify(result.bundle, model, backend="sim", samples=test)
    totals = result.report["totals"]
    mixed = result.report.get("mixed")
    kept = next((r for r in mixed["rounds"] if r["round"] == mixed["kept"]), None) if mixed else None
    if kept:   # the compile's own split: ranges from one part of --calib, each round accepted on the other
        n = mixed["samples"]
        split = f"each of the {n['held_out']} held out in turn ({n['folds']} folds)" if n.get("folds", 1) > 1 else \
            f"int8 ranges from {n['calibration']} calibration sentences, accepted on {n['held_out']} held out"
        print(f"  split: {split}; kept round {kept['round']}: {kept['cosine']:.5f} held out, "
              f"{kept['cosine_calibration']:.5f} on the calibration sentences", flush=True)
    return {"name": name, "cosines": [comps[0].cosine for comps in report.samples],
            "int8": totals.get("int8_mac_share") or 0.0, "cycles": totals["estimated_cycles"],
            "cpu_ops": totals["cpu_ops"], "seconds": seconds,
            "held": kept["cosine"] if kept else None, "fitted": kept["cosine_calibration"] if kept else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=ENCODERS, default=ENCODERS[0], help="the trained encoder [default: %(default)s]")
    parser.add_argument("--work", type=Path, default=None, help="keep builds here [default: a temporary folder]")
    parser.add_argument("--only", nargs="*", default=None, help="variants to run (names as printed)")
    parser.add_argument("--calib-count", type=int, default=None,
                        help="calibrate on the first N of the 32 sentences (under 16, mixed holds them out in turn)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="shard-fidelity-"))
    work.mkdir(parents=True, exist_ok=True)
    model, calib, test = sentence_encoder(args.model, work / f"{args.model}.onnx")
    calib = {name: values[:args.calib_count] for name, values in calib.items()}
    calib_file = work / "calib.npz"
    np.savez(calib_file, **calib)
    calib_samples, test_samples = samples_of(calib), samples_of(test)
    expected = reference(model, test_samples)
    print(f"{args.model} sentence embedding, seq 128: {len(calib_samples)} calibration and "
          f"{len(test_samples)} test sentences; rknn-toolkit2 simulator against onnxruntime fp32", flush=True)
    rows = []
    variants = [*VENDOR, "shard int8", "shard mixed"]
    for name in variants if args.only is None else [v for v in variants if v in args.only]:
        if name in VENDOR:
            row = vendor_row(name, model, calib_samples, test_samples, expected, work)
        else:
            row = shard_row(name, name.split()[1], model, calib_file, test_samples, work)
        rows.append(row)
        if "error" in row:
            print(f"{name:20s} failed: {row['error']}", flush=True)
            continue
        c = row["cosines"]
        print(f"{name:20s} cosine mean {np.mean(c):.6f} worst {lowest(c):.6f}  int8 MACs {100 * row['int8']:5.1f} %  "
              f"est. {row['cycles'] / 1e6:6.1f} M cycles  CPU ops {row['cpu_ops']:2d}  built in {row['seconds']:.0f} s",
              flush=True)
    worst = {r["name"]: lowest(r["cosines"]) for r in rows if "cosines" in r}
    share = {r["name"]: r["int8"] for r in rows if "cosines" in r}
    cycles = {r["name"]: r["cycles"] for r in rows if "cosines" in r}
    mixed = next((r for r in rows if r["name"] == "shard mixed" and "cosines" in r), {})
    fmt = lambda v: "n/a" if v is None else f"{v:.5f}"  # noqa: E731  (5 digits: 0.99897 must not read as 0.9990)
    print(f"RESULT model={args.model} vendor_int8={fmt(worst.get('vendor int8'))} vendor_mmse={fmt(worst.get('vendor mmse'))} "
          f"vendor_hybrid={fmt(worst.get('vendor auto_hybrid'))} shard_int8={fmt(worst.get('shard int8'))} "
          f"shard_mixed={fmt(worst.get('shard mixed'))} int8_macs={fmt(share.get('shard mixed'))} "
          f"hybrid_int8_macs={fmt(share.get('vendor auto_hybrid'))} "
          f"cycles_fp16={cycles.get('vendor fp16', 0) / 1e6:.1f}M cycles_mixed={cycles.get('shard mixed', 0) / 1e6:.1f}M "
          f"mixed_held_out={fmt(mixed.get('held'))} mixed_calibration={fmt(mixed.get('fitted'))}")


if __name__ == "__main__":
    main()
