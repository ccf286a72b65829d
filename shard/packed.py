"""A pack's runtime code held to the hashes its packed manifest records (`runtime`: {path: sha256}):
run.py checks them before it imports anything of the pack, and `import shard` does first where the
package is a pack's own (so `python -m shard.runtime` inside a pack too). An edited copy of the
runtime ran before. Standard library only: pack.py copies check_runtime's source into run.py."""

from __future__ import annotations

from pathlib import Path

SPECS = ("manifest.json", "generative.json")   # what a pack's bundle folder holds: a bundle, a generative one


def check_runtime(here: Path) -> None:
    """Exit with one line unless every file under here/shard/ is one the pack's manifest records, with
    its sha256, and none it records is missing (Python's own __pycache__ aside)."""
    import hashlib
    import json
    import sys

    # a bundle's manifest; a generative bundle's programs' (each records the same)
    manifests = [here / "bundle" / "manifest.json", *sorted((here / "bundle").glob("*/manifest.json"))]
    try:
        recorded = json.loads(next(m for m in manifests if m.is_file()).read_text())["runtime"]
    except (StopIteration, OSError, ValueError, KeyError, TypeError):
        recorded = None
    if not isinstance(recorded, dict) or not recorded:
        sys.exit(f"error: {here}: the pack records no hashes of its runtime code; pack the bundle again")
    found = {p.relative_to(here).as_posix() for p in (here / "shard").rglob("*")
             if (p.is_file() or p.is_symlink()) and "__pycache__" not in p.parts}
    for rel in sorted(found | set(recorded)):
        path = here / rel
        if rel not in recorded or path.is_symlink() or not path.is_file() \
                or hashlib.sha256(path.read_bytes()).hexdigest() != recorded[rel]:
            sys.exit(f"error: {path}: not the runtime code this pack was made with (changed, added or missing); "
                     f"unpack the pack again")


def own_pack() -> Path | None:
    """The pack's folder where this package is a pack's own (NAME/shard beside NAME/run.py and
    NAME/bundle); None for an installed one."""
    here = Path(__file__).resolve().parents[1]
    bundle = here / "bundle"
    return here if (here / "run.py").is_file() and any((bundle / f).is_file() for f in SPECS) else None
