"""The compile summary (shard.summary): every record a compile can make prints, from its fields; a
report missing a field every compile writes is refused in one line naming it."""

from __future__ import annotations

import dataclasses
import typing

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console

import shard
from shard import summary
from shard.errors import ShardError
from shard.options import CompileOptions
from shard.summary import (SpeedRow, StageSummary, Summary, image_room_lines, shards_table, speed_lines, speed_table,
                           stage_lines, stage_table, summary_lines)

RECORDS = [cls for cls in vars(summary).values() if dataclasses.is_dataclass(cls) and cls.__module__ == summary.__name__]
TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), max_size=30)   # brackets too: markup
NUMBER = st.one_of(st.integers(-10**12, 10**12), st.floats(allow_nan=True, allow_infinity=True))
STEP = st.one_of(   # host steps in the manifest's forms (shard.runtime.host)
    st.fixed_dictionaries({"op": st.just("slice"), "input": TEXT, "output": TEXT, "axis": st.integers(0, 3),
                           "start": st.integers(0, 9), "end": st.integers(0, 9)}),
    st.fixed_dictionaries({"op": st.just("concat"), "inputs": st.lists(TEXT, min_size=1, max_size=3), "output": TEXT,
                           "axis": st.integers(0, 3)}),
    st.fixed_dictionaries({"op": st.just("onnx"), "type": TEXT, "inputs": st.lists(TEXT, min_size=1, max_size=3),
                           "outputs": st.lists(TEXT, min_size=1, max_size=2), "attrs": st.just({}),
                           "constants": st.just({})}))


def every_field(cls) -> st.SearchStrategy:
    """A record with every field drawn (defaults too): text with markup's brackets, any number."""
    hints = typing.get_type_hints(cls, vars(summary))
    fields = {}
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if f.name in ("host_pre", "host_post"):
            fields[f.name] = st.lists(STEP, max_size=5)
        elif kind in (int, float, int | None, float | None):
            fields[f.name] = NUMBER | st.none() if type(None) in typing.get_args(kind) else NUMBER
        else:
            fields[f.name] = st.from_type(kind)
    return st.builds(cls, **fields)


for record_class in RECORDS:
    st.register_type_strategy(record_class, st.deferred(lambda cls=record_class: every_field(cls)))
st.register_type_strategy(str, TEXT)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(every_field(Summary))
def test_every_summary_a_compile_can_make_prints(s):
    """Any Summary, every record in it filled (hypothesis over the records' fields, text holding rich's
    markup brackets): the lines and the table print without an error, one line per entry."""
    console = Console(width=160, file=None, record=True)
    with console.capture():
        console.print(shards_table(s))
        lines = summary_lines(s)
        for line in lines:
            console.print(line)
    assert len(lines) >= 2 + len(s.warnings) + len(s.choices)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(every_field(StageSummary), st.lists(every_field(SpeedRow), min_size=1, max_size=3),
       st.integers(1, 16), st.integers(1, 4096), st.integers(1, 1024))
def test_every_gpu_stage_summary_and_generative_prediction_prints(staged, rows, squares, tokens, capacity):
    """A GPU target's stages, FP8 rounds and --batch auto, and a generative bundle's predicted speed and
    an image's room in the context: any records print (a prediction of None prints as '-')."""
    console = Console(width=160, record=True)
    with console.capture():
        for item in (stage_table(staged.stages, "stages"), *stage_lines(staged), speed_table(rows), *speed_lines(rows),
                     *image_room_lines(squares, tokens, 224, capacity, rows[0])):
            console.print(item)


def test_a_change_without_its_action_is_refused_in_one_line_naming_it():
    """The CLIP text encoder's compile ended in KeyError: 'action' printing its changes; a report
    lacking a field every change has is refused where it is read, naming the entry."""
    report = {"shards": [], "totals": {"shards": 0, "overflow_lines": 0, "cpu_ops": 0, "fallbacks": 0,
                                       "estimated_cycles": 0},
              "passes": {"npu_forms": {"changes": [{"node": "n", "op": "Softmax", "reason": "r"}]}}}
    with pytest.raises(ShardError, match=r"report passes\.npu_forms\.changes\[0\]: no 'action'"):
        Summary.of(report)
    report["passes"]["npu_forms"]["changes"][0]["action"] = "a"
    assert any("npu_forms: n (Softmax): r; a" in line for line in summary_lines(Summary.of(report)))


def test_a_real_compile_report_reads_into_the_summary(tmp_path, save):
    """A compile's own report (cpu target: no toolkit) is read into records whose fields are its values."""
    from conftest import add_model

    result = shard.compile(save(add_model([1, 1, 4, 32])), "cpu", tmp_path / "a.shard", CompileOptions())
    s = Summary.of(result.report)
    assert s.totals.shards == result.report["totals"]["shards"] == len(s.shards)
    assert [row.name for row in s.shards] == [r["name"] for r in result.report["shards"]]
    assert {p.name for p in s.passes} == set(result.report["passes"])
    assert np.isclose(s.seconds, result.report["seconds"]["total"])
    assert any(line.startswith(f"{s.totals.shards} ") for line in summary_lines(s))
