"""moewatch's planner inside SGLang 0.5.23's rebalance: SGLang's own plugin loader runs the
`sglang.srt.plugins` entry point, whose hook (SGLang's HookRegistry) answers
`eplb_algorithms.rebalance_experts` only with MOEWATCH_EPLB=1, in SGLang's three-tensor layout (its own
inverse map agrees), from the map SGLang publishes; an error gives SGLang's own answer; another
interface leaves SGLang's algorithm alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

DRIVER = Path(__file__).parent / "sglang_eplb_driver.py"
# Tiny experts: the gate's stall is negligible, so the layers that the planner improves move.
ON = {"MOEWATCH_EPLB": "1", "MOEWATCH_EPLB_EXPERT_BYTES": "1000"}


def run_case(case: str, **env_extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOEWATCH_", "SGLANG_"))}
    env.update(env_extra)
    proc = subprocess.run([sys.executable, str(DRIVER), case], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def inside_sglang() -> dict:
    return run_case("all", **ON)


@pytest.mark.slow
def test_sglangs_loader_registers_the_hook_and_its_answers_have_sglangs_layout(inside_sglang):
    assert inside_sglang["hooked"] and inside_sglang["wrapped"]
    for key in ("fresh", "from_current"):
        got = inside_sglang[key]
        assert got["shapes"][:2] == [[4, 24], [4, 16, got["shapes"][1][2]]] and got["shapes"][2] == [4, 16], key
        assert got["log2phy_equal"] and got["logcnt_equal"] and got["every_expert"], key
        assert got["slots"] == 4 * 24, key


@pytest.mark.slow
def test_it_starts_from_the_published_map_and_a_steady_load_then_moves_nothing(inside_sglang):
    before, after = inside_sglang["balancedness"]
    assert all(a > b for a, b in zip(after, before)), inside_sglang["balancedness"]
    assert inside_sglang["again_moved"] == 0
    decision = inside_sglang["decision"]
    assert decision["layers_moved"] == 0 and decision["experts_moved"] == 0
    assert decision["balancedness_before"] == decision["balancedness_after"] > 0.8


@pytest.mark.slow
def test_an_internal_error_returns_sglangs_own_result_counted_and_logged_once(inside_sglang):
    fallback = inside_sglang["fallback"]
    assert fallback["equal"] is True and fallback["fallbacks"] == 2
    assert len(fallback["warnings"]) == 1, fallback
    # every call left a record for the windows: the three decisions, then the two fallbacks
    assert fallback["records"] == ["decision"] * 3 + ["fallback"] * 2, fallback["records"]


@pytest.mark.slow
def test_switched_off_nothing_is_registered():
    out = run_case("off")
    assert out["hooked"] is False and out["wrapped"] is False and out["gatherer_hooks"] == []


@pytest.mark.slow
def test_observing_the_same_entry_point_gives_deepeps_gatherers_routed_counts(tmp_path):
    """sglang_routed.py's hooks, applied by SGLang's plugin loader before any model runner exists."""
    out = run_case("off", MOEWATCH_WINDOW_DIR=str(tmp_path))
    # No MOEWATCH_EPLB: SGLang's own rebalance algorithm answers; observing, moewatch's hook only records
    # its calls (its answers unchanged: test_sglang_rebalance_recording.py).
    assert out["hooked"] is True
    methods = ("__init__", "collect", "on_select_experts", "reset")
    assert out["gatherer_hooks"] == sorted(f"{g}.{m}" for g in ("_DeepepLowLatencySinglePassGatherer",
                                                                "_DeepepNormalSinglePassGatherer") for m in methods)


@pytest.mark.slow
def test_another_interface_leaves_sglangs_algorithm_with_one_warning_naming_the_version():
    out = run_case("mismatch", **ON)
    assert out["hooked"] is False
    named = [w for w in out["warnings"] if "SGLang 0.5.23" in w and "own EPLB algorithm stays" in w]
    assert len(named) == 1, out["warnings"]
