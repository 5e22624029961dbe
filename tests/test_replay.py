"""`moewatch replay`'s pure parts on hand-made numbers (the cost model fit, the rebalance schedule, the
figures of one replay worked out by hand, the migration cost, the recommendation and its settings) and
the command end to end on hand-made windows without the engines' environments (off, static, moewatch).
The engines' own policies on windows the real vLLM CPU build wrote: tests/runtime/engines/test_replay_recorded.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moewatch.replay.cost_fit import MigrationCost, StepCost, busiest_pairs_per_step, fit_step_cost, migration_cost
from moewatch.replay.intervals import (Interval, default_intervals, maps_over_time, parse_intervals,
                                       rebalance_loads, rebalance_points)
from moewatch.replay.recommend import choose, rebalance_settings, recommend, static_settings
from moewatch.replay.replay import Geometry, Recording, run_figures
from moewatch.telemetry import Window

REPO = Path(__file__).resolve().parents[1]


# --- the cost model fit --------------------------------------------------------------------------

def test_the_fit_recovers_fixed_per_busiest_pair_and_per_token_seconds_when_they_vary_apart():
    busiest = np.array([100.0, 300.0, 200.0, 400.0, 50.0, 250.0])
    tokens = np.array([10.0, 5.0, 40.0, 20.0, 30.0, 12.0])
    seconds = 0.01 + 2e-5 * busiest + 1e-4 * tokens
    cost = fit_step_cost(busiest, tokens, seconds)
    assert cost.source == "fitted" and cost.samples == 6 and cost.note == ""
    assert cost.seconds_per_busiest_pair == pytest.approx(2e-5, rel=1e-6)
    assert cost.seconds_per_token == pytest.approx(1e-4, rel=1e-6)
    assert cost.fixed_seconds == pytest.approx(0.01, rel=1e-6)
    assert cost.r2 == pytest.approx(1.0)


def test_windows_slowed_by_something_else_do_not_move_the_fit():
    """Two windows of ten slowed by 0.2 s (another process on the host): a least-squares fit would take a
    slope from them; the median regression keeps the line the other eight lie on."""
    busiest = np.array([100.0, 900.0, 200.0, 800.0, 300.0, 700.0, 400.0, 600.0, 500.0, 150.0])
    seconds = 0.004 + 2e-5 * busiest
    seconds[[2, 4]] += 0.2  # two small windows slowed
    cost = fit_step_cost(busiest, busiest / 8, seconds)
    assert cost.seconds_per_busiest_pair == pytest.approx(2e-5, rel=1e-6)
    assert cost.fixed_seconds == pytest.approx(0.004, rel=1e-6)
    assert cost.median_abs_residual_seconds == pytest.approx(0.0, abs=1e-9)


def test_tokens_that_move_with_the_busiest_gpu_are_absorbed_and_the_fit_says_its_gain_is_an_upper_bound():
    busiest = np.array([100.0, 300.0, 200.0, 400.0])
    seconds = 0.01 + 2e-5 * busiest + 1e-4 * (busiest / 4)  # one rank: tokens are pairs / top-k
    cost = fit_step_cost(busiest, busiest / 4, seconds)
    assert cost.seconds_per_token is None
    assert cost.seconds_per_busiest_pair == pytest.approx(2e-5 + 1e-4 / 4, rel=1e-6)
    assert "upper bound" in cost.note


def test_a_fit_needs_three_timed_windows_and_a_busiest_load_that_varies():
    two = fit_step_cost(np.array([1.0, 2.0, 3.0]), np.full(3, np.nan), np.array([0.1, 0.2, np.nan]))
    assert (two.source, two.known, two.samples) == ("unknown", False, 2)
    assert "needs 3" in two.note
    flat = fit_step_cost(np.full(4, 5.0), np.full(4, np.nan), np.array([0.1, 0.2, 0.1, 0.3]))
    assert not flat.known and "never varied" in flat.note


def test_busiest_pairs_per_step_spreads_an_experts_load_over_its_replicas():
    loads = np.array([[[8.0, 0.0]], [[8.0, 4.0]]])  # [T=2, L=1, E=2]
    maps = np.array([[[0, 0, 1, 1]], [[0, 1, 0, 1]]])  # W=2: slots 0-1 on rank 0, 2-3 on rank 1
    got = busiest_pairs_per_step(loads, maps, np.array([2, 4]), 2)
    np.testing.assert_allclose(got, [8.0 / 2, 6.0 / 4])


# --- the schedule ---------------------------------------------------------------------------------

def test_rebalances_happen_at_window_boundaries_once_the_interval_is_reached_never_after_the_last():
    steps = np.array([2, 2, 2, 2, 2])
    assert rebalance_points(steps, Interval(4, "steps")) == [1, 3]
    assert rebalance_points(steps, Interval(3, "steps")) == [1, 3]
    assert rebalance_points(steps, Interval(1, "windows")) == [0, 1, 2, 3]
    assert rebalance_points(steps, Interval(5, "windows")) == []
    loads = np.arange(5, dtype=np.float64).reshape(5, 1, 1)
    np.testing.assert_array_equal(rebalance_loads(loads, [1, 3]).ravel(), [0 + 1, 2 + 3])
    initial, a, b = np.array([[0, 1]]), np.array([[1, 0]]), np.array([[1, 1]])
    over = maps_over_time(initial, [1, 3], np.stack([a, b]), 5)
    assert [m.tolist() for m in over] == [[[0, 1]], [[0, 1]], [[1, 0]], [[1, 0]], [[1, 1]]]


def test_intervals_parse_steps_and_windows_and_refuse_the_rest_naming_the_flag():
    assert parse_intervals("500, 4w,500") == (Interval(500, "steps"), Interval(4, "windows"))
    assert Interval(4, "windows").steps(2.5) == 10
    for bad in ("0", "-3", "4x", "w", ""):
        with pytest.raises(ValueError, match="--intervals"):
            parse_intervals(bad)
    assert [i.label for i in default_intervals(12)] == ["1w", "2w", "4w"]


# --- one replay, worked out by hand ---------------------------------------------------------------

def test_one_rebalance_is_priced_by_hand_gain_stall_net_and_net_per_hour():
    """L=1, E=2, W=2, P=4. The start holds expert 0 twice on rank 0 and expert 1 twice on rank 1; every
    window routes 8 pairs to expert 0 over 2 steps: rank 0 carries 4 pairs per step, balancedness 0.5.
    One rebalance after window 0 moves slots 1 and 2 (expert 0 on both ranks): 2 pairs per step, 1.0."""
    rec = Recording(np.array([[[8.0, 0.0]]] * 3), np.array([2, 2, 2]), np.array([0.5, 0.5, 0.5]))
    initial = np.array([[0, 0, 1, 1]])
    moved = np.array([[[0, 1, 0, 1]]])
    geometry = Geometry(4, 2, 1, 1, initial)
    cost = StepCost(0.01, 0.0, None, "operator", "", 0, None)
    migration = MigrationCost(100.0, "operator", 1e4, "operator")
    maps = maps_over_time(initial, [0], moved, 3)
    off = busiest_pairs_per_step(rec.loads, np.stack([initial] * 3), rec.steps, 2)
    f = run_figures(rec, geometry, maps, [0], moved, cost, migration, off)
    assert f["rebalances"] == 1 and f["slots_moved"] == 2 and f["bytes_moved"] == 200.0
    assert f["stall_seconds"] == pytest.approx(2 * 100.0 / 1e4)
    assert f["gain_seconds"] == pytest.approx(0.01 * (2 * (4 - 2) + 2 * (4 - 2)))
    assert f["net_seconds"] == pytest.approx(0.08 - 0.02)
    assert f["serving_seconds"] == pytest.approx(3.0)
    assert f["net_seconds_per_hour"] == pytest.approx(0.06 / 3.0 * 3600)
    assert f["balancedness_per_window"] == pytest.approx([0.5, 1.0, 1.0])
    assert f["balancedness"] == pytest.approx((0.5 + 1.0 + 1.0) / 3)
    move = f["moves"][0]
    assert (move["after_window"], move["balancedness_before"], move["balancedness_after"]) == (0, 0.5, 1.0)


def test_static_is_measured_out_of_sample_each_half_under_the_placement_solved_from_the_other_half():
    """The first two windows' load differs from the last two's: the placement solved from one half is measured
    on the other (which differs from measuring the all-windows placement); the one move priced is the
    all-windows placement's, from the start."""
    from moewatch.planner.placement_math import contiguous_placement, placement_balancedness
    from moewatch.replay.replay import replay, static_map

    hot_early = np.array([[25.0, 19, 15, 8, 9, 2, 3, 1]])
    hot_late = np.array([[6.0, 24, 19, 27, 15, 18, 29, 22]])
    rec = Recording(np.stack([hot_early, hot_early, hot_late, hot_late]), np.full(4, 2), np.full(4, 0.1))
    geometry = Geometry(8, 2, 1, 1, contiguous_placement(1, 8, 8))
    cost = StepCost(0.01, 0.0, None, "operator", "", 0, None)
    migration = MigrationCost(100.0, "operator", 1e6, "operator")
    got = replay(rec, geometry, ("off", "static"), (Interval(1, "windows"),), cost, migration,
                 run_engine=lambda *args: pytest.fail("no engine policy was asked for"))
    f = got["policies"]["static"]["-"]
    from_late, from_early = static_map(rec.loads[2:], geometry), static_map(rec.loads[:2], geometry)
    expected = [placement_balancedness(rec.loads[t], from_late if t < 2 else from_early, 2).mean() for t in range(4)]
    assert f["balancedness_per_window"] == pytest.approx(expected)
    in_sample = [placement_balancedness(rec.loads[t], got["static_map"], 2).mean() for t in range(4)]
    assert abs(sum(in_sample) - sum(expected)) > 0.05  # the two measures tell apart here
    assert f["slots_moved"] == int((got["static_map"] != geometry.initial).sum()) == len(f["moves"]) * f["slots_moved"]
    assert f["net_seconds"] == pytest.approx(f["gain_seconds"] - f["slots_moved"] * 100.0 / 1e6)


