"""rk3588 end to end with the real rknn-toolkit2 compiler and simulator (needs the toolkit env)."""

import json

import numpy as np

import pytest
from conftest import add_model, make_model, shard_cli
from onnx import helper, numpy_helper

import shard
from shard.options import CompileOptions
from shard.bundle import read_manifest
from shard.errors import CompileError
from shard.targets.chips import CHIPS, elements

pytestmark = pytest.mark.toolkit


def test_regtask_overflow_fails_compile_and_leaves_nothing(save, tmp_path):
    # With legalize off, the vendor build of the oversize Add returns 0 and logs REGTASK errors.
    res = shard_cli("compile", save(add_model([1, 1, 1, 131072])), "--target", "rk3588", "--disable", "legalize")
    assert res.returncode == 1 and "Traceback" not in res.stderr
    line = next(line for line in res.stderr.splitlines() if line.startswith("error:"))
    # The vendor alone fails the same way: the compile says both fail, naming each build and its log,
    # before it builds anything more.
    assert line.startswith("error: both fail: shard's build of shard_000 is unusable") and "REGTASK lines" not in line
    assert "REGTASK errors" in line and "E RKNN:" in line and "limit: 0x1fff" in line
    assert "the vendor alone's build of the whole model is unusable too: vendor_alone:" in line
    logs = [part.split(")")[0].split(";")[0].strip() for part in line.split("log: ")[1:]]
    assert [log.rsplit("/", 1)[1] for log in logs] == ["shard_000.log", "vendor_alone.log"]
    assert all("REGTASK" in open(log).read() for log in logs)
    assert not (tmp_path / "model.shard").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".model.shard")]


def test_oversize_add_is_legalized_and_verifies_on_sim(save, tmp_path):
    model = save(add_model([1, 1, 1, 131072]))
    res = shard_cli("compile", model, "--target", "rk3588", "-o", tmp_path / "a.shard")
    assert res.returncode == 0, res.stderr
    assert "0 REGTASK lines" in res.stdout and "add-width@h1: N=131072 > 65536 (overflow)" in res.stdout
    manifest = json.loads((tmp_path / "a.shard" / "manifest.json").read_text())
    assert [s["op"] for s in manifest["host_pre"]] == ["slice", "slice"]
    assert all(t["shape"] == [1, 1, 1, 65536] for s in manifest["shards"] for t in s["inputs"] + s["outputs"])
    # The summary charges the shard's hand-off on the board: its inputs set and outputs got on the host.
    handoff = CHIPS["rk3588"].handoff
    moves = sum(handoff.seconds(elements(t["shape"] for t in s["inputs"]), elements(t["shape"] for t in s["outputs"]))
                for s in manifest["shards"])
    assert f"hand-offs {1e3 * moves:.1f} ms (each of {len(manifest['shards'])} shard(s)" in res.stdout
    res = shard_cli("verify", tmp_path / "a.shard", "--reference", model, "--backend", "sim",
                    "--min-cosine", "0.99999", "--json", tmp_path / "v.json")
    assert res.returncode == 0, res.stdout + res.stderr
    verdict = json.loads((tmp_path / "v.json").read_text())
    assert verdict["outputs"][0]["cosine"] >= 0.99999
    # One shard (the model is small) whose two outputs are the pieces, each checked too.
    assert sorted(c["name"] for comps in verdict["shards"].values() for c in comps) == ["add0/part0_out", "add0/part1_out"]


