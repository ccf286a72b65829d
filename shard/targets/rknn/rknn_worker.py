"""Worker run by the rknn-toolkit2 environment's interpreter; never imported by shard itself.

Reads one JSON request per line on stdin and answers one JSON line each. The toolkit's C++ library
writes its real errors straight to file descriptors 1 and 2, so every request runs with both
redirected into that request's log file; answers go to a private duplicate of the original stdout.

Started with sibling specifications after the log path (JSON: the fds of a request pipe's read end
and of an answer pipe's write end, a log path, a TMPDIR, a file for its exit code), the process
forks one worker per sibling once it has imported the toolkit: the siblings share the import's
pages (a quarter of a gigabyte, torch's most of it) instead of each loading its own, and skip its
seconds. A sibling first answers {"pid": PID}, then serves like any worker.

Requests:
  {"op": "version"}
  {"op": "build", "onnx": P, "rknn": P|null, "log": P, "config": {...}, "build": {...},
   "dataset": [[npy per input] per sample]|null,   quantization samples (written as the toolkit's list file)
   "float16": [names]|null,   mixed precision: ops (node or tensor names) kept in fp16, the rest int8,
                              through the toolkit's hybrid_quantization_step1/step2
   "keep": KEY|null}      keep: hold the built model in this process for "infer" (simulator)
  {"op": "infer", "key": KEY, "inputs": [npy paths], "data_format": [...], "outdir": DIR, "log": P}
  {"op": "release", "key": KEY}
  {"op": "exit"}
"""

import ctypes
import gc
import json
import os
import re
import sys
import tempfile
import threading
import time
import traceback

answer = os.fdopen(os.dup(1), "w", buffering=1)
kept = {}
CLIENT = os.getppid()   # the shard process: siblings, forked later, keep its number
libc = ctypes.CDLL(None)


def flush_all():
    """Flush Python's and C's stdio buffers: the toolkit's C++ layer table sits in C's stdout buffer,
    and would otherwise land in the next request's log."""
    sys.stdout.flush()
    sys.stderr.flush()
    libc.fflush(None)


class redirect_fds:
    """Point fds 1 and 2 (C++ and Python alike) at a log file for the duration of a request."""

    def __init__(self, path):
        self.path = path

    def __enter__(self):
        flush_all()
        self.saved = os.dup(1), os.dup(2)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(self.fd, 1)
        os.dup2(self.fd, 2)

    def __exit__(self, *exc):
        flush_all()
        os.dup2(self.saved[0], 1)
        os.dup2(self.saved[1], 2)
        for fd in (*self.saved, self.fd):
            os.close(fd)


def do_version(req):
    import importlib.metadata as md

    return {"rknn-toolkit2": md.version("rknn-toolkit2"), "numpy": md.version("numpy"),
            "onnx": md.version("onnx")}


def do_build(req):
    from rknn.api import RKNN

    rc = {}
    started = time.monotonic()
    reset_peak()
    crash = {}
    home = os.getcwd()  # relative paths in a request mean the client's directory, where we started
    onnx, rknn_path = os.path.abspath(req["onnx"]), req.get("rknn") and os.path.abspath(req["rknn"])
    # The build drops check*.onnx files into the working directory.
    with tempfile.TemporaryDirectory(prefix="rknn-build-") as scratch, redirect_fds(req["log"]):
        os.chdir(scratch)
        rknn = RKNN(verbose=True)
        try:
            rc["config"] = rknn.config(**req.get("config", {}))
            if rc["config"] == 0:
                rc["load_onnx"] = rknn.load_onnx(model=onnx)
            build = dict(req.get("build", {}))
            if req.get("dataset"):  # one line per sample, its inputs' .npy files separated by spaces;
                lines = []          # linked under plain names, as the list file cannot quote a path
                for k, sample in enumerate(req["dataset"]):
                    for i, path in enumerate(sample):
                        os.symlink(os.path.join(home, path), f"s{k}_{i}.npy")
                    lines.append(" ".join(os.path.abspath(f"s{k}_{i}.npy") for i in range(len(sample))) + "\n")
                with open("dataset.txt", "w") as listing:
                    listing.writelines(lines)
                build["dataset"] = os.path.abspath("dataset.txt")
            if rc.get("load_onnx") == 0 and req.get("float16") is not None:
                rknn, rc["build"] = hybrid_build(rknn, req["config"], build["dataset"], onnx, req["float16"])
            elif rc.get("load_onnx") == 0:
                rc["build"] = rknn.build(**build)
            if rc.get("build") == 0 and rknn_path:
                rc["export_rknn"] = rknn.export_rknn(rknn_path)
            if rc.get("build") == 0 and req.get("keep"):
                rc["init_runtime"] = rknn.init_runtime()
        except Exception as exc:  # the toolkit raises from inside its passes; rc says how far it got
            crash = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        finally:
            os.chdir(home)
        ok = not crash and all(v == 0 for v in rc.values())
        peak = peak_bytes()
        if ok and req.get("keep"):
            kept[req["keep"]] = rknn
        else:
            rknn.release()
            del rknn
            give_back_memory()
    return {"rc": rc, "ok": ok, "seconds": round(time.monotonic() - started, 3), "peak_bytes": peak, **crash}


