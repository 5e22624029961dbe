"""moewatch's EPLB policy inside the installed vLLM (.venv-vllm): vLLM's own plugin loader puts it
behind EPLB_POLICIES["default"] only with MOEWATCH_EPLB=1; its maps pass vLLM's compute_logical_maps
and migration schedule; it is bit-identical across processes; an internal error gives vLLM's own
answer; all-zero load keeps the map; another interface leaves vLLM's policy alone; every reported
call carries its ordinal and a digest that two ranks share exactly when they decided alike."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
DRIVER = Path(__file__).parent / "vllm_eplb_driver.py"


def run_case(case: str, **env_extra: str) -> dict:
    assert VLLM_PYTHON.is_file(), f"{VLLM_PYTHON} is missing: `make vllm-env` builds vLLM's environment"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOEWATCH_", "VLLM_"))}
    env.update(env_extra)
    proc = subprocess.run([str(VLLM_PYTHON), str(DRIVER), case], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_switch_decides_what_vllm_resolves_as_its_default_policy():
    assert run_case("resolve", MOEWATCH_EPLB="1")["policy"] == "MoewatchEplbPolicy"
    assert run_case("resolve")["policy"] == "DefaultEplbPolicy"
    bad = run_case("resolve", MOEWATCH_EPLB="1", MOEWATCH_EPLB_GAIN_MARGIN="lots")
    assert bad["policy"] == "DefaultEplbPolicy"
    assert any("MOEWATCH_EPLB_GAIN_MARGIN" in w for w in bad["warnings"]), bad


# Tiny experts: the gate's stall is negligible, so the layers that the planner improves move.
ON = {"MOEWATCH_EPLB": "1", "MOEWATCH_EPLB_EXPERT_BYTES": "1000"}


@pytest.fixture(scope="module")
def inside_vllm() -> dict:
    """One vLLM process with the policy on: its checks, all-zero load, a digest and the fallback."""
    return run_case("all", **ON)


@pytest.mark.slow
def test_maps_pass_vllms_own_checks_same_and_changed_slot_counts(inside_vllm):
    assert inside_vllm["policy"] == "MoewatchEplbPolicy"
    out = inside_vllm["checks"]
    for key, slots in (("same_slots", 24), ("more_slots", 32), ("holes", 24)):
        got = out[key]
        assert got["shape"] == [4, slots], key
        for layer_counts, layer_slots in zip(got["counts"], got["slots_of"]):
            assert min(layer_counts) >= 1 and sum(layer_counts) == slots, key
            # vLLM's inverse map names every slot exactly once
            assert sorted(s for expert in layer_slots for s in expert) == list(range(slots)), key
    assert out["same_slots"]["batches"] == 4  # vLLM's migration schedule, one per layer
    before, after = out["balancedness"]
    assert all(a > b for a, b in zip(after, before)), out["balancedness"]


@pytest.mark.slow
def test_bit_identical_in_several_processes_with_different_thread_counts(inside_vllm):
    digests = [run_case("digest", **ON, OMP_NUM_THREADS=str(n), OPENBLAS_NUM_THREADS=str(n),
                        MKL_NUM_THREADS=str(n))["digest"] for n in (1, 2)]
    assert digests == [inside_vllm["digest"]] * 2


@pytest.mark.slow
def test_an_internal_error_returns_vllms_own_result_counted_and_logged_once(inside_vllm):
    out = inside_vllm["fallback"]
    assert out["equal"] is True
    assert out["fallbacks"] == 2
    assert len(out["warnings"]) == 1, out["warnings"]
    # every call with load left a record for the windows: the earlier cases' decisions (the all-zero
    # load of `idle` is no rebalance: no record), then the two fallbacks
    assert out["records"] == ["decision"] * 5 + ["fallback"] * 2, out["records"]


@pytest.mark.slow
def test_all_zero_load_returns_the_current_map(inside_vllm):
    assert inside_vllm["idle"] == {"same": True, "dtype": "torch.int64"}


@pytest.mark.slow
def test_another_interface_leaves_vllms_policy_with_one_warning_naming_the_version():
    out = run_case("mismatch", MOEWATCH_EPLB="1")
    assert out["policy"] == "DefaultEplbPolicy"
    named = [w for w in out["warnings"] if "vLLM 0." in w and "own EPLB policy stays" in w]
    assert len(named) == 1, out["warnings"]


@pytest.mark.slow
def test_each_call_is_recorded_with_a_digest_every_rank_shares_numba_or_not_and_the_profile_call_is_not():
    """Drives the policy vLLM's EplbState resolves from EPLB_POLICIES[EPLBConfig().policy] (moewatch's,
    put there by vLLM's load_general_plugins) as EplbState.rearrange calls it: first the profile run's
    call (rearrange(is_profile=True) hands it the load window before any step, all zeros; rearrange
    itself cannot run on the CPU, it times with device events), then two production-shaped calls (61
    layers x 256 experts, 320 slots, 64 ranks, 8 nodes). Two processes, one mending with numba and one
    with the numpy loops, stand for two ranks. Before: no `call` or `digest` in the records, and the
    profile call reported as a rebalance."""
    compiled = run_case("records", **ON)
    numpy_only = run_case("records", **ON, MOEWATCH_PLANNER_COMPILED="0")
    assert (compiled["compiled"], numpy_only["compiled"]) == (True, False)
    assert compiled["fallbacks"] == numpy_only["fallbacks"] == 0
    assert compiled["profile_call_kept_map"] and numpy_only["profile_call_kept_map"]
    # The profile call is no record and takes no ordinal; the two calls are 0 and 1 on both "ranks".
    assert [r["call"] for r in compiled["records"]] == [0, 1] == [r["call"] for r in numpy_only["records"]]
    assert not any(r["fallback"] for r in compiled["records"] + numpy_only["records"])
    digests = [r["digest"] for r in compiled["records"]]
    assert digests == [r["digest"] for r in numpy_only["records"]]  # same inputs, settings and maps
    assert compiled["maps"] == numpy_only["maps"]
    assert digests[0] != digests[1] and all(len(d) == 64 and int(d, 16) >= 0 for d in digests)


def test_a_digest_changes_with_any_input_setting_or_answer():
    """vllm_eplb.call_digest over (load, sizes, map in force, settings, map returned): each part changes it."""
    import numpy as np

    from moewatch.planner.rebalance import RebalanceSettings
    from moewatch.runtime.engines.vllm_eplb import call_digest

    load, old = np.arange(12.0).reshape(2, 6), np.tile(np.arange(8) % 6, (2, 1))
    sizes, settings = (8, 1, 1, 4), RebalanceSettings()
    base = call_digest(load, sizes, old, settings, old)
    assert base == call_digest(load.copy(), list(sizes), old.copy(), RebalanceSettings(), old.copy())
    changed = [call_digest(load + 1, sizes, old, settings, old), call_digest(load, (8, 1, 2, 4), old, settings, old),
               call_digest(load, sizes, None, settings, old),
               call_digest(load, sizes, old, RebalanceSettings(gain_margin=2.0), old),
               call_digest(load, sizes, old, settings, old[:, ::-1].copy())]
    assert len({base, *changed}) == 6