def test_the_vendor_alone_shard_by_shard_is_each_shards_build_without_its_rewrites(save, tmp_path):
    model = save(add_model([1, 1, 1, 131072]))
    res = shard_cli("compile", model, "--target", "rk3588", "-o", tmp_path / "a.shard", "--vendor-alone", "shards")
    assert res.returncode == 0, res.stderr
    assert "vendor alone shard by shard: its whole build is not made (--vendor-alone shards)" in res.stdout
    report = json.loads((tmp_path / "a.shard" / "report.json").read_text())
    versus, (choice,) = report["versus_vendor"], report["choices"]
    assert report["vendor_alone"] is None and report["builds"]["total"] == 2   # the shard and its twin, no more
    # the twin's build, with its hand-off on the board (its input set, its output got) in the cost
    moves = versus["vendor"]["handoff_cycles"]
    assert moves == versus["shard"]["handoff_cycles"] > 0 and choice["unrewritten"]["handoff_cycles"] == 0
    assert versus["vendor"] == {**choice["unrewritten"], "handoff_cycles": moves,
                                "cost_cycles": choice["unrewritten"]["cost_cycles"] + moves}
    assert versus["vendor"]["overflow_lines"] > 0
    assert versus["bundle"] == "shard" and versus["verdict"] == "better"


def test_widest_clean_add_compiles_and_verifies_on_sim(save, tmp_path):
    model = save(add_model([1, 1, 1, 65536]))
    res = shard_cli("compile", model.name, "--target", "rk3588", cwd=tmp_path)  # relative paths too
    assert res.returncode == 0, res.stderr
    assert "0 REGTASK lines" in res.stdout
    report = json.loads((tmp_path / "model.shard" / "report.json").read_text())
    assert report["totals"]["overflow_lines"] == 0
    assert (tmp_path / "model.shard" / "shards" / "shard_000.rknn").stat().st_size > 0
    res = shard_cli("verify", tmp_path / "model.shard", "--reference", model, "--backend", "sim",
                    "--min-cosine", "0.9999", "--json", tmp_path / "v.json")
    assert res.returncode == 0, res.stdout + res.stderr
    verdict = json.loads((tmp_path / "v.json").read_text())
    assert verdict["passed"] and verdict["outputs"][0]["cosine"] >= 0.9999


