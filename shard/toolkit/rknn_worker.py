"""Worker run by the rknn-toolkit2 environment's interpreter; never imported by shard itself.

Reads one JSON request per line on stdin and answers one JSON line each. The toolkit's C++ library
writes its real errors straight to file descriptors 1 and 2, so every request runs with both
redirected into that request's log file; answers go to a private duplicate of the original stdout.

Requests:
  {"op": "version"}
  {"op": "build", "onnx": P, "rknn": P|null, "log": P, "config": {...}, "build": {...},
   "keep": KEY|null}      keep: hold the built model in this process for "infer" (simulator)
  {"op": "infer", "key": KEY, "inputs": [npy paths], "data_format": [...], "outdir": DIR, "log": P}
  {"op": "release", "key": KEY}
  {"op": "exit"}
"""

import ctypes
import json
import os
import sys
import tempfile
import time
import traceback

answer = os.fdopen(os.dup(1), "w", buffering=1)
kept = {}
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
            if rc.get("load_onnx") == 0:
                rc["build"] = rknn.build(**req.get("build", {}))
            if rc.get("build") == 0 and rknn_path:
                rc["export_rknn"] = rknn.export_rknn(rknn_path)
            if rc.get("build") == 0 and req.get("keep"):
                rc["init_runtime"] = rknn.init_runtime()
        except Exception as exc:  # the toolkit raises from inside its passes; rc says how far it got
            crash = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        finally:
            os.chdir(home)
        ok = not crash and all(v == 0 for v in rc.values())
        if ok and req.get("keep"):
            kept[req["keep"]] = rknn
        else:
            rknn.release()
    return {"rc": rc, "ok": ok, "seconds": round(time.monotonic() - started, 3), **crash}


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
    kept.pop(req["key"]).release()
    return {}


OPS = {"version": do_version, "build": do_build, "infer": do_infer, "release": do_release}


def main():
    # Anything the toolkit prints outside a request lands in the worker's own log.
    log = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "exit":
            break
        try:
            res = {"ok": True, **OPS[req["op"]](req)}
        except Exception as exc:  # reported to the client, which decides what it means
            res = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        answer.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
