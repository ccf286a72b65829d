"""Shape buckets: one bundle, a variant per sequence length; an input runs on the smallest bucket it
fits, padded (the attention mask masks the padding out) and cut back."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest
from conftest import cosine, shard_cli

from shard.calibration import run_each
from shard.compilation import compile_model
from shard.options import CompileOptions
from shard.errors import RunError
from shard.runtime import load
from shard.runtime.buckets import read_buckets
from shard.verifier import verify_bundle

BUCKETS = [{"input_ids": (1, 16), "attention_mask": (1, 16)}, {"input_ids": (1, 64), "attention_mask": (1, 64)},
           {"input_ids": (1, 32), "attention_mask": (1, 32)}]


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """A two-layer BERT exported with a dynamic sequence axis, as users export them."""
    torch = pytest.importorskip("torch")
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512,
                        vocab_size=1000)
    cfg._attn_implementation = "eager"
    model = tf.BertModel(cfg).eval()

    class Encoder(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, ids, mask):
            return self.inner(input_ids=ids, attention_mask=mask).last_hidden_state

    path = tmp_path_factory.mktemp("buckets") / "bert.onnx"
    ids, mask = torch.randint(0, 1000, (1, 32)), torch.ones(1, 32, dtype=torch.int64)
    with torch.no_grad():
        torch.onnx.export(Encoder(model), (ids, mask), str(path), opset_version=17, dynamo=False,
                          input_names=["input_ids", "attention_mask"], output_names=["last_hidden_state"],
                          dynamic_axes={"input_ids": {1: "seq"}, "attention_mask": {1: "seq"},
                                        "last_hidden_state": {1: "seq"}})
    return path


def sentence(length: int, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(0, 1000, (1, length)).astype(np.int64),
            "attention_mask": np.ones((1, length), np.int64)}


def check_between_buckets(bundle, model, backend: str) -> None:
    x = sentence(40)
    want = next(run_each(onnx.load(str(model)), [x], ["last_hidden_state"]))["last_hidden_state"]
    with load(bundle, backend=backend) as session:
        got = session.run(x)["last_hidden_state"]
        assert session.runs == {"b0": 0, "b1": 0, "b2": 1}   # 40 tokens: the 64 bucket
        with pytest.raises(RunError, match="fit no bucket"):
            session.run(sentence(65))
    assert got.shape == (1, 40, 128) and cosine(want, got) >= 0.9999


def test_buckets_on_the_cpu(bert, tmp_path):
    result = compile_model(bert, "cpu", tmp_path / "bert.shard", CompileOptions(buckets=BUCKETS))
    spec = read_buckets(result.bundle)
    assert [b.inputs["input_ids"] for b in spec.buckets] == [[1, 16], [1, 32], [1, 64]]   # smallest first
    assert spec.crop == {"last_hidden_state": {"1": ["input_ids", 1]}}
    for b in spec.buckets:
        assert verify_bundle(result.bundle / b.name, bert, backend="cpu").passed
    # --timeout and the others reach each bucket's session; a stream is one bucket's (they were ignored).
    res = shard_cli("run", result.bundle, "--backend", "cpu", "--timeout", "0.000001", "--repeat", "20")
    assert res.returncode == 1 and "timeout" in res.stderr and "Traceback" not in res.stderr, res.stderr
    res = shard_cli("run", result.bundle, "--backend", "cpu", "--stream", "4")
    assert res.returncode == 1 and "run one bucket" in res.stderr and "Traceback" not in res.stderr
    # The runtime alone runs a bucketed bundle (it said "not a shard bundle (no manifest.json)").
    res = subprocess.run([sys.executable, "-m", "shard.runtime", str(result.bundle), "--backend", "cpu"],
                         capture_output=True, text=True)
    assert res.returncode == 0 and "output last_hidden_state: shape [1, 16, 128]" in res.stdout, res.stderr
    check_between_buckets(result.bundle, bert, "cpu")


def test_bucket_shapes_are_checked(bert, tmp_path):
    res = shard_cli("compile", bert, "--target", "cpu", "--input-shape", "input_ids=1,16|1,32",
                    "--input-shape", "attention_mask=1,16|1,32|1,64")
    assert res.returncode == 1 and "same number of shapes" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.toolkit
def test_buckets_on_the_simulator(bert, tmp_path):
    res = shard_cli("compile", bert, "-o", tmp_path / "bert.shard", "--input-shape", "input_ids=1,16|1,32|1,64",
                    "--input-shape", "attention_mask=1,16|1,32|1,64")
    assert res.returncode == 0, res.stderr
    res = shard_cli("verify", tmp_path / "bert.shard", "-r", bert, "--backend", "sim", "--min-cosine", "0.9999")
    assert res.returncode == 0 and "on every bucket (3)" in res.stdout, res.stdout + res.stderr
    check_between_buckets(tmp_path / "bert.shard", bert, "sim")
