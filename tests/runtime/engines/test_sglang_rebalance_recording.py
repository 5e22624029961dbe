"""SGLang's own EPLB algorithm recorded without changing its answer: with moewatch observing
(MOEWATCH_WINDOW_DIR) and MOEWATCH_EPLB off, SGLang's plugin loader registers moewatch's recording
AROUND hook on eplb_algorithms.rebalance_experts through SGLang's HookRegistry; each call returns
exactly what SGLang's deepseek algorithm returns, and is recorded for the windows: the layers changed
from the map SGLang published (none published: every slot placed), slots moved, bytes, balancedness
before and after and the changed rows. Drives SGLang's own plugin loader, hook registry,
rebalance_experts and expert-location metadata on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moewatch.planner.placement_math import placement_balancedness

DRIVER = Path(__file__).parent / "sglang_recording_driver.py"
L, E, P, W = 4, 16, 24, 4


def tokens(seed: int) -> np.ndarray:
    """The driver's load for `seed` ([X, L, E], sglang_eplb_driver.tokens), summed over its windows."""
    rng = np.random.default_rng(seed)
    return (rng.zipf(1.6, (3, L, E)).clip(max=5000) * 100).astype(np.float64).sum(axis=0)


@pytest.mark.slow
def test_sglangs_own_rebalances_are_recorded_and_its_answers_unchanged(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOEWATCH_", "SGLANG_"))}
    env.update(MOEWATCH_WINDOW_DIR=str(tmp_path / "windows"), MOEWATCH_EPLB_EXPERT_BYTES="1000")
    proc = subprocess.run([sys.executable, str(DRIVER)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["hooked"] and got["observed"]
    assert got["answers"] == got["own"]  # all three tensors of both calls, SGLang's own
    assert not [w for w in got["warnings"] if "moewatch" in w], got["warnings"]
    fresh, moved = got["records"]
    assert fresh["policy"] == "engine" and fresh["engine"] == "sglang"
    assert fresh["balancedness_before"] is None and fresh["slots_moved"] == L * P  # no map published: all placed
    before, after = np.tile(np.arange(P) % E, (L, 1)), np.array(got["answers"][1][0])
    changed = np.flatnonzero((before != after).any(axis=1)).tolist()
    assert moved["layers_changed"] == changed and moved["slots_moved"] == int((before != after).sum()) > 0
    assert moved["bytes_moved"] == 1000.0 * moved["slots_moved"]
    assert moved["map_changes"] == {str(l): [before[l].tolist(), after[l].tolist()] for l in changed}
    for phase, pmap in (("before", before), ("after", after)):
        assert moved[f"balancedness_{phase}"] == pytest.approx(float(placement_balancedness(tokens(1), pmap, W).mean()))
