"""Placement and schedule together: the predicted all-to-all of each combination
(moewatch/planner/joint.py) and `moewatch plan --link-rate`'s report of it."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from moewatch.cli import main
from moewatch.planner.a2a_schedule import transfer_bound
from moewatch.planner.joint import even_origins, joint_prediction
from moewatch.planner.origins import rank_matrices
from moewatch.planner.placement_math import contiguous_placement


def test_each_combination_predicted_aurora_at_the_bound():
    rng = np.random.default_rng(0)
    load = rng.integers(10, 200, (3, 8)).astype(float)
    load[:, 0] *= 6  # a hot expert on rank 0 under the contiguous map
    contiguous = contiguous_placement(3, 8, 8)
    spread = np.roll(contiguous, 1, axis=1)
    out = joint_prediction(even_origins(load, 4), {"contiguous": contiguous, "spread": spread}, 1000.0, 1e6)
    for name, pmap in (("contiguous", contiguous), ("spread", spread)):
        mats = np.rint(rank_matrices(even_origins(load, 4), pmap)).astype(np.int64)
        bound = sum(transfer_bound(m) for m in mats) * 1000.0 / 1e6
        assert out[name]["aurora"] == pytest.approx(2 * bound)
        assert out[name]["none"] >= out[name]["aurora"] - 1e-12  # the fluid model never beats the bound
    with pytest.raises(ValueError):
        joint_prediction(even_origins(load, 4), {"c": contiguous}, 0.0, 1e6)


def test_plan_reports_the_combinations_only_with_a_link_rate(tmp_path):
    rng = np.random.default_rng(1)
    trace = np.stack([np.argsort(rng.random((400, 16)), axis=1)[:, :2] for _ in range(3)], axis=1)
    np.save(tmp_path / "trace.npy", trace)
    load = np.stack([np.bincount(trace[:, layer].ravel(), minlength=16) for layer in range(3)])
    np.save(tmp_path / "load.npy", load)
    base = ["plan", "--load", str(tmp_path / "load.npy"), "--gpus", "4", "--affinity", str(tmp_path / "trace.npy"),
            "--out", str(tmp_path / "plan.json"), "--json"]
    run = CliRunner().invoke(main, base + ["--link-rate", "400", "--hidden-bytes", "4096"])
    assert run.exit_code == 0, run.output
    p = json.loads(run.output)["a2a_prediction"]
    assert set(p["seconds"]) == {"before+none", "before+aurora", "plan+none", "plan+aurora"}
    assert p["best"] in p["seconds"] and p["a2a_schedule"] in ("none", "aurora")
    assert json.loads((tmp_path / "plan.json").read_text())["meta"]["planner"]["a2a_prediction"] == p
    without = CliRunner().invoke(main, base)
    assert "a2a_prediction" not in json.loads(without.output)  # no link rate: nothing guessed
    refused = CliRunner().invoke(main, base + ["--link-rate", "400"])
    assert refused.exit_code == 2 and "--hidden-bytes" in refused.output
