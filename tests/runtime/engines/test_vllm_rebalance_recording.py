"""vLLM's own EPLB policy recorded without changing its answer (.venv-vllm): with moewatch observing
(MOEWATCH_WINDOW_DIR) and its policy off, vLLM's load_general_plugins leaves EPLB_POLICIES["default"]
answering exactly as vLLM's DefaultEplbPolicy does, and each rebalance it answers (not the profile
run's all-zero call) is recorded for the windows: its ordinal and digest, when, the layers changed,
the slots moved, balancedness before and after, and the changed rows. Not observing, vLLM's policy
is untouched. Drives vLLM's own policy registry and DefaultEplbPolicy on the CPU; vLLM's weight
transfer (CUDA) never runs here."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from moewatch.planner.placement_math import placement_balancedness

REPO = Path(__file__).resolve().parents[3]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
DRIVER = Path(__file__).parent / "vllm_static_placement_driver.py"
L, E, P, W = 3, 16, 24, 4


def policy_calls(**env_extra: str) -> dict:
    assert VLLM_PYTHON.is_file(), f"{VLLM_PYTHON} is missing: `make vllm-env` builds vLLM's environment"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOEWATCH_", "VLLM_"))}
    env.update(env_extra)
    proc = subprocess.run([str(VLLM_PYTHON), str(DRIVER), str(L), str(E), str(P), str(W)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_vllms_own_rebalances_are_recorded_and_its_answers_unchanged(tmp_path):
    got = policy_calls(MOEWATCH_WINDOW_DIR=str(tmp_path / "windows"), MOEWATCH_EPLB_EXPERT_BYTES="1000")
    assert got["policy"] == "RecordedEplbPolicy"
    assert got["maps"] == got["vllm_own"]  # every answer vLLM's own, the profile run's included
    assert not [w for w in got["warnings"] if "moewatch" in w], got["warnings"]
    records = got["records"]
    assert [r["call"] for r in records] == [0, 1] and all(r["policy"] == "engine" for r in records)
    contiguous = np.arange(P) % E
    befores = [np.tile(contiguous, (L, 1)), np.array(got["maps"][1])]  # the profile run's map is not committed
    rng = np.random.default_rng(0)  # the driver's two loads, drawn as it draws them
    loads = [(rng.zipf(1.5, (L, E)).clip(max=1000) * 10).astype(np.float64) for _ in range(2)]
    for record, load, before, after in zip(records, loads, befores, map(np.array, got["maps"][1:])):
        changed = np.flatnonzero((before != after).any(axis=1)).tolist()
        assert record["layers_changed"] == changed
        assert record["slots_moved"] == int((before != after).sum()) and record["bytes_moved"] == 1000.0 * record[
            "slots_moved"]
        assert record["map_changes"] == {str(l): [before[l].tolist(), after[l].tolist()] for l in changed}
        for phase, pmap in (("before", before), ("after", after)):
            assert record[f"balancedness_{phase}"] == pytest.approx(float(placement_balancedness(load, pmap, W).mean()))
        assert record["time"] > 0
    assert records[0]["slots_moved"] > 0  # the first moves from vLLM's contiguous start


@pytest.mark.slow
def test_not_observing_leaves_vllms_policy_untouched():
    got = policy_calls()
    assert got["policy"] == "DefaultEplbPolicy" and got["records"] == []
