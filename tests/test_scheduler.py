"""The runtime's scheduler on real onnxruntime shards: order, parallelism, pipelining, failures, trace."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import make_model, shard_cli
from onnx import TensorProto, helper

import shard
from shard.bundle import MANIFEST, Manifest, ShardSpec, TensorSpec, record_files
from shard.errors import RunError
from shard.runtime.scheduler import shard_dependencies

N = 256


def tanh_chain(src: str, dst: str, steps: int, seed: int) -> onnx.ModelProto:
    """dst = tanh(... tanh(src @ W) ... @ W): `steps` MatMuls of [N,N], a shard whose cost we choose."""
    w = np.random.default_rng(seed).standard_normal((N, N)).astype(np.float32) / np.sqrt(N)
    nodes, x = [], src
    for k in range(steps):
        out = dst if k == steps - 1 else f"{dst}_t{k}"
        nodes += [helper.make_node("MatMul", [x, "w"], [f"{dst}_m{k}"]), helper.make_node("Tanh", [f"{dst}_m{k}"], [out])]
        x = out
    return make_model(nodes, [(src, [N, N])], [(dst, [N, N])], [helper.make_tensor("w", TensorProto.FLOAT, [N, N], w)])


def add_shard(a: str, b: str, dst: str) -> onnx.ModelProto:
    return make_model([helper.make_node("Add", [a, b], [dst])], [(a, [N, N]), (b, [N, N])], [(dst, [N, N])])


def write_bundle(root: Path, shards: list[tuple[onnx.ModelProto, int]], graph_inputs=("x",), graph_outputs=("y",)) -> Path:
    """A bundle written by hand: each (model, core) becomes shard_NNN with its ONNX file."""
    (root / "shards").mkdir(parents=True)
    specs, known = [], {}
    for k, (model, core) in enumerate(shards):
        def tensors(values):
            out = []
            for v in values:
                t = v.type.tensor_type
                out.append(TensorSpec(v.name, [d.dim_value for d in t.shape.dim],
                                      onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name))
                known[v.name] = out[-1]
            return out

        name = f"shard_{k:03d}"
        onnx.save(model, root / "shards" / f"{name}.onnx")
        macs = sum(1 for n in model.graph.node if n.op_type == "MatMul") * N ** 3
        specs.append(ShardSpec(name, f"shards/{name}.onnx", None, None, tensors(model.graph.input),
                               tensors(model.graph.output), core, "fp32", macs))
    manifest = Manifest("cpu", {"name": "hand", "sha256": ""}, {}, {}, [known[n] for n in graph_inputs],
                        [known[n] for n in graph_outputs], specs)
    record_files(root, manifest)   # as a compile writes it: each file's size and sha256
    (root / MANIFEST).write_text(manifest.to_json())
    return root


@pytest.fixture
def diamond(tmp_path) -> Path:
    """x -> a; a -> b and a -> c (independent, each about as costly); b + c -> y."""
    return write_bundle(tmp_path / "diamond.shard", [(tanh_chain("x", "a", 2, 0), 0), (tanh_chain("a", "b", 100, 1), 1),
                                                     (tanh_chain("a", "c", 100, 2), 2), (add_shard("b", "c", "y"), 0)])


def frames(count: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((N, N)).astype(np.float32)} for _ in range(count)]


@pytest.mark.parametrize("schedule", ["round-robin", "balanced"])
def test_stream_outputs_equal_sequential_runs_bitwise(diamond, schedule):
    inputs = frames(7)
    with shard.load(diamond, backend="cpu", cores=[0]) as one:
        expected = [one.run(f)["y"] for f in inputs]
    with shard.load(diamond, backend="cpu", cores=[0, 1, 2], schedule=schedule) as session:
        got = [out["y"] for out in session.run_stream(inputs, depth=3)]
        assert {e.core for e in session.executions} == {0, 1, 2}
    assert len(got) == len(expected)
    for k, (a, b) in enumerate(zip(expected, got)):
        assert np.array_equal(a, b), f"frame {k} differs"


@pytest.mark.parametrize("schedule", ["round-robin", "balanced"])
def test_every_shard_starts_after_its_producers(diamond, schedule):
    with shard.load(diamond, backend="cpu", cores=[0, 1], schedule=schedule) as session:
        list(session.run_stream(frames(5)))
        runs = {(e.frame, e.shard): e for e in session.executions}
        deps = shard_dependencies(session.manifest.shards)
        names = [s.name for s in session.manifest.shards]
    assert len(runs) == 5 * 4 == len(session.executions)  # every shard of every frame, once
    for (frame, name), run in runs.items():
        for producer in deps[names.index(name)]:
            assert run.start >= runs[(frame, names[producer])].end


@pytest.mark.parametrize("schedule", ["round-robin", "balanced"])
def test_independent_shards_run_on_different_cores_at_once(diamond, schedule):
    with shard.load(diamond, backend="cpu", cores=[0, 1, 2], schedule=schedule) as session:
        session.run(frames(1)[0])
        b, c = (next(e for e in session.executions if e.shard == n) for n in ("shard_001", "shard_002"))
    assert b.core != c.core
    assert max(b.start, c.start) < min(b.end, c.end), "the two branches did not overlap"


def test_round_robin_keeps_the_manifest_placement_and_rotates_on_fewer_cores(diamond):
    with shard.load(diamond, backend="cpu", cores=[0, 1, 2], schedule="round-robin") as session:
        list(session.run_stream(frames(3)))
        placed = {s.name: s.core for s in session.manifest.shards}
        assert all(e.core == placed[e.shard] for e in session.executions)
    with shard.load(diamond, backend="cpu", cores=[0, 1], schedule="round-robin") as session:
        list(session.run_stream(frames(2)))
        per_core = [sum(1 for e in session.executions if e.core == c) for c in (0, 1)]
    assert per_core == [4, 4]  # 4 shards x 2 frames, rotated: each core runs half


def test_stream_reads_frames_only_as_fast_as_they_leave(diamond):
    pulled = 0

    def source():
        nonlocal pulled
        for f in frames(10):
            pulled += 1
            yield f

    ahead = []
    with shard.load(diamond, backend="cpu", cores=[0, 1]) as session:
        for k, _ in enumerate(session.run_stream(source(), depth=3)):
            ahead.append(pulled - k)
    assert ahead[0] == 3  # three frames in flight, not ten
    assert max(ahead) <= 3 and pulled == 10


def test_failing_shard_stops_the_stream_with_its_name_and_message(tmp_path):
    gather = helper.make_model(helper.make_graph(
        [helper.make_node("Gather", ["a", "idx"], ["y"], axis=0)], "g",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [N, N]),
         helper.make_tensor_value_info("idx", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, N])]), opset_imports=[helper.make_opsetid("", 17)])
    gather.ir_version = 8
    bundle = write_bundle(tmp_path / "g.shard", [(tanh_chain("x", "a", 1, 0), 0), (gather, 1)],
                          graph_inputs=("x", "idx"))
    inputs = [{**f, "idx": np.array([i], np.int64)} for f, i in zip(frames(4), [0, 1, N + 5, 2])]
    got = []
    with shard.load(bundle, backend="cpu", cores=[0, 1]) as session:
        with pytest.raises(RunError, match=r"shard_001: .*(out of bounds|out of range|indices).*frame 2") as info:
            for out in session.run_stream(inputs, depth=1):
                got.append(out)
        assert len(got) == 2  # frames 0 and 1, then the error: frame 2 is not skipped silently
        with pytest.raises(RunError) as again:
            session.run(inputs[0])
        assert str(again.value) == str(info.value)


def test_hanging_shard_times_out_instead_of_hanging(tmp_path):
    bundle = write_bundle(tmp_path / "slow.shard", [(tanh_chain("x", "a", 1, 0), 0), (tanh_chain("a", "y", 1000, 1), 1)],
                          graph_inputs=("x",), graph_outputs=("y",))
    with shard.load(bundle, backend="cpu", cores=[0, 1]) as session:
        started = time.perf_counter()
        session.run(frames(1)[0])
        full = time.perf_counter() - started
    with shard.load(bundle, backend="cpu", cores=[0, 1], schedule="round-robin", timeout=full / 20) as session:
        started = time.perf_counter()
        with pytest.raises(RunError, match=r"shard_001 \(frame 0, core 1\) ran past its .* s timeout"):
            session.run(frames(1)[0])
        assert time.perf_counter() - started < full / 2  # the run did not wait for the slow shard
        assert session.scheduler.busy_cores() == [1]


def test_a_one_shard_frame_run_on_the_calling_thread_is_a_cores_run(tmp_path, diamond):
    # Scheduler.run_here (what a one-stage GPU session's run() takes): the same outputs as the
    # core's thread gives, recorded as a run; its failure raises to the caller and stops nothing.
    bundle = write_bundle(tmp_path / "one.shard", [(tanh_chain("x", "y", 3, 0), 0)])
    inputs = frames(3)
    with shard.load(bundle, backend="cpu") as session:
        assert not session.here   # a cpu session keeps its cores' threads
        want = [session.run(f)["y"] for f in inputs]
        got = [session.scheduler.run_here(100 + k, f)["y"] for k, f in enumerate(inputs)]
        assert all(np.array_equal(a, b) for a, b in zip(want, got))
        assert [(e.shard, e.frame, e.core) for e in session.executions[3:]] == [("shard_000", 100 + k, 0) for k in range(3)]
        with pytest.raises(RunError, match=r"shard_000: .* \(frame 200, core 0\)$"):
            session.scheduler.run_here(200, {"x": np.zeros((N, 3), np.float32)})
        assert np.array_equal(session.run(inputs[0])["y"], want[0])
    with shard.load(diamond, backend="cpu", cores=[0]) as session, \
            pytest.raises(RunError, match="only through one shard; this bundle has 4"):
        session.scheduler.run_here(0, inputs[0])


def test_trace_has_one_track_per_core_and_matches_the_utilisation(diamond, tmp_path):
    with shard.load(diamond, backend="cpu", cores=[0, 1, 2]) as session:
        list(session.run_stream(frames(4)))
        trace = json.loads(session.write_trace(tmp_path / "t.json").read_text())
        use = {u.core: u for u in session.core_use()}
    events = trace["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert tracks == {0: "core 0", 1: "core 1", 2: "core 2"}
    runs = [e for e in events if e["ph"] == "X"]
    assert len(runs) == 16 and all(e["args"]["bytes_in"] > 0 and e["args"]["bytes_out"] > 0 for e in runs)
    span = max(e["ts"] + e["dur"] for e in runs) - min(e["ts"] for e in runs)
    for core in (0, 1, 2):
        busy = sum(e["dur"] for e in runs if e["tid"] == core)
        assert busy / span == pytest.approx(use[core].utilisation, abs=1e-4)


def test_cli_stream_prints_throughput_utilisation_and_writes_the_trace(diamond, tmp_path):
    out = shard_cli("run", diamond, "--backend", "cpu", "--stream", "4", "--cores", "0,1,2",
                    "--schedule", "round-robin", "--trace", tmp_path / "t.json")
    assert out.returncode == 0, out.stderr
    assert "4 frames in" in out.stdout and "frames/s" in out.stdout
    assert all(f"core {c}:" in out.stdout for c in (0, 1, 2))
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]


@pytest.mark.parametrize("args, message", [(["--cores", "0,x"], "--cores '0,x'"), (["--cores", "1,1"], "distinct"),
                                           (["--schedule", "fastest"], "unknown schedule 'fastest'")])
def test_cli_refuses_bad_scheduling_options(diamond, args, message):
    out = shard_cli("run", diamond, "--backend", "cpu", *args)
    assert out.returncode == 1 and message in out.stderr and "Traceback" not in out.stderr


def test_predicted_stream_follows_the_cores_and_the_policy():
    from shard.bundle import ShardSpec, TensorSpec
    from shard.runtime.scheduler import predict_stream

    edge = lambda n: TensorSpec(n, [1], "float32")  # noqa: E731
    chain = [ShardSpec(f"s{k}", "", None, None, [edge(f"e{k}")], [edge(f"e{k + 1}")], k, "fp16", macs=1)
             for k in range(3)]
    for cores, rate in (([0], 1 / 3), ([0, 1], 2 / 3), ([0, 1, 2], 1.0)):
        latency, fps = predict_stream(chain, [1.0, 1.0, 1.0], cores, "balanced")
        assert latency == 3.0 and 0.98 * rate <= fps <= rate + 1e-9
    # round-robin on the manifest's cores: the slowest shard's core sets the pace
    assert abs(predict_stream(chain, [1.0, 2.0, 1.0], [0, 1, 2], "round-robin")[1] - 0.5) < 0.01
    # two independent tiles and their join: on two cores one frame takes 1 + 1, not 1 + 1 + 1
    tiles = [ShardSpec("a", "", None, None, [edge("x")], [edge("ya")], 0, "fp16", macs=1),
             ShardSpec("b", "", None, None, [edge("x")], [edge("yb")], 1, "fp16", macs=1),
             ShardSpec("join", "", None, None, [edge("ya"), edge("yb")], [edge("y")], 0, "fp16", macs=1)]
    assert predict_stream(tiles, [1.0, 1.0, 1.0], [0, 1], "balanced")[0] == 2.0