def test_the_migration_cost_is_the_operators_else_measured_in_the_windows_else_assumed_and_said_so():
    records = [{"window": 1, "bytes_moved": 1000.0, "slots_moved": 10}]
    times = [np.array([0.1, 0.1]), np.array([0.1, 0.1, 0.6]), None]
    measured = migration_cost(records, times)
    assert measured.expert_bytes == 100.0 and measured.bytes_per_second == pytest.approx(1000.0 / 0.5)
    assert measured.rate_source.startswith("measured") and not measured.assumed
    given = migration_cost(records, times, expert_bytes=7.0, bytes_per_second=3.0)
    assert (given.expert_bytes, given.bytes_per_second) == (7.0, 3.0)
    assert given.expert_bytes_source.startswith("operator") and given.rate_source.startswith("operator")
    nothing = migration_cost([], times)
    assert nothing.assumed and nothing.rate_source.startswith("assumed")


# --- the recommendation ---------------------------------------------------------------------------

def _figures(net, slots=10, balancedness=0.9):
    return {"net_seconds_per_hour": net, "slots_moved": slots, "balancedness": balancedness}


def _result(**policies):
    return {"intervals": [{"label": "100", "steps": 100, "rebalances": 5, "enough_rebalances": True},
                          {"label": "1000", "steps": 1000, "rebalances": 1, "enough_rebalances": False}],
            "policies": {"off": {"-": _figures(0.0, 0)}, **policies}}


