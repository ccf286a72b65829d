"""The runtime: what it imports, how it checks inputs, how it reads bundles."""

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import mlp_chain, shard_cli, write_manifest

import shard
from shard.options import CompileOptions
from shard.errors import BundleError, RunError, TargetError


@pytest.fixture
def bundle(tmp_path, save):
    return shard.compile(save(mlp_chain(3)), "cpu", tmp_path / "m.shard", CompileOptions(shards=3)).bundle


def test_runtime_imports_only_numpy_and_executor_library(bundle):
    code = ("import sys, numpy as np, shard.runtime as rt\n"
            f"s = rt.load({str(bundle)!r}, backend='cpu')\n"
            "s.run({'x': np.zeros((1, 8, 16), np.float32)})\n"
            "list(s.run_stream([{'x': np.ones((1, 8, 16), np.float32)}] * 3))\n"
            f"s.write_trace({str(bundle / 'trace.json')!r})\n"
            "heavy = {'onnx', 'onnx_graphsurgeon', 'networkx', 'torch', 'transformers', 'typer', 'rich'}\n"
            "print(sorted(heavy & {m.split('.')[0] for m in sys.modules}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_inputs_are_checked(bundle):
    with shard.load(bundle, backend="cpu") as session:
        with pytest.raises(RunError, match="missing"):
            session.run({})
        with pytest.raises(RunError, match=r"compiled for \[1, 8, 16\]"):
            session.run({"x": np.zeros((1, 9, 16), np.float32)})


def test_manifest_paths_never_leave_the_bundle(bundle):
    write_manifest(bundle, lambda data: data["shards"][0].update(onnx="../../etc/passwd"))
    with pytest.raises(BundleError, match="outside the bundle"):
        shard.load(bundle, backend="cpu")


def test_unknown_schema_is_refused(bundle):
    path = bundle / "manifest.json"
    data = json.loads(path.read_text())
    data["schema_version"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(BundleError, match="recompile"):
        shard.load(bundle, backend="cpu")


@pytest.mark.skipif(__import__("importlib.util").util.find_spec("rknnlite") is not None,
                    reason="rknn-toolkit-lite2 is installed (on a board)")
@pytest.mark.toolkit
def test_board_backend_needs_rknnlite(tmp_path, save):
    from shard.errors import TargetError

    bundle = shard.compile(save(mlp_chain(1)), "rk3588", tmp_path / "m.shard").bundle   # a board runs rk3588's
    with pytest.raises(TargetError, match="rknn-toolkit-lite2"):
        shard.load(bundle, backend="board")


def test_public_api_names_survive_importing_their_modules():
    """`import shard.x` sets the attribute shard.x; no public function may share a module's name."""
    code = ("import shard, shard.verifier, shard.compilation, shard.runtime\n"
            "print(all(callable(getattr(shard, n)) for n in ('compile', 'load', 'verify')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"


@pytest.mark.parametrize("damage", ["unmade input", "cycle", "made twice", "unmade output"])
def test_a_manifest_whose_shards_cannot_all_run_is_refused_at_load(bundle, damage):
    # Before, a run waited forever: a core thread died of a KeyError outside its try block.
    def edit(data):
        shards = data["shards"]
        if damage == "unmade input":
            shards[1]["inputs"][0]["name"] = "nobody_makes_this"
        elif damage == "cycle":   # shard 0 reads what shard 1 makes, which reads shard 0's output
            shards[0]["inputs"].append(dict(shards[1]["outputs"][0]))
        elif damage == "made twice":
            shards[2]["outputs"].append(dict(shards[0]["outputs"][0]))
        else:
            data["outputs"][0]["name"] = "nobody_makes_this"

    write_manifest(bundle, edit)
    match = {"unmade input": "reads nobody_makes_this", "cycle": "a cycle", "made twice": "and by shard",
             "unmade output": "outputs reads nobody_makes_this"}[damage]
    with pytest.raises(BundleError, match=match):
        shard.load(bundle, backend="cpu")
    res = shard_cli("run", bundle, "--backend", "cpu", "--timeout", "5")
    assert res.returncode == 1 and "Traceback" not in res.stderr and "damaged" in res.stderr


def test_verify_compares_shapes_not_flattened_values(bundle, tmp_path, save):
    # The manifest's output shape changed from [1, 8, 16] to [1, 16, 8]: run returned [1, 16, 8] and
    # verify, comparing the flattened arrays, passed.
    from shard.verifier import compare

    def transpose(data):
        shape = data["outputs"][0]["shape"]
        data["outputs"][0]["shape"] = data["shards"][-1]["outputs"][0]["shape"] = [shape[0], shape[2], shape[1]]

    write_manifest(bundle, transpose)
    res = shard_cli("verify", bundle, "--reference", save(mlp_chain(3), "ref.onnx"), "--backend", "cpu")
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stdout + res.stderr
    x = np.arange(6.0).reshape(2, 3)
    assert compare("y", x, x.reshape(3, 2)).cosine != compare("y", x, x.reshape(3, 2)).cosine   # NaN
    assert compare("y", x, x.copy()).cosine == 1.0


def test_a_changed_byte_of_the_manifest_or_of_a_file_a_run_reads_is_refused(bundle):
    path = bundle / "manifest.json"
    text = path.read_text()
    path.write_text(text.replace('"core": 0', '"core": 1', 1))   # still valid JSON and a runnable bundle
    with pytest.raises(BundleError, match="digest differs"):
        shard.load(bundle, backend="cpu")
    path.write_text(text)
    shards = bundle / "shards"   # two shards' files swapped (as two .rknn artifacts were, and verified)
    a, b = (shards / "shard_000.onnx").read_bytes(), (shards / "shard_001.onnx").read_bytes()
    (shards / "shard_000.onnx").write_bytes(b)
    (shards / "shard_001.onnx").write_bytes(a)
    with pytest.raises(BundleError, match="shard_000.onnx is not the file the compile wrote"):
        shard.load(bundle, backend="cpu")
    (shards / "shard_000.onnx").write_bytes(a)
    (shards / "shard_001.onnx").write_bytes(b)
    with shard.load(bundle, backend="cpu") as session:
        assert set(session.files) == {"shards/shard_000.onnx", "shards/shard_001.onnx", "shards/shard_002.onnx",
                                      "profile.json"} and all(v.startswith("ok") for v in session.files.values())


@pytest.mark.toolkit
def test_an_artifact_that_is_not_the_build_of_its_onnx_is_refused(tmp_path, save):
    # Two .rknn files swapped by whoever wrote the manifest after them (its file hashes then agree with
    # the files): only the hashes each build took when it ended tie an artifact to its ONNX.
    model = save(mlp_chain(2), "m.onnx")
    bundle = shard.compile(model, "rk3588", tmp_path / "m.shard", CompileOptions(shards=2)).bundle
    res = shard_cli("verify", bundle, "--reference", model, "--backend", "sim")
    assert res.returncode == 0, res.stderr
    for k in range(2):
        onnx_sha = json.loads((bundle / "manifest.json").read_text())["files"][f"shards/shard_00{k}.onnx"]["sha256"]
        assert f"file shards/shard_00{k}.rknn: ok" in res.stdout
        assert f"the build of shards/shard_00{k}.onnx (sha256 {onnx_sha[:12]})" in res.stdout
    shards = bundle / "shards"
    a, b = (shards / "shard_000.rknn").read_bytes(), (shards / "shard_001.rknn").read_bytes()
    assert a != b
    (shards / "shard_000.rknn").write_bytes(b)
    (shards / "shard_001.rknn").write_bytes(a)

    def reseal(data):
        files = data["files"]
        files["shards/shard_000.rknn"], files["shards/shard_001.rknn"] = \
            files["shards/shard_001.rknn"], files["shards/shard_000.rknn"]

    write_manifest(bundle, reseal)
    with pytest.raises(BundleError, match="shard_000.rknn is not the build of shards/shard_000.onnx"):
        shard.load(bundle, backend="sim")
    res = shard_cli("verify", bundle, "--reference", model, "--backend", "sim")
    assert res.returncode == 1 and "is not the build of" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("name", [".tar.gz", "...tar.gz"])
def test_a_pack_is_named_by_a_plain_name(bundle, tmp_path, name):
    # -o .tar.gz wrote absolute member names, -o ...tar.gz ../ ones.
    res = shard_cli("pack", bundle, "-o", tmp_path / name)
    assert res.returncode == 1 and "Traceback" not in res.stderr and "NAME.tar.gz" in res.stderr
    assert not (tmp_path / name).exists()


def test_a_bundle_never_reads_through_a_link_out_of_it(bundle, tmp_path):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"not yours")
    (bundle / "shards" / "shard_000.onnx.data").symlink_to(secret)
    with pytest.raises(BundleError, match="points outside the bundle"):
        shard.load(bundle, backend="cpu")
    res = shard_cli("pack", bundle, "-o", tmp_path / "p.tar.gz", "--with-onnx")
    assert res.returncode == 1 and "outside the bundle" in res.stderr and not (tmp_path / "p.tar.gz").exists()


def test_a_host_step_after_the_shards_never_names_a_file_out_of_the_bundle(bundle, tmp_path):
    def edit(data):
        data["host_post"] = [{"op": "onnx", "type": "Mul", "inputs": ["y", "c"], "outputs": ["z"],
                              "constants": {"c": {"file": "../../../../etc/passwd"}}}]

    write_manifest(bundle, edit)
    with pytest.raises(BundleError, match="host step Mul points outside the bundle"):
        shard.load(bundle, backend="cpu")
    res = shard_cli("pack", bundle, "-o", tmp_path / "p.tar.gz")
    assert res.returncode == 1 and "outside the bundle" in res.stderr


def test_a_timeout_ends_the_run_with_exit_1_not_an_abort(tmp_path, save):
    # The error line came, then "terminate called without an active exception" and exit 134 in about 4
    # runs of 6: a core thread still inside onnxruntime when the interpreter exited.
    big = shard.compile(save(mlp_chain(3, width=512)), "cpu", tmp_path / "big.shard", CompileOptions(shards=3)).bundle
    for _ in range(6):
        res = shard_cli("run", big, "--backend", "cpu", "--timeout", "0.000001", "--repeat", "30")
        assert res.returncode == 1 and "timeout" in res.stderr and "terminate" not in res.stderr, res.stderr


@pytest.mark.toolkit
def test_a_simulator_timeout_leaves_no_temporary_folder(tmp_path, save):
    # The process leaves through os._exit (a core thread is still inside the simulator): no finalizer
    # ran, and the simulator's shard-sim-* and shard-worker-* folders stayed in TMPDIR.
    bundle = shard.compile(save(mlp_chain(1)), "rk3588", tmp_path / "m.shard").bundle
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    res = shard_cli("run", bundle, "--backend", "sim", "--timeout", "0.001", env_extra={"TMPDIR": str(scratch)})
    assert res.returncode == 1 and "timeout" in res.stderr, res.stderr
    assert [p.name for p in scratch.iterdir() if p.name.startswith("shard-")] == []


def test_a_recorded_file_that_is_gone_is_refused_in_one_line(bundle):
    (bundle / "profile.json").unlink()
    with pytest.raises(BundleError, match="profile.json is missing"):
        shard.load(bundle, backend="cpu")


def test_a_bundle_runs_on_the_backends_its_target_names(bundle):
    # The target names its executors (Target.executors) and the manifest carries them: the first is the
    # default, and another backend is refused in one line before anything loads.
    with shard.load(bundle) as session:
        assert session.manifest.executors == ["cpu"] and session.backend == "cpu"
    with pytest.raises(TargetError, match="a cpu bundle runs on cpu; not on sim"):
        shard.load(bundle, backend="sim")
    res = shard_cli("run", bundle, "--backend", "cuda")
    assert res.returncode == 1 and "runs on cpu; not on cuda" in res.stderr and "Traceback" not in res.stderr
