from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

DATA = Path(__file__).parent / "data"


def pytest_configure(config):
    # Vendor builds are cached by content; each test run starts with an empty cache of its own, so a
    # build a test means to make (a timeout, a crash) is made. What the code under test puts in the
    # temporary folder (the logs a failed compile keeps, by design) goes to one folder of the run's
    # own, removed at its end; pytest's tmp_path stays where it was.
    import tempfile

    config.shard_saved_env = {k: os.environ.get(k) for k in ("TMPDIR", "SHARD_BUILD_CACHE", "PYTEST_DEBUG_TEMPROOT")}
    # Under pytest-xdist (`make test` runs two workers) each worker is a run of its own, its folder beside
    # the others' rather than inside the controller's: a Ray session's socket path must stay under 108 bytes.
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
    root = tempfile.mkdtemp(prefix="shard-test-", dir=os.environ["PYTEST_DEBUG_TEMPROOT"])
    os.environ["TMPDIR"] = tempfile.tempdir = root
    os.environ["SHARD_BUILD_CACHE"] = os.path.join(root, "builds")


def pytest_unconfigure(config):
    import shutil
    import tempfile

    root, tempfile.tempdir = tempfile.tempdir, None
    for key, value in config.shard_saved_env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    shutil.rmtree(root, ignore_errors=True)


def toolkit_ready() -> bool:
    from shard.targets.rknn.env import read_marker

    return read_marker("rk3588") is not None


def pytest_collection_modifyitems(config, items):
    if toolkit_ready():
        return
    skip = pytest.mark.skip(reason="rknn-toolkit2 environment not installed (run `shard toolkit install rk3588`)")
    for item in items:
        if "toolkit" in item.keywords:
            item.add_marker(skip)


def make_model(nodes, inputs, outputs, initializers=(), opset=17) -> onnx.ModelProto:
    """A model from onnx.helper pieces; inputs/outputs are (name, shape) with float32 elements."""
    vi = lambda name, shape: helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)  # noqa: E731
    graph = helper.make_graph(nodes, "g", [vi(*i) for i in inputs], [vi(*o) for o in outputs],
                              initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def write_manifest(bundle: Path, edit) -> None:
    """Change a bundle's manifest with `edit(data)` and seal it again, as a compile that wrote it so
    would (for the checks behind the manifest's digest)."""
    import json

    from shard.bundle import MANIFEST, Manifest

    data = json.loads((bundle / MANIFEST).read_text())
    edit(data)
    (bundle / MANIFEST).write_text(Manifest.from_dict(data).to_json())


def add_model(shape) -> onnx.ModelProto:
    return make_model([helper.make_node("Add", ["x", "x"], ["y"], name="add0")], [("x", shape)], [("y", shape)])


def mlp_chain(blocks: int, width: int = 16, seed: int = 0) -> onnx.ModelProto:
    """Residual blocks y = x + relu(x @ W1) @ W2 in a chain: cut points between blocks carry one tensor."""
    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "x"
    for b in range(blocks):
        w1 = helper.make_tensor(f"w1_{b}", TensorProto.FLOAT, [width, 2 * width],
                                rng.standard_normal((width, 2 * width)).astype(np.float32).ravel())
        w2 = helper.make_tensor(f"w2_{b}", TensorProto.FLOAT, [2 * width, width],
                                rng.standard_normal((2 * width, width)).astype(np.float32).ravel() / width)
        inits += [w1, w2]
        out = "y" if b == blocks - 1 else f"r{b}"
        nodes += [helper.make_node("MatMul", [x, f"w1_{b}"], [f"h{b}"], name=f"fc1_{b}"),
                  helper.make_node("Relu", [f"h{b}"], [f"a{b}"], name=f"relu_{b}"),
                  helper.make_node("MatMul", [f"a{b}", f"w2_{b}"], [f"m{b}"], name=f"fc2_{b}"),
                  helper.make_node("Add", [x, f"m{b}"], [out], name=f"res_{b}")]
        x = out
    return make_model(nodes, [("x", [1, 8, width])], [("y", [1, 8, width])], inits)


def cosine(a, b) -> float:
    """Cosine of two arrays as verify computes it (NaN where either holds NaN)."""
    from shard.verifier import compare

    return compare("", a, b).cosine


def run_ort(model: onnx.ModelProto, feeds: dict, optimize: bool = True) -> list[np.ndarray]:
    """The model's outputs in onnxruntime (shard.calibration.ort_session); optimize=False: no graph
    fusions, so graphs that differ by exact rewrites round alike."""
    from shard.calibration import ort_session

    session = ort_session(model, optimize=optimize)
    return session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})


def shard_cli(*args, env_extra: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    """Run the real `shard` command line in a child process."""
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "shard", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=900)


@pytest.fixture
def save(tmp_path):
    def save(model: onnx.ModelProto, name: str = "model.onnx") -> Path:
        path = tmp_path / name
        onnx.save(model, str(path))
        return path
    return save


def assert_one_line_error(res, *fragments):
    """The CLI failed with exit code 1 and one `error:` line holding each fragment, no traceback."""
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr
    lines = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, res.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