def test_the_choice_is_the_best_net_the_engine_can_run_at_an_interval_that_rebalanced_twice():
    result = _result(static={"-": _figures(20.0)},
                     vllm_default={"100": _figures(30.0), "1000": _figures(500.0)},  # once only: not chosen
                     sglang_deepseek={"100": _figures(90.0)},  # not vLLM's: shown, never chosen for vLLM
                     moewatch={"100": _figures(40.0)})
    best = choose(result, "vllm", min_gain=0.0)
    assert (best.policy, best.interval) == ("moewatch", "100")
    assert choose(result, "sglang", min_gain=0.0).policy == "sglang_deepseek"
    # Below min_gain of the hour (0.1 % = 3.6 s), EPLB stays off.
    low = _result(static={"-": _figures(3.0)}, moewatch={"100": _figures(2.0)})
    assert choose(low, "vllm", min_gain=0.001).policy == "off"
    assert choose(low, "vllm", min_gain=0.0).policy == "static"
    # Equal nets go to fewer slots moved.
    tie = _result(static={"-": _figures(50.0, slots=40)}, moewatch={"100": _figures(50.0, slots=12)})
    assert choose(tie, "vllm", 0.0).policy == "moewatch"


CONTEXT = {"num_experts": 16, "slots": 20, "ranks": 4, "nodes": 1, "load_paths": ["/var/w"], "seconds_per_pair": 2e-6,
           "expert_bytes": 1e6, "bytes_per_second": 1e9}


