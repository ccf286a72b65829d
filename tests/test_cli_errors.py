"""Bad input ends the command with one line on stderr and exit 1: no traceback, no partial bundle."""

import pytest
from conftest import add_model, assert_one_line_error, shard_cli


def test_missing_file(tmp_path):
    res = shard_cli("compile", tmp_path / "nope.onnx", "--target", "cpu")
    assert_one_line_error(res, "nope.onnx: no such file")


def test_not_onnx(tmp_path):
    path = tmp_path / "junk.onnx"
    path.write_bytes(b"\x00\x01 this is not a protobuf at all \xff" * 10)
    res = shard_cli("compile", path, "--target", "cpu")
    assert_one_line_error(res, "not an ONNX model")
    assert not (tmp_path / "junk.shard").exists()


def test_dynamic_dim(tmp_path):
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "seq", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "seq", 4])
    model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    import onnx

    onnx.save(model, str(tmp_path / "dyn.onnx"))
    res = shard_cli("compile", tmp_path / "dyn.onnx", "--target", "cpu")
    assert_one_line_error(res, "dynamic dimension 1", "in shape [1,seq,4]", "--input-shape x=1,N,4")  # not markup
    assert not (tmp_path / "dyn.shard").exists()
    ok = shard_cli("compile", tmp_path / "dyn.onnx", "--target", "cpu", "--input-shape", "x=1,5,4")
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "dyn.shard" / "manifest.json").is_file()


def test_unknown_target_lists_known(save):
    res = shard_cli("compile", save(add_model([1, 4])), "--target", "rk9999")
    assert_one_line_error(res, "unknown target 'rk9999'", "rk3588", "cpu")


def test_missing_toolkit_says_how_to_install(save, tmp_path):
    res = shard_cli("compile", save(add_model([1, 4])), "--target", "rk3588",
                    env_extra={"SHARD_TOOLKIT_HOME": str(tmp_path / "empty")})
    assert_one_line_error(res, "shard toolkit install rk3588")
    assert not (tmp_path / "model.shard").exists()


def test_output_in_the_way_is_not_replaced(save, tmp_path):
    (tmp_path / "model.shard").mkdir()
    (tmp_path / "model.shard" / "precious.txt").write_text("keep me")
    res = shard_cli("compile", save(add_model([1, 4])), "--target", "cpu")
    assert_one_line_error(res, "is not a bundle shard wrote")
    assert (tmp_path / "model.shard" / "precious.txt").read_text() == "keep me"


@pytest.mark.parametrize("marker", ["manifest.json", "generative.json", "buckets.json"])
def test_a_folder_that_merely_holds_a_file_named_like_a_bundles_is_not_replaced(save, tmp_path, marker):
    # A web app or a browser extension holds a manifest.json: -o onto it deleted the user's files.
    app = tmp_path / "app"
    app.mkdir()
    (app / marker).write_text('{"name": "my web app", "schema_version": 6, "programs": [], "buckets": []}')
    (app / "index.html").write_text("<p>mine</p>")
    res = shard_cli("compile", save(add_model([1, 4])), "--target", "cpu", "-o", app)
    assert_one_line_error(res, "is not a bundle shard wrote", "remove it yourself or choose another -o")
    assert sorted(p.name for p in app.iterdir()) == sorted([marker, "index.html"])


def test_a_bundle_shard_wrote_is_replaced_and_a_link_to_one_is_refused(save, tmp_path):
    model = save(add_model([1, 4]))
    assert shard_cli("compile", model, "--target", "cpu", "-o", tmp_path / "m.shard").returncode == 0
    again = shard_cli("compile", model, "--target", "cpu", "-o", tmp_path / "m.shard", "--no-cache")
    assert again.returncode == 0, again.stderr
    (tmp_path / "link.shard").symlink_to(tmp_path / "m.shard")
    assert_one_line_error(shard_cli("compile", model, "--target", "cpu", "-o", tmp_path / "link.shard"),
                          "is a symbolic link")
    assert (tmp_path / "m.shard" / "manifest.json").is_file()