def hybrid_build(rknn, config, dataset, onnx, float16):
    """Quantize with the toolkit's own ranges (step 1), mark every operand made by one of the
    `float16` names as float16 in its configuration, build from it (step 2). Returns the toolkit
    object that holds the build and step 2's return code. The configuration lists operands under
    the toolkit's renamings (NAME_rs, NAME_tp_sw, NODE#1); a name it then refuses is dropped."""
    from rknn.api import RKNN

    ret = rknn.hybrid_quantization_step1(dataset=dataset, proposal=False)
    if ret != 0:
        return rknn, ret
    stem = os.path.splitext(os.path.basename(onnx))[0]
    with open(f"{stem}.quantization.cfg") as f:
        text = f.read()
    body = text[text.index("quantize_parameters:"):]
    operands = re.findall(r"^    (\S.*):$", body, flags=re.M)
    import onnx as onnx_lib  # the toolkit's own; a graph input itself is no layer (step 2 refuses it)

    graph = onnx_lib.load(onnx, load_external_data=False).graph
    inputs = {i.name for i in graph.input}
    wanted = set(float16)
    chosen = [op for op in operands if op not in inputs and (op in wanted or op.split("#")[0] in wanted
              or any(op.startswith(name + sep) for name in wanted for sep in ("_", "-")))]
    for _ in range(len(chosen) + 1):
        layers = "".join(f"    {json.dumps(op)}: float16\n" for op in chosen)
        with open(f"{stem}.quantization.cfg", "w") as f:
            f.write(("custom_quantize_layers:\n" + layers if layers else "custom_quantize_layers: {}\n") + body)
        rknn.release()
        rknn = RKNN(verbose=True)
        rknn.config(**config)
        try:
            return rknn, rknn.hybrid_quantization_step2(model_input=f"{stem}.model", data_input=f"{stem}.data",
                                                        model_quantization_cfg=f"{stem}.quantization.cfg")
        except ValueError as exc:  # a weight or a fused constant: not a layer the toolkit can move
            refused = re.search(r"Invalid operands name '([^']*)'", str(exc))
            if not refused or refused.group(1) not in chosen:
                raise
            print(f"hybrid: {refused.group(1)} cannot be kept in float16; left to the toolkit", flush=True)
            chosen.remove(refused.group(1))
    raise RuntimeError("hybrid quantization: no configuration the toolkit accepts")


def reset_peak():
    """Start this process's peak resident memory (VmHWM) again from what it holds now (Linux 4.0+)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_bytes():
    """This process's peak resident memory since the last reset_peak(), in bytes; None off Linux."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None


def give_back_memory():
    """Return what a finished build freed to the system: glibc keeps freed heap pages otherwise,
    and a worker waiting for its next build held about half of its last build's peak."""
    import gc

    gc.collect()
    libc.malloc_trim(0)


def do_infer(req):
    import numpy as np

    rknn = kept[req["key"]]
    inputs = [np.load(p) for p in req["inputs"]]
    with redirect_fds(req["log"]):
        outs = rknn.inference(inputs=inputs, data_format=req.get("data_format"))
    if outs is None:
        raise RuntimeError("inference returned None; see the log")
    paths = []
    for i, out in enumerate(outs):
        path = os.path.join(req["outdir"], f"out{i}.npy")
        np.save(path, out)
        paths.append(path)
    return {"outputs": paths}


def do_release(req):
    rknn = kept.pop(req["key"], None)   # None: its build failed, so nothing was kept
    if rknn is not None:
        rknn.release()
    give_back_memory()   # a worker that ran a shard on the simulator holds nothing of it while idle
    return {}


OPS = {"version": do_version, "build": do_build, "infer": do_infer, "release": do_release}