def test_the_settings_carry_the_interval_the_redundant_slots_and_moewatchs_switch():
    vllm = rebalance_settings("vllm", "moewatch", 300, CONTEXT)
    assert vllm["eplb_config"] == {"window_size": 300, "step_interval": 300, "num_redundant_experts": 4}
    assert vllm["args"] == ("--enable-expert-parallel --enable-eplb --eplb-config "
                            "'{\"window_size\": 300, \"step_interval\": 300, \"num_redundant_experts\": 4}'")
    env = dict(item.split("=") for item in vllm["env"].split())
    assert env["MOEWATCH_EPLB"] == "1" and env["MOEWATCH_EPLB_HORIZON_STEPS"] == "300"
    assert float(env["MOEWATCH_EPLB_SECONDS_PER_PAIR"]) == 2e-6
    assert rebalance_settings("vllm", "vllm_default", 300, CONTEXT)["env"] == ""
    static = static_settings("vllm", CONTEXT)
    assert static["env"] == "MOEWATCH_EPLB=1 MOEWATCH_EPLB_PLACEMENT=placement.json"
    assert static["plan"] == "moewatch plan --load /var/w --gpus 4 --slots 20 --out placement.json"
    sglang_static = static_settings("sglang", CONTEXT)
    assert "--enable-eplb" not in sglang_static["args"] and "--format sglang" in sglang_static["plan"]


def test_sglangs_own_server_args_parse_the_flags_the_replay_prints():
    """SGLang 0.5.23's ServerArgs.add_cli_args builds the parser its launcher uses."""
    import argparse
    import shlex

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    dynamic = parser.parse_args(["--model-path", "m", *shlex.split(rebalance_settings("sglang", "sglang_deepseek",
                                                                                      300, CONTEXT)["args"])])
    assert (dynamic.enable_eplb, dynamic.eplb_algorithm, dynamic.eplb_rebalance_num_iterations,
            dynamic.ep_num_redundant_experts) == (True, "deepseek", 300, 4)
    static = parser.parse_args(["--model-path", "m", *shlex.split(static_settings("sglang", CONTEXT)["args"])])
    assert (static.enable_eplb, static.init_expert_location) == (False, "expert_location.json")


def test_a_recommendation_names_what_it_chose_and_off_says_what_came_closest():
    result = _result(static={"-": _figures(1.0)}, moewatch={"100": _figures(-5.0)})
    advice = recommend(result, "vllm", CONTEXT)
    assert advice.choice == "off" and advice.settings["args"] == ""
    assert "static, nets 1 s per hour" in advice.why
    advice = recommend(_result(moewatch={"100": _figures(40.0)}), "vllm", CONTEXT)
    assert (advice.choice, advice.interval_steps) == ("rebalance", 100)
    assert advice.settings["eplb_config"]["step_interval"] == 100


