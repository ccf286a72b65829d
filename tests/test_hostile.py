"""Hostile input to the generative surfaces, as a user who gets things wrong would give it: every case
ends in one `error:` line and exit 1, never a traceback. Each was a traceback before (a bad option
value, a damaged checkpoint, a cache or output path that cannot be written)."""

from __future__ import annotations

import json
import shutil
import struct
import zlib
from pathlib import Path

import pytest
from conftest import add_model, shard_cli
from test_checkpoints import gguf_tensors, write_gguf
from test_generative import checkpoint, cpu_bundle  # noqa: F401 - fixtures

from shard.errors import RunError


def reseal(bundle: Path, template: str) -> None:
    """The bundle as a compile from a checkpoint with this chat template would write it: the template,
    its hash and the spec's digest."""
    from shard.bundle import sealed_digest
    from shard.runtime.generative_bundle import GENERATIVE, record_files

    (bundle / "tokenizer" / "chat_template.jinja").write_text(template)
    data = json.loads((bundle / GENERATIVE).read_text())
    data["files"] = record_files(bundle)
    data["digest"] = sealed_digest(data)
    (bundle / GENERATIVE).write_text(json.dumps(data, indent=2) + "\n")


def cases(root: Path, bundle: Path, folder: Path) -> dict[str, tuple[tuple, dict]]:
    """{case: (CLI arguments, extra environment)}."""
    ids = ("generate", str(bundle), "--ids", "5,17", "--max-new-tokens", "2")
    tensors = gguf_tensors()
    whole = write_gguf(root / "whole.gguf", tensors).read_bytes()
    (root / "trunc").mkdir()
    (root / "trunc" / "lm.gguf").write_bytes(whole[: len(whole) // 2])
    (root / "heads").mkdir()
    write_gguf(root / "heads" / "lm.gguf", tensors, heads=3)   # 64 wide: 3 heads do not divide it
    (root / "noweights").mkdir()
    shutil.copy(folder / "config.json", root / "noweights" / "config.json")
    (root / "a-file").write_text("x")
    model = root / "add.onnx"
    model.write_bytes(add_model([1, 4]).SerializeToString())
    raising = root / "raising.shard"
    shutil.copytree(bundle, raising)
    reseal(raising, "{{ raise_exception('this template refuses every prompt') }}")
    return {
        "--temperature nan": ((*ids, "--temperature", "nan"), {}),
        "--temperature -1": ((*ids, "--temperature", "-1"), {}),
        "--top-p 0": ((*ids, "--top-p", "0"), {}),
        "--seed -1": ((*ids, "--seed", "-1", "--temperature", "1"), {}),
        "--timeout nan (generate)": ((*ids, "--timeout", "nan"), {}),
        "--json at a folder": ((*ids, "--json", str(root)), {}),
        "--json in a missing folder": ((*ids, "--json", str(root / "nowhere" / "x.json")), {}),
        "a chat template that raises": (("generate", str(raising), "--prompt", "hi", "--chat"), {}),
        "verify --reference nosuch (never the Hub)": (("verify", str(bundle), "--reference", str(root / "nosuch")), {}),
        "a truncated GGUF": (("compile", str(root / "trunc" / "lm.gguf"), "--target", "cpu", "-o",
                              str(root / "t.shard")), {}),
        "heads that do not divide the width": (("compile", str(root / "heads" / "lm.gguf"), "--target", "cpu",
                                                "-o", str(root / "h.shard")), {}),
        "a folder without weights": (("compile", str(root / "noweights"), "--target", "cpu", "-o",
                                      str(root / "n.shard")), {}),
        "SHARD_BUILD_CACHE at a file": (("compile", str(model), "--target", "cpu", "-o", str(root / "c.shard")),
                                        {"SHARD_BUILD_CACHE": str(root / "a-file")}),
        "compile --timeout 0": (("compile", str(model), "--target", "cpu", "--timeout", "0", "-o",
                                 str(root / "z.shard")), {}),
        "compile --timeout nan": (("compile", str(model), "--target", "cpu", "--timeout", "nan", "-o",
                                   str(root / "z.shard")), {}),
        "run --timeout -1": (("run", str(bundle / "decode"), "--timeout", "-1"), {}),
        "pack -o into a missing folder": (("pack", str(bundle / "decode"), "-o", str(root / "no" / "p.tar.gz")), {}),
    }


def test_every_hostile_case_ends_in_one_line(checkpoint, cpu_bundle, tmp_path):  # noqa: F811 - fixtures
    found = cases(tmp_path, cpu_bundle.bundle, checkpoint[0])
    tracebacks, not_one_line = [], []
    for name, (args, env) in found.items():
        res = shard_cli(*args, env_extra=env)
        if "Traceback" in res.stderr:
            tracebacks.append(name)
        elif res.returncode != 1 or len([x for x in res.stderr.splitlines() if x.startswith("error:")]) != 1:
            not_one_line.append((name, res.returncode, res.stderr[-300:]))
    print(f"hostile cases: {len(found)}, tracebacks: {len(tracebacks)}, not one line: {len(not_one_line)}")
    assert not tracebacks and not not_one_line, (tracebacks, not_one_line)


def test_an_image_whose_header_declares_20000_by_20000_is_one_line(tmp_path):
    from PIL import Image

    from shard.runtime.prompts import read_image

    path = tmp_path / "bomb.png"
    Image.new("RGB", (8, 8)).save(path)
    data = bytearray(path.read_bytes())
    header = struct.pack(">II", 20000, 20000) + bytes(data[24:29])   # IHDR: width, height, the rest as it was
    data[16:29] = header
    data[29:33] = struct.pack(">I", zlib.crc32(b"IHDR" + header))
    path.write_bytes(bytes(data))
    with pytest.raises(RunError, match="bomb.png: (not an image this can read.*decompression bomb|20000 x 20000)"):
        read_image(path)
