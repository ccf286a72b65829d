"""Temporary folders: a killed process's are swept by the next one; a live one's, a kept one and other
programs' folders are not."""

import os
import signal
import subprocess
import sys

from shard import scratch

MAKE = "from shard import scratch; import sys, time; print(scratch.folder(sys.argv[1]), flush=True); time.sleep(600)"


def start(kind: str, tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", MAKE, kind], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    return proc, proc.stdout.readline().strip()


def test_a_sweep_removes_only_the_folders_of_processes_that_are_gone(tmp_path, monkeypatch):
    killed, killed_folder = start("worker", tmp_path)
    live, live_folder = start("ops", tmp_path)
    try:
        (tmp_path / killed_folder / "build.log").write_text("half a build")
        killed.send_signal(signal.SIGKILL)   # no finalizer runs
        killed.wait()
        monkeypatch.setenv("TMPDIR", str(tmp_path))
        monkeypatch.setattr("tempfile.tempdir", None)
        monkeypatch.setattr(scratch, "_swept", True)   # the sweep below is the one under test
        kept = scratch.folder("logs-m")   # a failed compile's logs, named in its message
        (kept / "shard-0.build.log").write_text("the error")
        scratch.keep(kept)
        mine = scratch.folder("sim")
        (tmp_path / "shard-other-program").mkdir()   # not ours: no lock file
        assert (tmp_path / killed_folder).is_dir()

        assert scratch.sweep(tmp_path) == [tmp_path / killed_folder]
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            [kept.name, mine.name, "shard-other-program", os.path.basename(live_folder)])
        assert (kept / "shard-0.build.log").read_text() == "the error"
        scratch.remove(mine)
        assert not mine.exists()
    finally:
        live.kill()
        live.wait()
    assert scratch.sweep(tmp_path) == [tmp_path / os.path.basename(live_folder)]


def test_the_first_folder_a_process_makes_sweeps(tmp_path):
    killed, folder = start("calib", tmp_path)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    made = subprocess.run([sys.executable, "-c", "from shard import scratch; print(scratch.folder('ort'))"],
                          capture_output=True, text=True, env={**os.environ, "TMPDIR": str(tmp_path)}, check=True)
    assert not os.path.exists(folder)
    assert not os.path.exists(made.stdout.strip())   # its maker exited without remove(): its exit removed it


def test_the_folders_a_process_still_holds_go_when_it_exits(tmp_path):
    # A simulator's folder, its session left open (a core was still inside it when the session
    # closed), whose core then came back before the error exit looked: no os._exit, no finalizer,
    # and the folder stayed in TMPDIR. A kept one stays.
    code = ("from shard import scratch; import sys; held, kept = scratch.folder('sim'), scratch.folder('logs'); "
            "scratch.keep(kept); print(held, kept); sys.exit(1)")
    made = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    held, kept = made.stdout.split()
    assert made.returncode == 1 and not os.path.exists(held) and os.path.isdir(kept)