def test_vendor_crash_names_the_build_and_log_and_shard_builds_without_the_rule(save, tmp_path):
    # 4-D MatMul -> Softmax -> MatMul without the scale Mul: the toolkit's SDPA fusion rule raises, and
    # its log names the rule. The vendor alone stops there (its crash in one line, naming its log);
    # shard builds the shard again with the rule off.
    nodes = [helper.make_node("MatMul", ["q", "k"], ["s"]), helper.make_node("Softmax", ["s"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["y"])]
    model = save(make_model(nodes, [("q", [1, 2, 16, 8]), ("k", [1, 2, 8, 16]), ("v", [1, 2, 16, 8])],
                            [("y", [1, 2, 16, 8])]))
    with pytest.raises(CompileError) as err:
        shard.compile(model, "rk3588", tmp_path / "vendor.shard", CompileOptions(vendor_only=True))
    msg = str(err.value)
    assert msg.startswith("vendor_alone: the vendor build crashed in build()") and "IndexError" in msg
    assert "\n" not in msg
    assert "Traceback" in open(msg.rsplit("log: ", 1)[1]).read()
    assert not (tmp_path / "vendor.shard").exists()
    result = shard.compile(model, "rk3588", tmp_path / "att.shard", CompileOptions(shards=1))
    (d,) = [s["diagnostics"] for s in result.report["shards"]]
    assert d["disabled_rules"] == ["fuse_exmatmul_add_mul_exsoftmax13_exmatmul_to_sdpa"] and "IndexError" in d["crashes"][0]
    (spec,) = read_manifest(result.bundle).shards
    assert spec.build_options["config"]["disable_rules"] == d["disabled_rules"]   # the simulator builds it so too
    assert result.report["totals"]["cpu_ops"] == 0 and result.report["versus_vendor"]["verdict"] == "better"


def test_vendor_only_says_what_it_built_and_no_verdict(save, tmp_path):
    # It printed "shard / vendor alone: ... CPU ops 0 / 1, est. Mcycles 0.0 / 2.7: better": zeros of no build.
    result = shard.compile(save(add_model([1, 64])), "rk3588", tmp_path / "v.shard", CompileOptions(vendor_only=True))
    line = result.report["versus_vendor"]["line"]
    assert line.startswith("vendor alone (--vendor-only, no comparison made): builds yes")
    assert "better" not in line and "shard /" not in line
    # in the chip's own words, as the summary's totals (Target.words)
    assert "REGTASK lines 0" in line and "single-core fallbacks 0" in line and "E lines 0" in line


def test_vendor_timeout_names_shard_and_log(save, tmp_path):
    # The worker's first build imports the toolkit (about 1.7 s): a 0.2 s budget cannot be met.
    with pytest.raises(CompileError, match=r"shard_000: the vendor build timed out \(no answer within 0.2 s; killed\); log: "):
        shard.compile(save(add_model([1, 64])), "rk3588", tmp_path / "t.shard", CompileOptions(timeout=0.2,
                                                                                               build_cache=False))
    assert not (tmp_path / "t.shard").exists()


def test_a_worker_killed_mid_build_leaves_no_scratch(save, tmp_path):
    """The build's scratch (and whatever else the toolkit writes to the temporary folder) lives in
    the worker's own TMPDIR, removed when the process is killed; before, each killed build left its
    check*.onnx files in /tmp for good."""
    import threading
    import time

    from shard.targets.rknn.target import RknnTarget
    from shard.targets.rknn.env import find_python
    from shard.targets.rknn.worker import ToolkitWorker, WorkerFailed

    build = RknnTarget("rk3588").build_options(None)
    worker = ToolkitWorker(find_python("rk3588"), tmp_path / "worker.log")
    answers = []

    def ask():
        try:
            answers.append(worker.request(op="build", onnx=str(save(add_model([1, 64, 64, 64]))), rknn=None,
                                          log=str(tmp_path / "b.log"), keep=None, timeout=120, **build))
        except WorkerFailed as exc:
            answers.append(exc)

    asking = threading.Thread(target=ask)
    asking.start()
    deadline = time.monotonic() + 60
    while not list(worker.tmp.glob("rknn-build-*")) and time.monotonic() < deadline and not answers:
        time.sleep(0.05)
    assert list(worker.tmp.glob("rknn-build-*")), f"the build's scratch never appeared in {worker.tmp}"
    worker.kill()
    asking.join(timeout=30)
    assert isinstance(answers[0], WorkerFailed) and "died" in str(answers[0])
    assert not worker.tmp.exists()
    # the next request (a kept model's release after its run failed) is told at once, not at its timeout
    started = time.monotonic()
    with pytest.raises(WorkerFailed, match="died"):
        worker.request(op="release", key="shard_000", timeout=600)
    assert time.monotonic() - started < 30


def test_a_forked_worker_shares_the_toolkit_import_builds_apart_and_ends_on_its_own(save, tmp_path):
    """A pool's first worker forks the others once it has imported the toolkit (ToolkitWorker's
    sibling_logs): each sibling shares that import's pages, builds in its own folder, and dies or
    lives apart from the first, its exit code reported like a spawned worker's."""
    import os
    import signal
    import threading
    from pathlib import Path

    from shard.targets.rknn.target import RknnTarget
    from shard.targets.rknn.env import find_python
    from shard.targets.rknn.worker import ToolkitWorker, WorkerFailed

    build = RknnTarget("rk3588").build_options(None)
    first = ToolkitWorker(find_python("rk3588"), tmp_path / "w0.log", [tmp_path / "w1.log"])
    (sibling,) = first.siblings
    answers = {}

    def ask(worker, name):
        answers[name] = worker.request(op="build", onnx=str(save(add_model([1, 16, 32, 32]))),
                                       rknn=str(tmp_path / f"{name}.rknn"), log=str(tmp_path / f"{name}.log"),
                                       keep=None, timeout=120, **build)

    threads = [threading.Thread(target=ask, args=(w, n)) for w, n in ((first, "a"), (sibling, "b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert answers["a"]["ok"] and answers["b"]["ok"], answers
    assert (tmp_path / "a.rknn").stat().st_size > 0 and (tmp_path / "b.rknn").stat().st_size > 0
    stat = Path(f"/proc/{sibling.proc.pid}/stat").read_text()
    assert int(stat[stat.rindex(")") + 2:].split()[1]) == first.proc.pid   # forked by the first
    rollup = dict(line.split(":", 1) for line in Path(f"/proc/{sibling.proc.pid}/smaps_rollup").read_text().splitlines()[1:])
    shared = int(rollup["Shared_Dirty"].split()[0]) * 1024   # the import's heap: a worker of its own shares none
    assert shared > 100e6, f"the sibling shares only {shared / 1e6:.0f} MB of heap with the first worker"
    assert sibling.tmp != first.tmp and sibling.tmp.is_dir()

    os.kill(sibling.proc.pid, signal.SIGKILL)   # as the kernel's OOM killer would
    with pytest.raises(WorkerFailed, match=r"died \(the toolkit process exited with code -9\)"):
        sibling.request(op="version", timeout=60)
    assert "killed by signal 9" in (tmp_path / "w1.log").read_text()
    assert first.request(op="version", timeout=60)["ok"]   # the first goes on

    again = ToolkitWorker(find_python("rk3588"), tmp_path / "w2.log", [tmp_path / "w3.log"])
    assert again.siblings[0].request(op="version", timeout=60)["ok"]   # forked by now
    again.kill()   # the first's end is not its sibling's
    assert again.siblings[0].request(op="version", timeout=60)["ok"]
    for worker in (again.siblings[0], sibling, first):
        worker.close()
        assert not worker.alive() and not worker.tmp.exists()


def test_a_forked_worker_is_watched_through_proc_where_the_kernel_has_no_pidfd(tmp_path, monkeypatch):
    """Linux before 5.3 has no pidfd_open (ENOSYS): a sibling's end is read from /proc instead."""
    import errno
    import os
    import signal

    from shard.targets.rknn import worker as workers
    from shard.targets.rknn.env import find_python

    def no_pidfd(pid):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(workers.os, "pidfd_open", no_pidfd)
    first = workers.ToolkitWorker(find_python("rk3588"), tmp_path / "w0.log", [tmp_path / "w1.log"])
    (sibling,) = first.siblings
    assert sibling.request(op="version", timeout=60)["ok"] and sibling.alive()
    os.kill(sibling.proc.pid, signal.SIGKILL)
    with pytest.raises(workers.WorkerFailed, match=r"exited with code -9"):
        sibling.request(op="version", timeout=60)
    assert not sibling.alive()
    sibling.close()
    first.close()
    assert not sibling.tmp.exists() and not first.tmp.exists() and not first.alive()


def test_the_worker_skips_the_check_dumps_and_the_build_logs_the_same(save, tmp_path):
    """The worker does not write the toolkit's check0..3_*.onnx dumps (rknn_worker.skip_check_dumps);
    with them skipped the toolkit's verbose build logs the same layers, ops and cycles."""
    import subprocess

    from shard.targets.rknn.env import find_python
    from shard.targets.rknn.log import parse_build_log
    from shard.targets.rknn.worker import WORKER_SCRIPT

    model = save(make_model([helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
                            [("x", [1, 64, 96])], [("y", [1, 64, 32])],
                            [numpy_helper.from_array(np.ones((96, 32), np.float32), "w")]))
    script = ("import runpy, sys; from rknn.api import RKNN\n"
              "if sys.argv[2] == 'skip': runpy.run_path(sys.argv[3])['skip_check_dumps']()\n"
              "r = RKNN(verbose=True); r.config(target_platform='rk3588')\n"
              "assert r.load_onnx(model=sys.argv[1]) == 0 and r.build(do_quantization=False) == 0")
    logs, dumps = {}, {}
    for how in ("skip", "plain"):
        (tmp_path / how).mkdir()
        run = subprocess.run([str(find_python("rk3588")), "-I", "-c", script, str(model), how, str(WORKER_SCRIPT)],
                             cwd=tmp_path / how, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        logs[how] = parse_build_log(run.stdout + run.stderr)
        dumps[how] = sorted(p.name for p in (tmp_path / how).glob("check*.onnx"))
    assert dumps["skip"] == [] and dumps["plain"][:1] == ["check0_base_optimize.onnx"]   # (passes that changed it)
    assert logs["skip"].layers and [(l.op, l.cycles) for l in logs["skip"].layers] == \
        [(l.op, l.cycles) for l in logs["plain"].layers]
    assert logs["skip"].summary() == logs["plain"].summary()


def test_vit_tiny_compiles_into_shards_and_verifies(tmp_path):
    onnx_path = tmp_path / "vit.onnx"
    res = shard_cli("zoo", "export", "vit-tiny", "-o", onnx_path, "--layers", "3")
    assert res.returncode == 0, res.stderr
    result = shard.compile(onnx_path, "rk3588", tmp_path / "vit.shard", CompileOptions(shards=3, jobs=2))
    m = result.manifest
    assert [s.core for s in m.shards] == [0, 1, 2]
    assert all(s.source_nodes for s in m.shards)
    assert result.report["totals"]["overflow_lines"] == 0 and result.report["totals"]["cpu_ops"] == 0
    tiling = result.report["passes"]["tile_attention"]
    assert tiling["found"] == 3 and tiling["changes"] == []  # auto: every attention builds clean whole
    # From the estimated cycles at 1 GHz and each shard's hand-off on the board (its inputs set and
    # outputs got at the published rates), through the scheduler's policy.
    predicted = result.report["predicted"]
    cycles = [s["diagnostics"]["estimated_cycles"] for s in result.report["shards"]]
    handoff = CHIPS["rk3588"].handoff
    moves = [handoff.seconds(elements(t.shape for t in s.inputs), elements(t.shape for t in s.outputs))
             for s in m.shards]
    assert predicted["npu_seconds"] == [c / 1e9 for c in cycles] and predicted["handoff_seconds"] == moves
    assert all(move > 0 for move in moves) and predicted["handoff_source"] == handoff.source
    assert predicted["latency_s"] == pytest.approx(sum(cycles) / 1e9 + sum(moves))
    assert predicted["vendor_handoff_s"] < sum(moves)   # the vendor's one graph: the model's inputs, outputs once
    fps = {int(n): f for n, f in predicted["stream_fps"].items()}
    assert fps[1] * 0.99 <= 1 / predicted["latency_s"] and fps[1] < fps[2] < fps[3] <= 3 * fps[1]
    report = shard.verify(result.bundle, onnx_path, backend="sim")
    assert report.passed and report.outputs[0].cosine >= 0.9999
    assert set(report.shards) == {"shard_000", "shard_001", "shard_002"}
    assert min(c.cosine for comps in report.shards.values() for c in comps) >= 0.9999
    # The run command on the same bundle, with a saved input.
    x = np.random.default_rng(1).standard_normal((1, 3, 224, 224)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    res = shard_cli("run", result.bundle, "--input", f"pixel_values={tmp_path / 'x.npy'}", "--backend", "sim",
                    "--save", tmp_path / "out")
    assert res.returncode == 0, res.stderr
    assert "shape [1, 197, 192]" in res.stdout and "shard_002" in res.stdout
    got = np.load(tmp_path / "out" / "last_hidden_state.npy")
    import onnxruntime as ort

    want = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"]).run(None, {"pixel_values": x})[0]
    cos = float(np.dot(got.ravel(), want.ravel()) / np.linalg.norm(got) / np.linalg.norm(want))
    assert cos >= 0.9999


@pytest.mark.toolkit
def test_each_build_log_holds_its_own_layer_table(tmp_path):
    """The toolkit's C++ layer table is buffered in C stdio: without a flush after each request it
    spilled into the next build's log, and cycle estimates landed on the wrong shard. Where C's
    buffer boundaries fall depends on all that was printed before, so this replays a sequence of
    builds that showed the spill."""
    import onnx

    from shard.probes.families import FAMILIES
    from shard.targets.rknn.target import RknnTarget
    from shard.targets.rknn.log import parse_build_log
    from shard.targets.rknn.env import find_python
    from shard.targets.rknn.worker import ToolkitWorker

    build = RknnTarget("rk3588").build_options(None)
    conv = FAMILIES["conv-stride"].build  # stride > 7 lowers to a Conv_split + a Conv_select
    points = [(1, 3), (1, 16), (2, 3), (4, 3), (7, 3), (8, 3), (16, 3), (8, 16)]
    models = {f"s{n}c{c}": conv(n, {"cin": c}) for n, c in points}
    ops = {}
    with ToolkitWorker(find_python("rk3588"), tmp_path / "worker.log") as worker:
        for name, model in models.items():
            onnx.save(model, tmp_path / "m.onnx")
            (tmp_path / "b.log").write_text("")  # one log path, emptied before each build
            answer = worker.request(op="build", onnx=str(tmp_path / "m.onnx"), rknn=None,
                                    log=str(tmp_path / "b.log"), keep=None, timeout=120, **build)
            assert answer["ok"], answer
            ops[name] = [layer.op for layer in parse_build_log((tmp_path / "b.log").read_text()).layers]
    assert [ops[name].count("Conv") for name in models] == [1, 1, 1, 1, 1, 2, 2, 2]


def test_inspect_names_the_oversize_op_its_evidence_and_the_fix(save):
    res = shard_cli("inspect", save(add_model([1, 1, 1, 131072])), "--target", "rk3588")
    assert res.returncode == 0, res.stderr
    assert "add-width@h1: N=131072 > 65536 (overflow)" in res.stdout and "split into 2 along axis 3" in res.stdout
    assert "host step before the first shard: slice x" in res.stdout
    assert "1 rewrites, 0 over a limit and not fixed" in res.stdout


def test_forced_attention_tiles_survive_the_vendor_compiler(tmp_path):
    onnx_path = tmp_path / "vit.onnx"
    res = shard_cli("zoo", "export", "vit-tiny", "-o", onnx_path, "--layers", "2")
    assert res.returncode == 0, res.stderr
    result = shard.compile(onnx_path, "rk3588", tmp_path / "t.shard", CompileOptions(tile_attention="force", shards=2))
    totals = result.report["totals"]
    assert totals["overflow_lines"] == 0 and totals["cpu_ops"] == 0
    changes = result.report["passes"]["tile_attention"]["changes"]
    assert len(changes) == 2 and all(c["query_tiles"] >= 2 for c in changes)
    assert all(c["tiles_survived"] and c["tiles_in_layer_table"] == c["query_tiles"] for c in changes)
    report = shard.verify(result.bundle, onnx_path, backend="sim")
    assert report.passed and report.outputs[0].cosine >= 0.9999


def test_a_cut_that_loses_fidelity_falls_back_to_the_vendor_alone(save, tmp_path):
    # x * 1e5 * 1e-5: the vendor folds the two scales; a cut between them leaves 1e5 * x at a shard's
    # edge, past fp16's range. Only the simulator sees it: --check-fidelity keeps the vendor's build.
    # (scale_sandwich keeps the edge in range; without it, the fallback is what saves the bundle.)
    nodes = [helper.make_node("Mul", ["x", "up"], ["h"], name="up"), helper.make_node("Mul", ["h", "down"], ["y"], name="down")]
    path = save(make_model(nodes, [("x", [1, 8, 16, 16])], [("y", [1, 8, 16, 16])],
                           [numpy_helper.from_array(np.array(1e5, np.float32), "up"),
                            numpy_helper.from_array(np.array(1e-5, np.float32), "down")]))
    sandwiched = shard.compile(path, "rk3588", tmp_path / "s.shard", CompileOptions(shards=2, check_fidelity=True))
    assert sandwiched.report["versus_vendor"]["bundle"] == "shard"
    assert sandwiched.report["versus_vendor"]["fidelity"]["shard"] >= 0.9999
    assert sandwiched.report["passes"]["scale_sandwich"]["changes"]
    result = shard.compile(path, "rk3588", tmp_path / "m.shard",
                           CompileOptions(shards=2, check_fidelity=True, disable=("scale_sandwich",)))
    versus = result.report["versus_vendor"]
    assert versus["bundle"] == "vendor alone" and versus["rewritten"] is not None
    assert not versus["fidelity"]["shard"] >= 0.999 and versus["fidelity"]["vendor"] >= 0.9999
    assert [s.build for s in result.manifest.shards] == ["vendor_alone"]
    assert shard.verify(result.bundle, path, backend="sim", min_cosine=0.9999).passed
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".m.shard")]


def test_builds_told_one_at_a_time_never_overlap(tmp_path, save):
    # A program cut into fewer shards than its builds' memory asks for (a decode step of few MACs)
    # builds them one at a time (partition's builds_at_once): on two workers, four real builds whose
    # spans, end minus build seconds, do not overlap.
    import time

    from conftest import mlp_chain

    from shard.targets import ShardJob
    from shard.targets.registry import get_target

    target = get_target("rk3588")
    jobs = []
    for k in range(4):
        model = save(mlp_chain(2, width=64, seed=k), f"s{k}.onnx")
        jobs.append(ShardJob(f"s{k}", model, tmp_path / f"s{k}.rknn", tmp_path / f"s{k}.log"))
    ends = {}
    with target.builds(2, 600, None, tmp_path / "logs") as builds:
        builds.at_once(1)
        done = builds.results(builds.submit(jobs, target.build_options(CompileOptions()),
                                            lambda b: ends.setdefault(b.name, time.monotonic())))
    assert all(b.error is None for b in done)
    spans = sorted((ends[b.name] - b.seconds, ends[b.name]) for b in done)
    assert all(later[0] >= earlier[1] - 0.05 for earlier, later in zip(spans, spans[1:])), spans


def one_row_model(op: str, axis: int):
    """Row 0 of a sequence input [20,1,4096] (axis 0) or [1,20,4096] (axis 1): the shape whose input
    the vendor's build overflows on RK3588 (gather-rows, slice-rows in the profile)."""
    from shard.probes.families import rows

    return rows(op)(20, {"axis": axis, "w": 4096})


@pytest.mark.parametrize("op,axis", [("Gather", 0), ("Gather", 1), ("Slice", 0)])
def test_one_row_of_a_sequence_the_vendor_overflows_on_builds_split(save, tmp_path, op, axis):
    """The vendor alone logs 15 REGTASK lines for one row of a [20,1,4096] input; shard splits the op
    along the row's width (the profile's limit names it), builds with none and matches onnxruntime."""
    model = save(one_row_model(op, axis))
    res = shard_cli("inspect", model, "--target", "rk3588")
    assert res.returncode == 0, res.stderr
    assert f"{op.lower()}-rows@axis{axis}-w4096: N=20 not in the passing set (overflow)" in res.stdout
    result = shard.compile(model, "rk3588", tmp_path / "row.shard", CompileOptions())
    versus = result.report["versus_vendor"]
    assert result.report["totals"]["overflow_lines"] == 0 and versus["vendor"]["builds"] is False
    assert versus["verdict"] == "better" and versus["fidelity"]["shard"] >= 0.9999
    assert [s["op"] for s in result.manifest.host_pre] == ["slice", "slice"]


def test_inspect_says_an_op_runs_on_the_cpu_when_built_alone_not_in_the_model(save):
    # inspect said "ops that would run on the CPU" of one-op builds, where the whole model's build ran
    # none there (ViT-tiny: 6 against the compile's 0)
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 64])
    model = helper.make_model(helper.make_graph([helper.make_node("Erf", ["x"], ["y"])], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    res = shard_cli("inspect", save(model), "--target", "rk3588")
    assert res.returncode == 0, res.stderr
    assert "1 ops that run on the CPU when built alone" in res.stdout and "would run" not in res.stdout, res.stdout
