"""Load, trace and plan files: every accepted form, round trips, and errors that name the field."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from moewatch.plan import Plan
from moewatch.planner import files


def test_loads_from_npy_json_and_sglang_pt(tmp_path):
    steps = np.arange(24, dtype=np.int64).reshape(2, 3, 4)
    np.save(tmp_path / "a.npy", steps[0])
    np.save(tmp_path / "s.npy", steps)
    (tmp_path / "bare.json").write_text(json.dumps(steps[0].tolist()))
    (tmp_path / "obj.json").write_text(json.dumps({"logical_count": steps.tolist()}))
    torch.save({"logical_count": torch.tensor(steps, dtype=torch.int32), "other": torch.zeros(1)}, tmp_path / "d.pt")
    assert files.read_load(tmp_path / "a.npy").steps is None
    for name in ("s.npy", "obj.json", "d.pt"):
        got = files.read_load(tmp_path / name)
        assert got.load.tolist() == steps.sum(axis=0).tolist()
        assert got.steps.shape == (2, 3, 4)
    assert files.read_load(tmp_path / "d.pt").source == "sglang-pt"
    assert files.read_load(tmp_path / "bare.json").load.tolist() == steps[0].tolist()


def test_sglang_dump_without_torch_is_a_clear_error(tmp_path, monkeypatch):
    torch.save({"logical_count": torch.ones(1, 2, 3)}, tmp_path / "d.pt")
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now raises ImportError
    with pytest.raises(files.FileFormatError, match="needs torch"):
        files.read_load(tmp_path / "d.pt")


def test_sglang_pt_errors_are_the_dump_reader_s_naming_the_file(tmp_path):
    # One reader of SGLang's dumps (moewatch.integrations.sglang.dump): its checks, the planner's error type.
    (tmp_path / "cut.pt").write_bytes(b"PK\x03\x04 truncated")
    torch.save({"logical_count": torch.ones(2, 3, 4)}, tmp_path / "floats.pt")
    torch.save({"records": [], "last_physical_to_logical_map": torch.zeros(2, 4, dtype=torch.int64)},
               tmp_path / "rank.pt")
    for name, words in (("cut.pt", "not a loadable torch file"), ("floats.pt", "logical_count: expected integers"),
                        ("rank.pt", "a per_pass dump holds one rank's counts")):
        with pytest.raises(files.FileFormatError) as info:
            files.read_load(tmp_path / name)
        assert str(info.value).startswith(f"{tmp_path / name}: ") and words in str(info.value)
        assert str(info.value).count(str(tmp_path)) == 1


@pytest.mark.parametrize("content, message", [
    ("[[1, 2], [3]]", "ragged"),
    ('{"counts": [[1]]}', "logical_count"),
    ("[[1, -2]]", ">= 0"),
    ('[[1, "a"]]', "numbers"),
    ("[1, 2]", "matrix"),
    ("[[NaN, 1]]", "non-finite"),
    ("{", "not valid JSON"),
    ("[[[[1]]]]", "dimensions"),
])
def test_bad_load_files_name_the_problem(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(files.FileFormatError, match=message):
        files.read_load(path)


def test_unknown_or_missing_load_file(tmp_path):
    with pytest.raises(files.FileFormatError, match="no such file"):
        files.read_load(tmp_path / "none.npy")
    (tmp_path / "x.csv").write_text("1,2")
    with pytest.raises(files.FileFormatError, match="unknown load file type"):
        files.read_load(tmp_path / "x.csv")
    (tmp_path / "bad.npy").write_bytes(b"nope")
    with pytest.raises(files.FileFormatError, match="npy"):
        files.read_load(tmp_path / "bad.npy")


def test_plans_round_trip_in_both_formats(tmp_path):
    plan = Plan(3, [[0, 1, 1, 2]], [1.25], reason="r", meta={"k": 1})
    files.write_plan(tmp_path / "m.json", plan, "moewatch")
    files.write_plan(tmp_path / "s.json", plan, "sglang")
    back = files.read_plan(tmp_path / "m.json")
    assert back.to_dict() == plan.to_dict()
    sglang = json.loads((tmp_path / "s.json").read_text())
    assert sglang == {"physical_to_logical_map": [[0, 1, 1, 2]]}
    from_sglang = files.read_plan(tmp_path / "s.json")
    assert from_sglang.physical_to_logical_map.tolist() == [[0, 1, 1, 2]]
    assert from_sglang.epoch == 0 and from_sglang.capacity_factor.tolist() == [0.0]


@pytest.mark.parametrize("content, message", [
    ('{"experts": 1}', "physical_to_logical_map"),
    ('{"physical_to_logical_map": [[0, -1]]}', "negative expert id"),
    ('{"physical_to_logical_map": [[0, 1]], "epoch": 1}', "capacity_factor"),
])
def test_bad_plan_files(tmp_path, content, message):
    path = tmp_path / "p.json"
    path.write_text(content)
    with pytest.raises(files.FileFormatError, match=message):
        files.read_plan(path)


def test_affinity_files(tmp_path):
    trace = np.zeros((5, 3, 2), dtype=np.int64)
    trace[:, :, 1] = 1
    trans = np.ones((2, 4, 4))
    np.save(tmp_path / "t.npy", trace)
    np.save(tmp_path / "x.npy", trans)
    np.savez(tmp_path / "z.npz", transitions=trans)
    (tmp_path / "t.json").write_text(json.dumps({"trace": trace.tolist()}))
    assert files.read_affinity(tmp_path / "t.npy", 3, 4)[0] == "trace"
    assert files.read_affinity(tmp_path / "x.npy", 3, 4)[0] == "transitions"
    assert files.read_affinity(tmp_path / "z.npz", 3, 4)[0] == "transitions"
    assert files.read_affinity(tmp_path / "t.json", 3, 4)[0] == "trace"
    with pytest.raises(files.FileFormatError, match="layers"):
        files.read_affinity(tmp_path / "t.json", 4, 4)
    with pytest.raises(files.FileFormatError, match=r"\[0, 1\)"):
        files.read_affinity(tmp_path / "t.npy", 3, 1)
    with pytest.raises(files.FileFormatError, match="neither"):
        files.read_affinity(tmp_path / "x.npy", 5, 4)
