"""A recorded placement served statically (moewatch.planner.static_placement) and `moewatch plan` from
recorded windows for an engine's slot count: the file is read once with errors naming
MOEWATCH_EPLB_PLACEMENT; a placement that does not fit the engine says what differs; the decision
serves the file's rows, placed where they change and kept once in force."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from click.testing import CliRunner

from moewatch.cli import main
from moewatch.planner.rebalance import OUTCOMES, STATIC_KEPT, STATIC_PLACED
from moewatch.planner.static_placement import PLACEMENT_VARIABLE, StaticPlacement, static_decision
from moewatch.tools.examples import production_window

PMAP = [[0, 1, 2, 3, 0, 1], [3, 2, 1, 0, 3, 2]]


def placement_file(tmp_path, data) -> str:
    path = tmp_path / "placement.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_unset_or_empty_means_no_static_placement():
    assert StaticPlacement.from_env({}) is None
    assert StaticPlacement.from_env({PLACEMENT_VARIABLE: " "}) is None


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    ("{not json", "not valid JSON"),
    ({"slots": []}, "physical_to_logical_map"),
    ({"physical_to_logical_map": [[0, -1]]}, "negative expert id"),
])
def test_a_bad_file_is_refused_naming_the_variable(tmp_path, content, message):
    path = str(tmp_path / "absent.json") if content is None else placement_file(tmp_path, content)
    with pytest.raises(ValueError) as caught:
        StaticPlacement.from_env({PLACEMENT_VARIABLE: path})
    assert str(caught.value).startswith(f"{PLACEMENT_VARIABLE}: ") and message in str(caught.value)


def test_both_plan_formats_are_read(tmp_path):
    sglang = StaticPlacement.from_env({PLACEMENT_VARIABLE: placement_file(tmp_path, {"physical_to_logical_map": PMAP})})
    assert sglang.physical_to_logical_map.tolist() == PMAP and sglang.shape == (2, 6)
    moewatch = StaticPlacement.from_env({PLACEMENT_VARIABLE: placement_file(tmp_path, {
        "epoch": 3, "physical_to_logical_map": PMAP, "capacity_factor": [0, 0]})})
    assert moewatch.physical_to_logical_map.tolist() == PMAP


@pytest.mark.parametrize("sizes, differs", [
    ((2, 4, 6, 2), None),
    ((3, 4, 6, 2), "2 layers where the engine has 3 MoE layers"),
    ((2, 4, 8, 2), "6 slots where the engine has 8 physical experts"),
    ((2, 4, 6, 4), "6 slots that do not divide over the engine's 4 ranks"),
    ((2, 3, 6, 2), "expert id 3 where the engine has 3 logical experts"),
    ((2, 5, 6, 2), "layer 0 gives logical expert 4 of the engine's 5 no slot"),
])
def test_a_mismatch_names_what_differs(sizes, differs):
    got = StaticPlacement("p.json", np.array(PMAP)).mismatch(*sizes)
    if differs is None:
        assert got is None
    else:
        assert got.startswith(f"{PLACEMENT_VARIABLE} (p.json) holds ") and differs in got


def test_the_decision_places_the_rows_that_change_and_keeps_those_in_force():
    placement = StaticPlacement("p.json", np.array(PMAP))
    load = np.array([[50, 10, 10, 10], [10, 10, 10, 50]])
    fresh = static_decision(placement, load, None, 2)
    assert fresh.physical_to_logical_map.tolist() == PMAP and fresh.reasons == (STATIC_PLACED,) * 2
    current = np.array([PMAP[0], [0, 1, 2, 3, 0, 1]])
    decision = static_decision(placement, load, current, 2)
    assert decision.reasons == (STATIC_KEPT, STATIC_PLACED)
    assert decision.experts_moved.tolist() == [0, 6]
    record = decision.record()
    assert record["layer_outcomes"] == {OUTCOMES[STATIC_KEPT]: 1, OUTCOMES[STATIC_PLACED]: 1}
    assert record["layers_moved"] == 1 and record["experts_moved"] == 6
    assert decision.balancedness_after[1] > decision.balancedness_before[1]  # its hot expert gets two slots
    again = static_decision(placement, load, decision.physical_to_logical_map, 2)
    assert again.reasons == (STATIC_KEPT,) * 2 and again.experts_moved.sum() == 0


def write_windows(folder, windows) -> None:
    folder.mkdir()
    for i, w in enumerate(windows):
        (folder / f"window-{i}.json").write_text(w.to_json())
    (folder / "window-9.json.tmp").write_text("half written")  # a writer's temporary file: not a window yet


def small_window(seed: int, num_experts: int = 16, num_slots: int = 24):
    return production_window(seed, num_layers=3, num_experts=num_experts, num_slots=num_slots, world_size=4,
                             top_k=2, tokens_per_step=64, steps=2)


def test_plan_from_a_folder_of_windows_takes_their_summed_load_and_the_engines_slot_count(tmp_path):
    windows = [small_window(seed) for seed in range(3)]
    write_windows(tmp_path / "windows", windows)
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(main, ["plan", "--load", str(tmp_path / "windows"), "--gpus", "4", "--out", str(out),
                                       "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["windows"] == 3 and summary["num_slots"] == 24  # the windows' slot count, unasked
    np.save(tmp_path / "load.npy", sum(w.expert_tokens for w in windows))
    same = tmp_path / "same.json"
    assert CliRunner().invoke(main, ["plan", "--load", str(tmp_path / "load.npy"), "--gpus", "4", "--slots", "24",
                                     "--out", str(same)]).exit_code == 0
    assert json.loads(out.read_text())["physical_to_logical_map"] == json.loads(same.read_text())[
        "physical_to_logical_map"]


def test_plan_from_windows_refuses_a_window_of_other_sizes_or_without_expert_counts(tmp_path):
    write_windows(tmp_path / "mixed", [small_window(0), small_window(1, num_experts=8, num_slots=16)])
    result = CliRunner().invoke(main, ["plan", "--load", str(tmp_path / "mixed"), "--gpus", "4", "--out",
                                       str(tmp_path / "p.json")])
    assert result.exit_code == 2 and "window-1.json: expert_tokens: [3, 8]" in result.output
    w = small_window(0)
    totals = dataclasses.replace(w, expert_tokens=None, dropped_tokens=None, rerouted_tokens=None,
                                 rank_tokens=w.slot_tokens.reshape(3, 4, 6).sum(axis=2))
    write_windows(tmp_path / "totals", [totals])
    result = CliRunner().invoke(main, ["plan", "--load", str(tmp_path / "totals"), "--gpus", "4", "--out",
                                       str(tmp_path / "p.json")])
    assert result.exit_code == 2 and "a window of per-rank totals has no load per expert" in result.output
    (tmp_path / "empty").mkdir()
    result = CliRunner().invoke(main, ["plan", "--load", str(tmp_path / "empty"), "--gpus", "4", "--out",
                                       str(tmp_path / "p.json")])
    assert result.exit_code == 2 and "no window files" in result.output