def test_the_alternatives_are_each_runnable_policys_best_interval_with_its_settings():
    from moewatch.replay.recommend import alternatives

    result = _result(static={"-": _figures(-1.0)}, moewatch={"100": _figures(4.0), "1000": _figures(9.0)},
                     vllm_default={"100": _figures(-3.0)}, sglang_deepseek={"100": _figures(50.0)})
    result["intervals"].append({"label": "500", "steps": 500, "rebalances": 3, "enough_rebalances": True})
    result["policies"]["moewatch"]["500"] = _figures(6.0)
    got = alternatives(result, "vllm", CONTEXT)
    assert sorted(got) == ["moewatch", "static", "vllm_default"]  # not SGLang's; off needs no settings
    assert (got["moewatch"]["interval"], got["moewatch"]["net_seconds_per_hour"]) == ("500", 6.0)  # 1000: once
    assert got["moewatch"]["settings"]["eplb_config"]["step_interval"] == 500
    assert got["static"]["settings"]["env"].endswith("MOEWATCH_EPLB_PLACEMENT=placement.json")


# --- the command on hand-made windows -------------------------------------------------------------

def vllm_like_window(load: np.ndarray, start: float, tokens: np.ndarray, seconds: np.ndarray, ep_group: str = "ep0",
                     extra: dict | None = None):
    """A window as vLLM's plugin writes one on a CPU build: one rank, logical counts, step times."""
    L, E = load.shape
    return Window(runtime="vllm", model="m", ep_group=ep_group, world_size=1, ranks_per_node=1, num_layers=L,
                  num_experts=E, num_slots=E, top_k=2, epoch=0, steps=len(tokens), start_time=start,
                  end_time=start + float(seconds.sum()), hidden_bytes=256,
                  physical_to_logical_map=np.broadcast_to(np.arange(E), (L, E)), expert_tokens=load.astype(np.int64),
                  dropped_tokens=np.zeros((L, E), np.int64), rerouted_tokens=np.zeros((L, E), np.int64),
                  capacity_factor=np.zeros(L), step_seconds=seconds, step_tokens=tokens, extra=extra or {})