@pytest.mark.parametrize("args, fragment", [
    (["run", "nowhere.shard"], "nowhere.shard: no such bundle (nothing there)"),
    (["verify", "nowhere.shard", "--reference", "x.onnx"], "nowhere.shard: no such bundle (nothing there)"),
    (["generate", "nowhere.shard", "--ids", "1"], "nowhere.shard: no such bundle (nothing there)"),
    (["run", "."], "not a shard bundle (no manifest.json)"),
    (["zoo", "export", "resnet-9000", "-o", "x.onnx"], "unknown zoo model"),
])
def test_other_commands(tmp_path, args, fragment):
    assert_one_line_error(shard_cli(*args, cwd=tmp_path), fragment)


@pytest.mark.parametrize("location", ["../../../../../../dev/zero", "/etc/hostname", "elsewhere/../../w.bin", "link.bin",
                                      "missing.bin"])
def test_external_data_must_lie_beside_the_model(tmp_path, location):
    # ../../dev/zero hung `shard compile` forever: the bundle cache hashed it before anything looked.
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    folder = tmp_path / "model"
    folder.mkdir()
    (tmp_path / "w.bin").write_bytes(np.ones(4, np.float32).tobytes())
    (folder / "link.bin").symlink_to(tmp_path / "w.bin")   # a link out of the folder
    w = numpy_helper.from_array(np.ones(4, np.float32), "w")
    w.ClearField("raw_data")
    w.data_location = TensorProto.EXTERNAL
    w.external_data.add(key="location", value=location)
    graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], initializer=[w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    with open(folder / "m.onnx", "wb") as f:
        f.write(model.SerializeToString())
    res = shard_cli("compile", folder / "m.onnx", "--target", "cpu")
    assert_one_line_error(res, "tensor w keeps its data in", "beside the model")
    assert not (folder / "m.shard").exists()


@pytest.mark.parametrize("shape, fragment", [("x=1,16,8", "is fixed at 8, not 16"), ("x=2,1,8,16", "has rank 3"),
                                             ("x=1,8|1,8,2", "needs the same rank"), ("x=1,0,16", "at least 1")])
def test_input_shape_must_agree_with_the_models_static_dimensions(tmp_path, shape, fragment):
    # x=1,16,8 on a [1,8,16] Relu compiled, and the run silently returned the result reshaped.
    from conftest import make_model
    from onnx import helper

    import onnx

    path = tmp_path / "relu.onnx"
    onnx.save(make_model([helper.make_node("Relu", ["x"], ["y"])], [("x", [1, 8, 16])], [("y", [1, 8, 16])]), path)
    res = shard_cli("compile", path, "--target", "cpu", "--input-shape", shape)
    assert_one_line_error(res, fragment)
    assert not (tmp_path / "relu.shard").exists()


def test_a_tensor_made_twice_is_refused(tmp_path):
    # Not SSA: onnxruntime and the onnx checker refuse it; shard compiled it and the simulator took the first.
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="first"),
                               helper.make_node("Neg", ["x"], ["y"], name="second")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "twice.onnx"
    path.write_bytes(model.SerializeToString())
    res = shard_cli("compile", path, "--target", "cpu")
    assert_one_line_error(res, "tensor y is made by node first and by node second")


def test_a_model_inside_the_output_folder_is_refused_and_kept(tmp_path):
    out = tmp_path / "out.shard"
    out.mkdir()
    (out / "manifest.json").write_text("{}")   # an earlier bundle there, the model saved into it
    import onnx

    onnx.save(add_model([1, 8]), out / "m.onnx")
    res = shard_cli("compile", out / "m.onnx", "--target", "cpu", "-o", out)
    assert_one_line_error(res, "lies inside the output")
    assert (out / "m.onnx").is_file()


def test_a_compile_that_died_between_its_renames_leaves_the_old_bundle_in_place(tmp_path):
    import subprocess

    import onnx

    model = tmp_path / "m.onnx"
    onnx.save(add_model([1, 8]), model)
    assert shard_cli("compile", model, "--target", "cpu", "-o", tmp_path / "m.shard").returncode == 0
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / "m.shard").rename(tmp_path / f".m.shard.old-{dead.pid}")   # where a SIGKILL left it
    res = shard_cli("compile", tmp_path / "missing.onnx", "--target", "cpu", "-o", tmp_path / "m.shard")
    assert res.returncode == 1   # a compile that fails itself still puts the only bundle back
    assert (tmp_path / "m.shard" / "manifest.json").is_file()


