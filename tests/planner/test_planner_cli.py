"""`moewatch plan` and `moewatch whatif` from the command line: outputs,
and every bad input exits 2 with one line on stderr."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from moewatch.cli import main
from moewatch.plan import Plan
from moewatch.tools.synthetic import affinity_trace, synthetic_load


@pytest.fixture
def work(tmp_path):
    np.save(tmp_path / "load.npy", synthetic_load("zipf", 4, 32, pairs_per_layer=4000, seed=1))
    steps = np.stack([synthetic_load("lognormal", 4, 32, pairs_per_layer=800, seed=s) for s in range(6)])
    np.save(tmp_path / "steps.npy", steps)
    np.save(tmp_path / "trace.npy", affinity_trace(400, 4, 32, 2, 4, seed=0))
    return tmp_path


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_plan_writes_a_valid_plan_and_prints_json_only(work):
    out = work / "plan.json"
    result = run("plan", "--load", work / "load.npy", "--gpus", 8, "--slots", 40, "--nodes", 2, "--out", out, "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    for key in ("solve_seconds", "balancedness_before", "balancedness_after", "experts_moved",
                "cross_gpu_share_before", "cross_gpu_share_after", "cross_node_share_before", "cross_node_share_after"):
        assert key in summary
    plan = Plan.from_dict(json.loads(out.read_text()))
    plan.check_against(4, 32, 40, 8)
    assert plan.epoch == 1 and summary["balancedness_after"] > summary["balancedness_before"]


def test_plan_with_current_sglang_format_and_capacity(work):
    first = work / "first.json"
    assert run("plan", "--load", work / "load.npy", "--gpus", 8, "--slots", 40, "--out", first, "--format",
               "sglang").exit_code == 0
    second = work / "second.json"
    result = run("plan", "--load", work / "steps.npy", "--gpus", 8, "--current", first, "--out", second, "--json",
                 "--capacity-target", 0.02, "--top-k", 2, "--expert-bytes", 100)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["method"] == "movement" and summary["bytes_moved"] == 100.0 * summary["experts_moved"]
    plan = Plan.from_dict(json.loads(second.read_text()))
    assert plan.epoch == 1 and plan.num_slots == 40
    assert plan.capacity_factor.tolist() == summary["capacity"]["capacity_factor"]
    assert all(c > 0 for c in plan.capacity_factor)


def test_plan_with_affinity_reports_transition_shares(work):
    result = run("plan", "--load", work / "load.npy", "--gpus", 4, "--slots", 36, "--affinity", work / "trace.npy",
                 "--out", work / "a.json", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["method"] == "affinity"
    assert summary["transition_cross_gpu_share_after"] <= summary["transition_cross_gpu_share_before"]
    text = run("plan", "--load", work / "load.npy", "--gpus", 4, "--out", work / "b.json")
    assert text.exit_code == 0 and "balancedness" in text.stdout


def _bad_inputs(work):
    (work / "bad.json").write_text("{")
    (work / "neg.json").write_text("[[1, -1]]")
    np.save(work / "wrongtrace.npy", np.zeros((3, 9, 2), dtype=np.int64))
    (work / "plan1.json").write_text(json.dumps(Plan(0, [[0, 1]], [0.0]).to_dict()))
    (work / "plan4.json").write_text(json.dumps({"physical_to_logical_map": [list(range(31)) + [40]] * 4}))
    (work / "plan4ok.json").write_text(json.dumps({"physical_to_logical_map": [list(range(32))] * 4}))
    base = ["plan", "--load", work / "load.npy", "--out", work / "o.json"]
    return [
        ["plan", "--gpus", 4, "--out", work / "o.json"],  # missing --load
        base[:3] + ["--out", work / "o.json"],  # missing --gpus
        base + ["--gpus", 0],
        base + ["--gpus", "four"],
        base + ["--gpus", 4, "--nodes", 3],
        base + ["--gpus", 4, "--slots", 30],
        base + ["--gpus", 4, "--slots", 10],
        base + ["--gpus", 4, "--format", "vllm"],
        base + ["--gpus", 4, "--affinity", work / "wrongtrace.npy"],
        base + ["--gpus", 4, "--current", work / "plan1.json"],
        base + ["--gpus", 4, "--current", work / "missing.json"],
        base + ["--gpus", 2, "--current", work / "plan4.json"],  # plan holds expert 40 of 32
        base + ["--gpus", 2, "--slots", 64, "--current", work / "plan4ok.json"],
        base + ["--gpus", 4, "--capacity-target", 0.01],  # [L, E] load has no steps
        base + ["--gpus", 4, "--capacity-target", 1.5],
        base + ["--gpus", 4, "--balancedness-floor", 0],
        ["plan", "--load", work / "bad.json", "--gpus", 4, "--out", work / "o.json"],
        ["plan", "--load", work / "neg.json", "--gpus", 1, "--out", work / "o.json"],
        ["plan", "--load", work / "nope.npy", "--gpus", 4, "--out", work / "o.json"],
        ["plan", "--load", work / "load.npy", "--gpus", 4, "--out", work / "no" / "dir" / "o.json"],
        ["plan", "--load", work / "load.npy", "--gpus", 4, "--out", work / "o.json", "--bogus"],
        ["whatif", "--experts", "a,b"],
        ["whatif", "--experts", "0"],
        ["whatif", "--tokens", ""],
        ["whatif", "--fit", work / "bad.json"],
        ["whatif", "--model", work / "bad.json"],
        ["whatif", "--experts", "2", "--top-k", 4],
        ["whatif", "--plot", work / "no" / "u.png"],
    ]


def test_every_bad_input_exits_2_with_one_line(work):
    for args in _bad_inputs(work):
        result = run(*args)
        assert result.exit_code == 2, (args, result.output)
        assert result.stdout == "", (args, result.stdout)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("moewatch: error:"), (args, result.stderr)
        assert "Traceback" not in result.output


def test_whatif_prints_a_sweep_and_draws_it(work):
    png = work / "u.png"
    result = run("whatif", "--experts", "2,4,8,16,64", "--tokens", "512,2048", "--plot", png, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert len(data["rows"]) == 10 and len(data["fastest"]) == 2
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = run("whatif", "--experts", "8,16", "--ranks", "4,8", "--tokens", "256")
    assert text.exit_code == 0 and "fastest at 256 tokens" in text.stdout


def test_whatif_fits_windows(work, window_from_traffic):
    rng = np.random.default_rng(0)
    traffic = rng.integers(0, 500, size=(3, 4, 4))
    w = window_from_traffic(traffic, rng.random((3, 4)), rng.random((3, 4)), rng.random((3, 4)),
                            ranks_per_node=4, hidden_bytes=1024, steps=2)
    (work / "w.json").write_text(w.to_json())
    result = run("whatif", "--fit", work / "w.json", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["fit"]["samples_a2a"] == 3


def test_sglang_dump_without_torch_exits_2(work, monkeypatch):
    import sys

    import torch

    torch.save({"logical_count": torch.ones(2, 4, 32, dtype=torch.int32)}, work / "dump.pt")
    ok = run("plan", "--load", work / "dump.pt", "--gpus", 4, "--out", work / "p.json", "--json")
    assert ok.exit_code == 0, ok.output
    monkeypatch.setitem(sys.modules, "torch", None)
    result = run("plan", "--load", work / "dump.pt", "--gpus", 4, "--out", work / "p.json")
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and "needs torch" in result.stderr