CHECK_DUMP = re.compile(r"check\d+_\w+\.onnx")


def skip_check_dumps():
    """In verbose mode (which prints the layer table shard reads) the toolkit saves the whole model
    after each of its four graph passes, check0_base_optimize.onnx to check3_fuse_ops.onnx, and never
    reads them back: 7 s of a SigLIP-512 build's 36 s go to serializing and writing 1.4 GB. They are
    not written. The build log is the same (a test compares them); the .rknn file is no more
    different from one built with the dumps (20297 bytes of SigLIP-512's) than two such builds are
    from each other (19529: the toolkit writes uninitialised bytes into it)."""
    import onnx

    save = onnx.save_model

    def save_model(proto, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)) and CHECK_DUMP.fullmatch(os.path.basename(os.fspath(f))):
            return None
        return save(proto, f, *args, **kwargs)

    onnx.save_model = onnx.save = save_model


def main():
    skip_check_dumps()
    # Anything the toolkit prints outside a request lands in the worker's own log.
    log = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:   # the toolkit's import (seconds) while the client still prepares its first request
        import rknn.api  # noqa: F401
    except Exception:   # a request that needs it raises again and says why
        traceback.print_exc()
    fork_siblings([json.loads(arg) for arg in sys.argv[2:]])
    serve()


def serve():
    threading.Thread(target=end_with_client, daemon=True).start()
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "exit":   # at once: the toolkit's interpreter takes most of a second to tear down,
            flush_all()           # and the client removes this process's temporary folder
            os._exit(0)
        try:
            res = {"ok": True, **OPS[req["op"]](req)}
        except Exception as exc:  # reported to the client, which decides what it means
            res = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        answer.write(json.dumps(res) + "\n")


def end_with_client():
    """Exit once the client is gone: a worker whose client was killed while the toolkit sat in a build
    (its op fusion can spin without end) would otherwise hold a core and its memory until reboot. The
    client started the first worker; a sibling outlives the worker that forked it, not the client."""
    while True:
        time.sleep(1.0)
        try:
            os.kill(CLIENT, 0)
        except (ProcessLookupError, PermissionError):   # gone, or its number taken by another user's process
            os._exit(3)


def fork_siblings(siblings):
    """Fork a worker for each sibling specification, before this process has started a thread or
    built anything; each becomes a worker of its own (become_sibling) and never returns here. This
    process reaps them and notes how each ended in its log."""
    if not siblings:
        return
    gc.collect()
    gc.freeze()   # the import's objects stay out of the collector's reach: it would write to their pages
    pids = []
    for sibling in siblings:
        flush_all()
        pid = os.fork()
        if pid == 0:
            become_sibling(sibling, siblings)
            serve()
            os._exit(0)
        pids.append((pid, sibling))
    for sibling in siblings:   # closed once all are forked: no fd number is reused before a sibling closes it
        os.close(sibling["requests"])
        os.close(sibling["answers"])
    for pid, sibling in pids:
        threading.Thread(target=reap, args=(pid, sibling), daemon=True).start()


def become_sibling(sibling, siblings):
    """From here on a worker of its own: its requests, answers, log and TMPDIR. It outlives the
    worker that forked it (a build of that one timed out, say): like any worker, it ends when the
    client closes its requests or kills it."""
    global answer, kept
    for other in siblings:
        if other is not sibling:
            os.close(other["requests"])
            os.close(other["answers"])
    os.dup2(sibling["requests"], 0)
    os.close(sibling["requests"])
    answer.close()   # the forking worker's answers
    answer = os.fdopen(sibling["answers"], "w", buffering=1)
    kept = {}
    log = os.open(sibling["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ["TMPDIR"] = tempfile.tempdir = sibling["tmp"]
    answer.write(json.dumps({"pid": os.getpid()}) + "\n")


def reap(pid, sibling):
    """Wait for a sibling's end; its exit code (negative: the signal that killed it) goes to its
    log and, for the client, to the file its specification names."""
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    try:
        with open(sibling["log"], "a") as f:
            f.write(f"worker {pid} " + (f"killed by signal {-code}" if code < 0 else f"exited with code {code}") + "\n")
        with open(sibling["status"] + ".part", "w") as f:
            f.write(str(code))
        os.replace(sibling["status"] + ".part", sibling["status"])
    except OSError:   # its folder went with it (the client killed it, and does not ask), or its log
        pass


if __name__ == "__main__":
    main()
