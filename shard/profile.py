"""Profile: a target's hardware facts (never user knobs), each with where it came from."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

from shard.errors import ShardError

SCHEMA_VERSION = 2   # 2: failure classes "overflow" and "error-alone" (1 named the toolkit's log)


@dataclass
class Point:
    """One probed size (or one model a pass asked about): did it build clean, and if not, how it
    failed (its class: shard.targets.rknn.classify) and the line that says so."""

    size: int
    ok: bool
    failure: str | None = None
    evidence: str = ""
    figures: dict = field(default_factory=dict)   # e.g. estimated cycles, MACs, cosine
    cached: bool = False


@dataclass
class Limit:
    """One boundary: the largest legal value, how exceeding it fails, and the evidence."""

    value: int
    failure: str                   # how the first size past it fails: overflow, error, error-alone, crash,
                                   # build-error, cpu-fallback, slow, numeric (a target's probe classes, e.g.
                                   # shard.targets.rknn.classify); none
    evidence: str
    source: str
    toolkit: str = ""              # the toolkit version it was measured with
    date: str = ""                 # when
    failing: int | None = None     # the smallest size that failed
    passing: list[int] | None = None   # a family probed as a set (not monotone): every size that passed;
                                       # then a size is legal if it is in here, not if it is <= value
    swept_to: int | None = None    # such a family's largest size probed

    def allows(self, size: int) -> bool:
        """Whether `size` passed: in the passing set of a swept limit, else at most the largest passing."""
        return size in self.passing if self.passing is not None else size <= self.value

    def speaks_for(self, size: int) -> bool:
        """Whether the probe's verdict reaches `size`: a swept limit up to the largest size it tried
        (past it nothing was seen); a bisected one everywhere, unless no size failed and `size` is
        past the largest it built."""
        if self.passing is not None:
            return size <= (self.swept_to or max([*self.passing, self.failing or 0]))
        return self.failure != "none" or size <= self.value


@dataclass
class Profile:
    target: str
    cores: int
    toolkit: str
    limits: dict[str, Limit] = field(default_factory=dict)
    facts: dict[str, object] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    @classmethod
    def from_dict(cls, data: dict) -> Profile:
        if data.get("schema_version") != SCHEMA_VERSION:
            older = isinstance(data.get("schema_version"), int) and data["schema_version"] < SCHEMA_VERSION
            raise ShardError(f"profile schema {data.get('schema_version')!r} is not {SCHEMA_VERSION}"
                             + (f": written by an older shard; probe again (`shard probe --target {data.get('target')} "
                                "-o FILE`: the probe cache answers the points it measured)" if older else ""))
        limits = {name: Limit(**lim) for name, lim in data.get("limits", {}).items()}
        return cls(target=data["target"], cores=data["cores"], toolkit=data["toolkit"], limits=limits,
                   facts=data.get("facts", {}), schema_version=data["schema_version"])

    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path: str | Path) -> None:
        """As JSON; a limit not probed as a set is written without `passing` and `swept_to`."""
        data = self.to_dict()
        for lim in data["limits"].values():
            for unset in [key for key in ("passing", "swept_to") if lim[key] is None]:
                del lim[unset]
        Path(path).write_text(json.dumps(data, indent=2) + "\n")


def load_profile(target: str, path: str | Path | None = None) -> Profile:
    """The profile at `path`, else the one shipped for `target`."""
    if path is not None:
        data = read_profile_json(Path(path))
    else:
        shipped = resources.files("shard.targets").joinpath("profiles").joinpath(f"{target}.json")
        if not shipped.is_file():
            raise ShardError(f"no profile ships for {target}: measure this machine's GPU with `shard probe --target "
                             f"{target} -o {target}.profile.json` and pass --profile {target}.profile.json")
        data = json.loads(shipped.read_text())
    profile = Profile.from_dict(data)
    if profile.target != target:
        raise ShardError(f"profile {path} is for {profile.target}, not {target}")
    return profile


@dataclass
class LimitDiff:
    name: str
    a: Limit | None
    b: Limit | None


def diff_profiles(a: Profile, b: Profile) -> tuple[list[LimitDiff], dict[str, tuple]]:
    """The limits whose largest legal value, failure or passing set differ between two profiles (one
    side may lack it), and the facts that differ ({name: (a's, b's)}; sources aside)."""
    limits = [LimitDiff(name, a.limits.get(name), b.limits.get(name)) for name in sorted({*a.limits, *b.limits})]
    verdict = lambda lim: (lim.value, lim.failure, lim.passing)  # noqa: E731
    changed = [d for d in limits if d.a is None or d.b is None or verdict(d.a) != verdict(d.b)]
    facts = {k: (a.facts.get(k), b.facts.get(k)) for k in sorted({*a.facts, *b.facts})
             if not k.endswith("_source") and a.facts.get(k) != b.facts.get(k)}
    if a.cores != b.cores:
        facts["cores"] = (a.cores, b.cores)
    return changed, facts


def read_profile_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ShardError(f"{path}: cannot read profile ({exc})") from None


def profile_at(spec: str) -> Profile:
    """A profile file (of any target), or the shipped profile of a target named so."""
    path = Path(spec)
    if path.suffix == ".json" or path.is_file():
        return Profile.from_dict(read_profile_json(path))
    return load_profile(spec)