@pytest.mark.parametrize("values", ["complex", "strings"])
def test_run_refuses_inputs_that_are_not_numbers(tmp_path, values):
    import numpy as np
    import onnx

    model = tmp_path / "m.onnx"
    onnx.save(add_model([1, 8]), model)
    assert shard_cli("compile", model, "--target", "cpu").returncode == 0
    x = np.ones((1, 8), np.complex64) if values == "complex" else np.array([["a"] * 8])
    np.save(tmp_path / "x.npy", x)
    res = shard_cli("run", tmp_path / "m.shard", "--backend", "cpu", "--input", tmp_path / "x.npy")
    assert_one_line_error(res, "the model takes numbers")


def test_an_initializer_without_its_data_is_refused(tmp_path):
    # A 2^31-element initializer with no bytes got as far as numpy's reshape (ValueError, a traceback).
    from onnx import TensorProto, helper

    weight = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[2 ** 31])
    vi = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, [2 ** 31])  # noqa: E731
    graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g", [vi("x")], [vi("y")], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "huge.onnx"
    path.write_bytes(model.SerializeToString())
    res = shard_cli("compile", path, "--target", "cpu")
    assert_one_line_error(res, "tensor w has shape [2147483648] but holds data for fewer values")
    assert not (tmp_path / "huge.shard").exists()


@pytest.mark.parametrize("text", [b"out_name", b"Relu"])   # a tensor name, an op type
def test_names_that_are_not_utf8_are_refused(tmp_path, text):
    # protobuf hands such strings through as bytes; onnx's make_node then raised UnicodeDecodeError.
    from conftest import make_model
    from onnx import helper

    import onnx

    data = make_model([helper.make_node("Relu", ["x"], ["out_name"])], [("x", [1, 8])],
                      [("out_name", [1, 8])]).SerializeToString()
    path = tmp_path / "bad.onnx"
    path.write_bytes(data.replace(text, text[:-1] + b"\xff"))
    node = onnx.load(str(path)).graph.node[0]
    assert isinstance(node.op_type if text == b"Relu" else node.output[0], bytes)
    res = shard_cli("compile", path, "--target", "cpu")
    assert_one_line_error(res, "is not UTF-8 text")


@pytest.mark.parametrize("reference, fragment", [
    ("other-output", "is not the model this bundle was compiled from"),
    ("other-input", "is not the model this bundle was compiled from"),
    ("other-shape", "input x has shape [1, 4]; the bundle's is [1, 8]")])
def test_verify_refuses_a_reference_that_is_another_model(tmp_path, reference, fragment):
    from conftest import make_model
    from onnx import helper

    import onnx

    onnx.save(add_model([1, 8]), tmp_path / "m.onnx")
    assert shard_cli("compile", tmp_path / "m.onnx", "--target", "cpu").returncode == 0
    x, y = {"other-input": ("q", "y"), "other-output": ("x", "z"), "other-shape": ("x", "y")}[reference]
    width = 4 if reference == "other-shape" else 8
    onnx.save(make_model([helper.make_node("Relu", [x], [y])], [(x, [1, width])], [(y, [1, width])]),
              tmp_path / "other.onnx")
    res = shard_cli("verify", tmp_path / "m.shard", "--reference", tmp_path / "other.onnx", "--backend", "cpu")
    assert_one_line_error(res, fragment)


def test_run_save_onto_a_file_is_refused_before_the_run(tmp_path):
    import onnx

    onnx.save(add_model([1, 8]), tmp_path / "m.onnx")
    assert shard_cli("compile", tmp_path / "m.onnx", "--target", "cpu").returncode == 0
    (tmp_path / "out").write_text("the user's file")
    res = shard_cli("run", tmp_path / "m.shard", "--backend", "cpu", "--save", tmp_path / "out")
    assert_one_line_error(res, "a file is there; --save names a folder")
    assert "ms per run" not in res.stdout
    assert (tmp_path / "out").read_text() == "the user's file"