def write_windows(folder: Path, count: int, seed: int = 0, ep_group: str = "ep0", extra: dict | None = None) -> Path:
    """`count` windows of 2 steps, experts 0 and 1 hot in every layer; the step time follows the pairs."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    L, E = 2, 8
    popularity = np.full(E, 1.0)
    popularity[:2] = 6.0
    popularity /= popularity.sum()
    for i in range(count):
        tokens = rng.integers(8, 64, 2)
        load = np.stack([rng.multinomial(int(tokens.sum()) * 2, popularity) for _ in range(L)])
        seconds = 0.002 + 1e-4 * tokens * 2 * L
        # written out of time order: the trace orders windows by their start time
        name = f"window-{(i * 7) % count:04d}-{i}.json"
        (folder / name).write_text(vllm_like_window(load, 1000.0 + i, tokens, seconds, ep_group, extra).to_json())
    return folder


def replay(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moewatch.cli", "replay", *args], capture_output=True, text=True,
                          timeout=300, cwd=REPO)


def test_the_command_replays_hand_made_windows_and_writes_the_result_the_picture_and_the_placement(tmp_path):
    windows = write_windows(tmp_path / "w", 12)
    out = tmp_path / "out"
    args = [str(windows), "--ranks", "2", "--slots", "8", "--policies", "static,moewatch", "--intervals", "1w,2w,4w",
            "--expert-bytes", "1000", "--migration-rate", "1e9", "--out", str(out)]
    text = replay(*args)
    assert text.returncode == 0, text.stderr
    assert "recommendation:" in text.stdout and f"wrote {out / 'replay.json'}" in text.stdout
    assert "replay: moewatch: " in text.stderr  # progress, on stderr
    result = json.loads((out / "replay.json").read_text())
    assert list(result["policies"]) == ["off", "static", "moewatch"]
    assert [i["rebalances"] for i in result["intervals"]] == [11, 5, 2]
    # Hot experts 0 and 1 both on rank 0 at the start: a static placement splits them; a slot moves in 1e-6 s.
    assert result["policies"]["static"]["-"]["balancedness"] > result["policies"]["off"]["-"]["balancedness"] + 0.1
    assert result["recommendation"]["policy"] in ("static", "moewatch")
    assert (out / "replay.svg").read_text().startswith("<svg") and (out / "placement.json").is_file()
    # --json prints the result file's content, nothing else
    machine = replay(*args, "--json")
    assert machine.returncode == 0
    printed = json.loads(machine.stdout)
    assert printed["policies"] == json.loads((out / "replay.json").read_text())["policies"] == result["policies"]


def test_too_few_windows_or_rebalances_give_one_line_and_exit_3(tmp_path):
    few = replay(str(write_windows(tmp_path / "few", 3)), "--ranks", "2", "--policies", "static")
    assert few.returncode == 3
    assert few.stderr.splitlines()[-1] == ("moewatch: replay: no recommendation: too few windows for a "
                                           "recommendation: 3 recorded, at least 4 needed")
    # The same windows given twice (the folder and a file in it) count once.
    folder = write_windows(tmp_path / "twice", 3)
    twice = replay(str(folder), str(sorted(folder.iterdir())[0]), "--ranks", "2", "--policies", "static")
    assert twice.returncode == 3 and twice.stderr.splitlines()[-1].endswith("3 recorded, at least 4 needed")
    once = replay(str(write_windows(tmp_path / "once", 6)), "--ranks", "2", "--policies", "moewatch",
                  "--intervals", "3w")
    assert once.returncode == 3
    assert once.stderr.splitlines()[-1].startswith("moewatch: replay: no recommendation: too few rebalances for a "
                                                   "recommendation: the shortest interval (3w) rebalances 1 time(s)")


def test_the_engines_configured_interval_is_replayed_too_and_one_rank_is_said_to_balance_alike(tmp_path):
    settings = {"rebalancing": {"interval_steps": 6, "asynchronous": True, "observed": False,
                                "source": "vllm eplb_config"}}
    got = replay(str(write_windows(tmp_path / "w", 8, extra=settings)), "--policies", "static", "--json")
    result = json.loads(got.stdout)
    assert [(i["label"], i["unit"]) for i in result["intervals"]] == [("1w", "windows"), ("2w", "windows"),
                                                                      ("6", "steps")]
    assert result["inputs"]["engine_rebalancing"]["interval_steps"] == 6
    assert result["notes"] and result["notes"][0].startswith("one rank")
    assert got.returncode == 0 and result["recommendation"]["choice"] == "off"


def test_shards_of_one_window_are_merged_as_the_agent_merges_them_and_a_refused_one_is_said(tmp_path):
    """Two data-parallel shards per window (extra.shard: index, count, rank, sequence); one shard of the
    third window has another epoch: it is left out of that window (moewatch.shards.agreement) and said."""
    from moewatch.replay.trace import read_trace

    folder = tmp_path / "shards"
    folder.mkdir()
    rng = np.random.default_rng(4)
    whole = []
    for sequence in range(4):
        parts = []
        for rank in range(2):
            load = rng.integers(0, 20, (2, 8))
            w = vllm_like_window(load, 1000.0 + sequence, np.array([5, 6]), np.array([0.01, 0.01])).replace(
                world_size=2, ranks_per_node=2,
                extra={"shard": {"index": rank, "count": 2, "rank": rank, "sequence": sequence}})
            if sequence == 2 and rank == 1:
                w = w.replace(epoch=5)
            else:
                parts.append(load)
            (folder / f"window-{sequence}-{rank}.json").write_text(w.to_json())
        whole.append(sum(parts))
    trace = read_trace([folder])
    assert trace.num_windows == 4 and trace.refused_shards == 1
    np.testing.assert_array_equal(trace.loads, np.stack(whole))
    got = replay(str(folder), "--policies", "static", "--json")
    assert "1 shard(s) disagreed" in " ".join(json.loads(got.stdout)["notes"])


def write_sglang_stat_dumps(folder: Path, count: int) -> Path:
    """SGLang's stat dumps as its recorder writes them (expert_distribution_recorder_{time}.pt, torch.save of
    {rank, logical_count int32 [B, L, E], average_utilization_rate_over_window}), one every 60 s, expert 4 hot."""
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(2)
    popularity = np.array([1.0, 1, 1, 1, 8, 1, 1, 1]) / 15
    for i in range(count):
        counts = np.stack([[rng.multinomial(64, popularity) for _ in range(2)] for _ in range(5)])  # [B=5, L=2, E=8]
        torch.save({"rank": 0, "logical_count": torch.from_numpy(counts.astype(np.int32)),
                    "average_utilization_rate_over_window": None},
                   folder / f"expert_distribution_recorder_{1_800_000_000 + 60 * i}.pt")
    return folder


def test_sglang_dumps_replay_in_time_order_and_without_a_step_clock_need_the_operators_step_figures(tmp_path):
    dumps = write_sglang_stat_dumps(tmp_path / "dumps", 6)
    common = [str(dumps), "--engine", "sglang", "--ranks", "2", "--slots", "10", "--policies", "static,moewatch",
              "--intervals", "1w", "--migration-rate", "1e12", "--expert-bytes", "1"]
    unpriced = replay(*common, "--json")
    assert unpriced.returncode == 3
    assert unpriced.stderr.splitlines()[-1].endswith("the gain cannot be priced: the windows carry too few step "
                                                     "times to fit (give --seconds-per-pair)")
    result = json.loads(unpriced.stdout)
    assert (result["inputs"]["windows"], result["inputs"]["steps"], result["inputs"]["runtime"]) == (6, 30, "sglang")
    assert len(result["inputs"]["files"]) == 6
    priced = replay(*common, "--seconds-per-pair", "1e-5", "--step-seconds", "0.05", "--json", "--out",
                    str(tmp_path / "out"))
    assert priced.returncode == 0, priced.stderr
    advice = json.loads(priced.stdout)["recommendation"]
    assert advice["engine"] == "sglang" and advice["policy"] in ("static", "moewatch")
    if advice["policy"] == "static":
        assert advice["settings"]["args"] == "--init-expert-location expert_location.json --ep-num-redundant-experts 2"
        assert (tmp_path / "out" / "expert_location.json").is_file()
    else:
        assert advice["settings"]["args"].startswith("--enable-eplb --eplb-algorithm deepseek")


@pytest.mark.parametrize("args, message", [
    (["{missing}"], "no such file or folder"),
    (["{w}", "--intervals", "0"], "--intervals: '0' is not a positive whole number"),
    (["{w}", "--policies", "round_robin"], "--policies: unknown policy 'round_robin'"),
    (["{w}", "--ranks", "3"], "slots"),
    (["{w}", "--groups", "3"], "--groups: 3 expert groups do not divide the windows' 8 experts"),
    (["{w}", "--policies", "vllm_default", "--vllm-python", "{missing}"], "--vllm-python:"),
    (["{w}", "{other}"], "replay one EP group's windows"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    w = write_windows(tmp_path / "w", 4)
    other = write_windows(tmp_path / "other", 4, seed=1, ep_group="ep1")
    got = replay(*[a.format(w=w, other=other, missing=tmp_path / "missing") for a in args])
    assert got.returncode == 2, got.stderr
    lines = [line for line in got.stderr.splitlines() if not line.startswith("replay: ")]
    assert len(lines) == 1 and lines[0].startswith("moewatch: error: replay: ") and message in lines[0], lines


def test_the_pictures_axes_are_labelled_at_round_values_that_include_zero():
    from moewatch.replay.svg import round_ticks

    assert round_ticks(-13.7, 13.9) == [-10.0, -5.0, 0.0, 5.0, 10.0]
    assert round_ticks(0.0, 1.0) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert round_ticks(0.741, 0.817) == [0.76, 0.78, 0.8]
    for lo, hi in [(-0.004, 0.0123), (3.0, 3.5), (-1e4, 2.0)]:
        ticks = round_ticks(lo, hi)
        assert 2 <= len(ticks) <= 6 and all(lo <= t <= hi for t in ticks)
