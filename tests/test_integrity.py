"""Damaged bundles, generative bundles and packs never give a silently different answer: a run either
equals the clean run bit for bit or stops with one line (a ShardError). Before, a byte flipped in a pack ran with exit 0
and another output: gzip's CRC went unseen and nothing recorded the files' hashes."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from conftest import mlp_chain
from test_generative import checkpoint  # noqa: F401 - a fixture
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shard
from shard.options import CompileOptions
from shard.errors import ShardError
from shard.pack import pack_bundle
from shard.packed import check_runtime
from shard.runtime.__main__ import unpack

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                            HealthCheck.too_slow])


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """A small cpu bundle, its pack, an input and the clean run's outputs."""
    folder = tmp_path_factory.mktemp("clean")
    model = folder / "m.onnx"
    import onnx

    onnx.save(mlp_chain(2), model)
    bundle = shard.compile(model, "cpu", folder / "m.shard", CompileOptions(shards=2)).bundle
    pack = pack_bundle(bundle, folder / "m.tar.gz", with_onnx=True)
    x = {"x": np.random.default_rng(0).standard_normal((1, 8, 16)).astype(np.float32)}
    with shard.load(bundle, backend="cpu") as session:
        outputs = session.run(x)
    return bundle, pack, x, outputs


def one_line(exc: ShardError) -> None:
    assert "\n" not in str(exc).strip(), str(exc)


def run_or_refuse(bundle, x, want) -> None:
    """The property: the same outputs, bit for bit, or a ShardError of one line."""
    try:
        with shard.load(bundle, backend="cpu") as session:
            got = session.run(x)
    except ShardError as exc:
        return one_line(exc)
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype and np.array_equal(got[name], want[name], equal_nan=True), name


def damage(path, data: st.DataObject) -> None:
    raw = bytearray(path.read_bytes())
    if data.draw(st.booleans(), label="truncate") or not raw:
        del raw[data.draw(st.integers(0, max(len(raw) - 1, 0)), label="at"):]
    else:
        at = data.draw(st.integers(0, len(raw) - 1), label="at")
        raw[at] ^= data.draw(st.integers(1, 255), label="xor")
    path.write_bytes(bytes(raw))


@SETTINGS
@given(data=st.data())
def test_a_damaged_bundle_runs_as_it_was_or_stops_in_one_line(clean, tmp_path, data):
    bundle, _, x, want = clean
    copy = tmp_path / "copy.shard"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(bundle, copy)
    files = sorted(p for p in copy.rglob("*") if p.is_file())
    damage(data.draw(st.sampled_from(files), label="file"), data)
    run_or_refuse(copy, x, want)


@SETTINGS
@given(data=st.data())
def test_a_damaged_pack_runs_as_it_was_or_stops_in_one_line(clean, tmp_path, data):
    _, pack, x, want = clean
    work = tmp_path / "pack"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    copy = work / "m.tar.gz"
    shutil.copyfile(pack, copy)
    damage(copy, data)
    try:
        bundle = unpack(copy, work / "out")
    except ShardError as exc:
        return one_line(exc)
    try:   # the pack's own runtime code, as run.py checks it before importing any of it
        check_runtime(bundle.parent)
    except SystemExit as exc:
        return assert_one_error_line(str(exc.code))
    run_or_refuse(bundle, x, want)


def assert_one_error_line(text: str) -> None:
    assert text.startswith("error: ") and "\n" not in text.strip(), text


@pytest.fixture(scope="module")
def generative(checkpoint, tmp_path_factory):
    """A cpu generative bundle of the 2-layer Llama (test_generative), and its clean answer to a chat
    prompt in text: the prompt's ids, the new tokens, the text."""
    from shard.compilation.generative import compile_generative
    from shard.runtime.generate import GenerativeSession

    bundle = compile_generative(checkpoint[0], "cpu", tmp_path_factory.mktemp("lm") / "lm.shard", capacity=16,
                                chunk=4).bundle
    with GenerativeSession(bundle, backend="cpu") as session:
        out = session.generate("w5 w17 w3", max_new_tokens=4, chat=True)
    return bundle, (out.prompt, out.tokens, out.text)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(data=st.data())
def test_a_damaged_generative_bundle_answers_as_it_did_or_stops_in_one_line(generative, tmp_path, data):
    # Its tokenizer had no hash: a swapped tokenizer.json changed the text with exit 0.
    from shard.runtime.generate import GenerativeSession

    bundle, want = generative
    copy = tmp_path / "copy.shard"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(bundle, copy)
    files = sorted(p for p in copy.rglob("*") if p.is_file())
    damage(data.draw(st.sampled_from(files), label="file"), data)
    try:
        with GenerativeSession(copy, backend="cpu") as session:
            out = session.generate("w5 w17 w3", max_new_tokens=4, chat=True)
    except ShardError as exc:
        return one_line(exc)
    assert (out.prompt, out.tokens, out.text) == want


def test_a_pack_that_unpacks_past_its_limit_or_holds_two_bundles_is_refused(clean, tmp_path):
    import gzip
    import io
    import tarfile

    _, pack, _, _ = clean
    bomb = tmp_path / "bomb.tar.gz"
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        info = tarfile.TarInfo("m/bundle/zeros")
        info.size = 200 * 2**20
        tar.addfile(info, io.BytesIO(bytes(info.size)))
    bomb.write_bytes(gzip.compress(raw.getvalue()))
    assert bomb.stat().st_size < 2**20
    with pytest.raises(ShardError, match="unpacks to more than"):
        unpack(bomb, tmp_path / "bomb")
    two = tmp_path / "two.tar.gz"
    with tarfile.open(pack) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers() if m.isfile()]
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for prefix in ("a", "b"):
            for member, content in members:
                info = tarfile.TarInfo(f"{prefix}{member.name}")
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
    two.write_bytes(gzip.compress(raw.getvalue()))
    with pytest.raises(ShardError, match="2 NAME/bundle/manifest.json or generative.json inside, one expected"):
        unpack(two, tmp_path / "two")