def test_verify_takes_a_reference_whose_dynamic_dimension_is_minus_one(tmp_path):
    # PP-OCR's classifier declares x as [-1, 3, ?, ?]: the -1 is as dynamic as a name, and the check of
    # the reference against the bundle refused it (seen on the packaged corpus).
    from conftest import make_model
    from onnx import helper

    import onnx

    onnx.save(make_model([helper.make_node("Relu", ["x"], ["y"])], [("x", [-1, 8])], [("y", [-1, 8])]),
              tmp_path / "m.onnx")
    assert shard_cli("compile", tmp_path / "m.onnx", "--target", "cpu", "--input-shape", "x=1,8").returncode == 0
    res = shard_cli("verify", tmp_path / "m.shard", "--reference", tmp_path / "m.onnx", "--backend", "cpu")
    assert res.returncode == 0 and "PASS" in res.stdout, res.stdout + res.stderr


def rate_switch_model(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    import corpus

    return corpus.rate_switch(tmp_path / "vad.onnx")


def test_an_if_chosen_at_run_time_is_refused_naming_the_input_to_fix(tmp_path):
    res = shard_cli("compile", rate_switch_model(tmp_path), "--target", "cpu")
    assert_one_line_error(res, "If node 'switch' decides at run time", "--input-value NAME=VALUE (sr)")
    assert not (tmp_path / "vad.shard").exists()


@pytest.mark.parametrize("value, fragment", [("sr16000", "expected NAME=V0,V1"), ("rate=1", "has no input 'rate'"),
                                             ("sr=1,2", "2 values; input sr has shape []")])
def test_a_bad_input_value_is_refused(tmp_path, value, fragment):
    res = shard_cli("compile", rate_switch_model(tmp_path), "--target", "cpu", "--input-value", value)
    assert_one_line_error(res, fragment)


def test_an_input_fixed_at_compile_inlines_its_if_and_a_run_checks_it(tmp_path):
    import numpy as np
    import onnxruntime as ort

    import shard

    model = rate_switch_model(tmp_path)
    for sr in (16000, 8000):
        out = tmp_path / f"vad{sr}.shard"
        res = shard_cli("compile", model, "--target", "cpu", "-o", out, "--input-value", f"sr={sr}")
        assert res.returncode == 0, res.stderr
        x = np.random.default_rng(sr).standard_normal((1, 64)).astype(np.float32)
        want = ort.InferenceSession(str(model)).run(None, {"x": x, "sr": np.array(sr, np.int64)})[0]
        with shard.load(out, backend="cpu") as session:
            assert [t.name for t in session.manifest.inputs] == ["x"]
            np.testing.assert_allclose(session.run({"x": x})["y"], want, atol=1e-5)   # the branch sr chose
            np.testing.assert_allclose(session.run({"x": x, "sr": np.array(sr)})["y"], want, atol=1e-5)
            with pytest.raises(shard.errors.RunError, match=f"compiled for sr={sr}"):
                session.run({"x": x, "sr": np.array(44100)})
        verified = shard_cli("verify", out, "--reference", model, "--backend", "cpu")
        assert verified.returncode == 0 and "PASS" in verified.stdout, verified.stdout + verified.stderr


def test_a_bundle_without_fixed_inputs_writes_its_manifest_as_before(tmp_path):
    """The manifest's input_values is written only where an input was fixed: a bundle compiled before
    the field existed keeps its digest (and is not called damaged)."""
    import json

    import onnx

    from shard.bundle import read_manifest

    model = tmp_path / "m.onnx"
    onnx.save(add_model([1, 8]), model)
    assert shard_cli("compile", model, "--target", "cpu").returncode == 0
    assert "input_values" not in json.loads((tmp_path / "m.shard" / "manifest.json").read_text())
    assert read_manifest(tmp_path / "m.shard").input_values == {}


def test_several_models_for_several_targets_each_get_a_bundle_and_one_failing_stops_none(tmp_path):
    import onnx

    for name in ("a", "b"):
        onnx.save(add_model([1, 8]), tmp_path / f"{name}.onnx")
    (tmp_path / "broken.onnx").write_text("not a model")
    res = shard_cli("compile", tmp_path / "a.onnx", tmp_path / "broken.onnx", tmp_path / "b.onnx", "--target", "cpu,thor")
    assert_one_line_error(res, "2 of 6 compiles failed (broken.onnx for cpu, broken.onnx for thor)")
    assert sorted(p.name for p in tmp_path.glob("*.shard")) == ["a-cpu.shard", "a-thor.shard", "b-cpu.shard",
                                                                "b-thor.shard"]
    assert "6/6: " in res.stdout and f"failed: {tmp_path / 'broken.onnx'} for cpu:" in res.stderr
    res = shard_cli("compile", tmp_path / "a.onnx", tmp_path / "b.onnx", "-o", tmp_path / "x.shard")
    assert_one_line_error(res, "-o names one bundle")
    res = shard_cli("probe", "--target", "rk3588,rk3576", "-o", tmp_path / "p.json")
    assert_one_line_error(res, "-o names one profile")


def test_a_pack_is_never_written_into_its_bundle_nor_over_a_file(save, tmp_path):
    model = save(add_model([1, 4]))
    assert shard_cli("compile", model, "--target", "cpu", "-o", tmp_path / "m.shard").returncode == 0
    assert_one_line_error(shard_cli("pack", tmp_path / "m.shard", "-o", tmp_path / "m.shard" / "p.tar.gz"),
                          "inside the bundle")
    assert_one_line_error(shard_cli("pack", tmp_path / "m.shard", "-o", tmp_path / "no" / "p.tar.gz"), "no folder")
    (tmp_path / "p.tar.gz").write_text("mine")
    assert_one_line_error(shard_cli("pack", tmp_path / "m.shard", "-o", tmp_path / "p.tar.gz"), "pass --force")
    assert (tmp_path / "p.tar.gz").read_text() == "mine"
    assert shard_cli("pack", tmp_path / "m.shard", "-o", tmp_path / "p.tar.gz", "--force").returncode == 0
    assert not (tmp_path / "m.shard" / "p.tar.gz").exists()


def test_a_packs_runtime_code_runs_only_as_it_was_packed(save, tmp_path):
    # The pack's bundled runtime had no recorded hash: an edited copy ran.
    import subprocess
    import sys
    import tarfile

    model = save(add_model([1, 4]))
    assert shard_cli("compile", model, "--target", "cpu", "-o", tmp_path / "m.shard").returncode == 0
    assert shard_cli("pack", tmp_path / "m.shard", "-o", tmp_path / "m.tar.gz").returncode == 0
    with tarfile.open(tmp_path / "m.tar.gz") as tar:
        tar.extractall(tmp_path / "out", filter="data")
    here = tmp_path / "out" / "m"

    def run(*args, cwd=here):
        return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=300)

    assert run("run.py", "--backend", "cpu").returncode == 0
    code = here / "shard" / "runtime" / "__init__.py"
    original = code.read_bytes()
    code.write_bytes(original + b"\nprint('edited')\n")
    for args in (("run.py", "--backend", "cpu"), ("-m", "shard.runtime", "bundle", "--backend", "cpu")):
        res = run(*args)
        assert res.returncode == 1 and "edited" not in res.stdout, res.stdout + res.stderr
        assert "__init__.py: not the runtime code this pack was made with" in res.stderr, res.stderr
    code.write_bytes(original)
    (here / "shard" / "runtime" / "extra.py").write_text("")
    res = run("run.py", "--backend", "cpu")
    assert res.returncode == 1 and "extra.py: not the runtime code" in res.stderr
    (here / "shard" / "runtime" / "extra.py").unlink()
    assert run("run.py", "--backend", "cpu").returncode == 0   # __pycache__ the runs wrote is Python's own


@pytest.mark.parametrize("args, written", [
    (["compile", "--help"], "Bundle directory [default: MODEL.shard]."),
    (["act", "--help"], "An .npz of pixel_values [cameras, 3, S, S], tokens [T] and state [1, actions]"),
    (["zoo", "export", "--help"], "[default: the real model's]"),   # a command of a sub-app
])
def test_help_prints_bracketed_text_as_written(args, written):
    # typer reads help as rich markup: "[default: MODEL.shard]" was a tag, and vanished
    import re

    res = shard_cli(*args)
    assert res.returncode == 0, res.stderr
    assert written in re.sub(r"[│\s]+", " ", res.stdout), res.stdout
