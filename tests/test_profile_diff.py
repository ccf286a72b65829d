"""`shard probe --diff A B`: the limits and facts that differ between two profiles, with each side's evidence."""

import json
from importlib import resources

from conftest import shard_cli

from shard.profile import diff_profiles, load_profile, profile_at


def test_diff_names_each_limit_that_moved_and_each_side_evidence(tmp_path):
    data = json.loads(resources.files("shard.targets").joinpath("profiles/rk3588.json").read_text())
    data["limits"]["add-width@h2"].update(value=10000, evidence="a newer toolkit: N=10000 passes")
    del data["limits"]["mul-width@h1"]
    data["facts"]["job_timeout_s"] = 5.0
    (tmp_path / "new.json").write_text(json.dumps(data))
    limits, facts = diff_profiles(load_profile("rk3588"), profile_at(str(tmp_path / "new.json")))
    assert [d.name for d in limits] == ["add-width@h2", "mul-width@h1"]
    assert limits[0].a.value == 12286 and limits[0].b.value == 10000 and limits[1].b is None
    assert facts == {"job_timeout_s": (6.0, 5.0)}
    res = shard_cli("probe", "--diff", "rk3588", tmp_path / "new.json", env_extra={"COLUMNS": "250"})
    assert res.returncode == 0, res.stderr
    assert "a newer toolkit: N=10000 passes" in res.stdout and "2 limits differ" in res.stdout
    assert shard_cli("probe", "--diff", "rk3588", tmp_path / "none.json").returncode == 1
