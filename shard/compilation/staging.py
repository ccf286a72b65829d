"""Where a bundle is written before it takes the output's place, and what keeps a failed, stopped or
killed compile from leaving anything there (or losing the bundle that was)."""

from __future__ import annotations

import glob
import os
import re
import shutil
import tempfile
from pathlib import Path

from shard import scratch
from shard.bundle import MANIFEST, read_manifest
from shard.compilation.names import PRECISIONS
from shard.errors import ShardError
from shard.never_worse import BASELINES
from shard.options import CompileOptions, check_seconds
from shard.passes import fusion_barrier, tile_attention
from shard.runtime.buckets import is_bucketed, read_buckets
from shard.runtime.generative_bundle import is_generative, read_generative
from shard.runtime.vla import PROGRAMS as VLA_PROGRAMS, is_vla, read_vla


def scratch_folders(output: Path) -> tuple[Path, Path]:
    """The staging bundle beside the output and a folder for the build logs."""
    logs = scratch.folder(f"logs-{output.stem}")
    logs.chmod(0o755)
    return staging_folder(output), logs


def staging_folder(output: Path) -> Path:
    """A folder beside the output (.NAME.tmp-PID-*: same filesystem, so the final rename is atomic;
    removed by a later compile of the same output if this process dies)."""
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-{os.getpid()}-", dir=output.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; a bundle is an ordinary directory
    return staging


def check_options(options: CompileOptions) -> None:
    for flag, value, modes in (("--tile-attention", options.tile_attention, tile_attention.MODES),
                               ("--fusion-barrier", options.fusion_barrier, fusion_barrier.MODES),
                               ("--vendor-alone", options.vendor_alone, BASELINES)):
        if value not in modes:
            raise ShardError(f"{flag} {value!r}: expected one of {', '.join(modes)}")
    if options.fusion_barrier == "rules" and not options.disable_rules:
        raise ShardError("--fusion-barrier rules needs the rule names: --disable-rule NAME (repeatable)")
    if options.precision not in PRECISIONS:
        raise ShardError(f"--precision {options.precision!r}: expected one of {', '.join(PRECISIONS)}")
    if not 0.0 < options.min_cosine <= 1.0:
        raise ShardError(f"--min-cosine {options.min_cosine}: expected a cosine in (0, 1]")
    check_seconds(options.timeout)


def check_output_path(output: Path, model: Path | None = None) -> None:
    """Refuse to replace anything at `output` that is not a bundle, or that holds the model; make sure
    its folder exists; remove what compiles of the same output that no longer run left beside it."""
    if model is not None and model.resolve().is_relative_to(output.resolve()):
        raise ShardError(f"{model} lies inside the output {output}, which the bundle replaces; choose another -o")
    if output.is_symlink():
        raise ShardError(f"{output} is a symbolic link; the bundle replaces what is at -o, so name the folder itself")
    if output.exists():
        why = not_a_bundle(output)
        if why:
            raise ShardError(f"{output} exists and is not a bundle shard wrote ({why}); the bundle would replace it "
                             f"and everything in it: remove it yourself or choose another -o")
    if not output.parent.is_dir():
        raise ShardError(f"{output.parent}: no such directory for the bundle")
    remove_stale_staging(output)


def not_a_bundle(folder: Path) -> str | None:
    """Why `folder` is not a bundle shard wrote (None where it is): a manifest sealed by its own digest
    with every file it names in place, or a decoder's, a VLA's or buckets' spec whose every program or
    bucket folder is such a bundle. A file merely named manifest.json (a web app's) is not enough."""
    if not folder.is_dir():
        return "not a folder"
    try:
        if (folder / MANIFEST).is_file():
            read_manifest(folder)
            return None
        if is_generative(folder):
            spec = read_generative(folder)
            parts = [p.name for p in spec.programs] + ([spec.vision["program"]] if spec.vision else [])
        elif is_bucketed(folder):
            parts = [b.name for b in read_buckets(folder).buckets]
        elif is_vla(folder):
            read_vla(folder)
            parts = list(VLA_PROGRAMS)
        else:
            return f"no {MANIFEST}"
    except ShardError as exc:
        return str(exc)
    except (TypeError, KeyError, AttributeError) as exc:   # a spec of other fields (another tool's file)
        return f"unreadable spec ({exc})"
    for part in parts:
        if not isinstance(part, str) or "/" in part or part in ("", ".", ".."):
            return f"names a program folder {part!r}"
        why = not_a_bundle(folder / part)
        if why:
            return f"{part}: {why}"
    return None


STAGING = re.compile(r"^\.(?P<name>.+)\.(tmp|mixed|old)-(?P<pid>\d+)(-|$)")


def remove_stale_staging(output: Path) -> list[Path]:
    """Staging folders of `output` (.NAME.tmp-PID-*, .NAME.mixed-PID-*, .NAME.old-PID) whose compile
    process is gone: what a compile killed outright (SIGKILL, a power cut) could not remove itself."""
    removed = []
    for path in output.parent.glob(f".{glob.escape(output.name)}.*-*"):
        match = STAGING.match(path.name)
        if match and match["name"] == output.name and not process_alive(int(match["pid"])):
            if path.name.endswith(f".old-{match['pid']}") and not output.exists():
                path.rename(output)   # the compile died between its two renames: this is the only bundle
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True   # someone else's
    return True


def replace_dir(staging: Path, output: Path) -> None:
    """Put the finished bundle in place: a rename, so readers never see half of one."""
    if output.exists():
        old = output.with_name(f".{output.name}.old-{os.getpid()}")
        output.rename(old)
        staging.rename(output)
        shutil.rmtree(old)
    else:
        staging.rename(output)
