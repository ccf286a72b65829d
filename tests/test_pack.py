"""shard pack: a bundle as one reproducible .tar.gz that runs from a fresh environment holding only
numpy and onnxruntime, with the outputs of `shard run --backend cpu` bit for bit."""

from __future__ import annotations

import subprocess
import sys
import tarfile

import numpy as np
import pytest
from conftest import shard_cli

pytestmark = pytest.mark.toolkit


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    from shard.compilation import compile_model
    from shard.options import CompileOptions
    from shard.zoo import export_model

    root = tmp_path_factory.mktemp("pack")
    model = export_model("vit-tiny", root / "vit.onnx", layers=2)
    return compile_model(model, "rk3588", root / "vit.shard", CompileOptions(shards=2)).bundle


def test_pack_is_reproducible_and_holds_what_a_board_needs(bundle, tmp_path):
    packs = []
    for k in range(2):
        (tmp_path / str(k)).mkdir()
        res = shard_cli("pack", bundle, "-o", tmp_path / str(k) / "vit.tar.gz")
        assert res.returncode == 0, res.stderr
        packs.append((tmp_path / str(k) / "vit.tar.gz").read_bytes())
    assert packs[0] == packs[1]
    with tarfile.open(tmp_path / "0" / "vit.tar.gz") as tar:
        names = tar.getnames()
    assert {"vit/run.py", "vit/README.txt", "vit/bundle/manifest.json", "vit/shard/runtime/__init__.py"} <= set(names)
    assert sum(n.endswith(".rknn") for n in names) == 2
    assert not [n for n in names if n.endswith(".onnx") or "/logs/" in n or "rknn_sim" in n]


def test_pack_runs_in_a_fresh_environment_like_shard_run(bundle, tmp_path):
    res = shard_cli("pack", bundle, "--with-onnx", "-o", tmp_path / "vit.tar.gz")
    assert res.returncode == 0, res.stderr
    unpacked = tmp_path / "board"
    unpacked.mkdir()
    with tarfile.open(tmp_path / "vit.tar.gz") as tar:
        tar.extractall(unpacked, filter="data")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", "numpy", "onnxruntime"],
                   check=True)
    x = np.random.default_rng(7).standard_normal((1, 3, 224, 224)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    ran = subprocess.run([str(venv / "bin" / "python"), "run.py", "--input", str(tmp_path / "x.npy"),
                          "--save", str(tmp_path / "packed"), "--timeout", "600"], cwd=unpacked / "vit",
                         capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr
    assert "on cpu" in ran.stdout
    res = shard_cli("run", bundle, "--backend", "cpu", "--input", tmp_path / "x.npy", "--save", tmp_path / "shard")
    assert res.returncode == 0, res.stderr
    packed, direct = np.load(tmp_path / "packed" / "last_hidden_state.npy"), np.load(tmp_path / "shard" / "last_hidden_state.npy")
    assert packed.dtype == direct.dtype and np.array_equal(packed, direct)


def test_pack_without_onnx_says_how_to_run_on_the_cpu(bundle, tmp_path):
    res = shard_cli("pack", bundle, "-o", tmp_path / "vit.tar.gz")
    assert res.returncode == 0, res.stderr
    ran = subprocess.run([sys.executable, "-m", "shard.runtime", str(tmp_path / "vit.tar.gz"), "--backend", "cpu"],
                         capture_output=True, text=True)
    assert ran.returncode == 1 and "--with-onnx" in ran.stderr and "Traceback" not in ran.stderr
