"""A static placement served by vLLM's own EPLB policy registry (.venv-vllm): the real vLLM CPU build
serves a tiny MoE with moewatch's plugin writing windows; `moewatch plan` solves a placement from
those windows for vLLM's slot count; a vLLM process with MOEWATCH_EPLB=1 and
MOEWATCH_EPLB_PLACEMENT=FILE then resolves EPLB_POLICIES["default"] (vLLM's load_general_plugins,
EPLBConfig().policy) to moewatch's policy, which returns FILE's map on the profile run's call and on
every rebalance after (vLLM's compute_logical_maps reads it); a file of another slot count gives
vLLM's own DefaultEplbPolicy answers with one warning naming what differs; an unreadable file leaves
vLLM's policy in place with one warning naming the variable. vLLM's EPLB moving weights needs CUDA:
these drive its policy registry and map bookkeeping on the CPU, never a weight transfer."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from test_vllm_plugin import EXPERTS, run_vllm, tiny_model  # noqa: F401 - tiny_model is a fixture

from moewatch.cli import main as moewatch

REPO = Path(__file__).resolve().parents[3]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
DRIVER = Path(__file__).parent / "vllm_static_placement_driver.py"
LAYERS, SLOTS, RANKS = 3, 24, 4  # 16 experts and 8 redundant ones over 4 EP ranks


def policy_calls(placement: Path, slots: int = SLOTS) -> dict:
    assert VLLM_PYTHON.is_file(), f"{VLLM_PYTHON} is missing: `make vllm-env` builds vLLM's environment"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOEWATCH_", "VLLM_"))}
    env.update(MOEWATCH_EPLB="1", MOEWATCH_EPLB_PLACEMENT=str(placement))
    proc = subprocess.run([str(VLLM_PYTHON), str(DRIVER), str(LAYERS), str(EXPERTS), str(slots), str(RANKS)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def plan_from(windows: Path, out: Path, slots: int) -> dict:
    result = CliRunner().invoke(moewatch, ["plan", "--load", str(windows), "--gpus", str(RANKS), "--slots",
                                           str(slots), "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def recorded(tiny_model, tmp_path_factory):  # noqa: F811
    """The folder of windows vLLM wrote while serving, and their summed load [L, E]."""
    out = tmp_path_factory.mktemp("static")
    windows, _, _ = run_vllm(tiny_model, out, compiled=False, multiprocessing=False)
    return out / "windows", sum(w.expert_tokens for w in windows)


@pytest.mark.slow
def test_vllms_default_policy_returns_the_placement_planned_from_its_windows_and_keeps_it(recorded, tmp_path):
    windows, load = recorded
    placement = tmp_path / "placement.json"
    summary = plan_from(windows, placement, SLOTS)
    pmap = json.loads(placement.read_text())["physical_to_logical_map"]
    assert np.array(pmap).shape == (LAYERS, SLOTS) and summary["windows"] >= 2
    assert summary["balancedness_after"] > summary["balancedness_before"]  # the windows' load, planned for
    got = policy_calls(placement)
    assert got["policy"] == "MoewatchEplbPolicy"
    assert got["maps"] == [pmap, pmap, pmap]  # the profile run's call and both rebalances: static
    assert got["vllm_own"][1] != pmap  # vLLM's own policy would have answered otherwise
    assert np.array(got["replicas"]).sum(axis=1).tolist() == [SLOTS] * LAYERS
    assert not any("MOEWATCH" in w for w in got["warnings"]), got["warnings"]
    first, second = got["records"]  # the profile run's all-zero call is not reported
    assert [first["call"], second["call"]] == [0, 1] and first["digest"] != second["digest"]
    assert first["static_placement"] == {"path": str(placement), "layers": LAYERS, "slots": SLOTS}
    moved_from_contiguous = int((np.array(pmap) != np.arange(SLOTS) % EXPERTS).sum())
    assert first["experts_moved"] == moved_from_contiguous > 0
    assert second["layer_outcomes"] == {"kept_static": LAYERS} and second["experts_moved"] == 0


@pytest.mark.slow
def test_a_placement_of_another_slot_count_gives_vllms_own_answers_with_one_warning(recorded, tmp_path):
    windows, _ = recorded
    placement = tmp_path / "placement-20.json"
    plan_from(windows, placement, 20)
    got = policy_calls(placement)
    assert got["policy"] == "MoewatchEplbPolicy"
    assert got["maps"] == got["vllm_own"]
    named = [w for w in got["warnings"] if "MOEWATCH_EPLB_PLACEMENT" in w]
    assert len(named) == 1 and "20 slots where the engine has 24 physical experts" in named[0], got["warnings"]
    assert [r["fallback"] for r in got["records"]] == [True, True]
    assert all("20 slots" in r["error"] for r in got["records"])


@pytest.mark.slow
def test_an_unreadable_placement_file_leaves_vllms_policy_with_one_warning_naming_the_variable(tmp_path):
    placement = tmp_path / "placement.json"
    placement.write_text("{not json")
    got = policy_calls(placement)
    assert got["policy"] == "DefaultEplbPolicy"
    assert got["maps"] == got["vllm_own"] and got["records"] == []
    named = [w for w in got["warnings"] if "MOEWATCH_EPLB_PLACEMENT" in w]
    assert len(named) == 1 and "not valid JSON" in named[0], got["warnings"]


def test_a_placement_without_the_switch_is_named_once_not_dropped_in_silence(caplog, tmp_path):
    from moewatch.runtime.engines import vllm_eplb

    environ = {"MOEWATCH_EPLB_PLACEMENT": str(tmp_path / "placement.json")}
    assert vllm_eplb.install_from_env(environ) is False and vllm_eplb.install_from_env(environ) is False
    named = [r.getMessage() for r in caplog.records if "MOEWATCH_EPLB_PLACEMENT" in r.getMessage()]
    assert named == ["moewatch: MOEWATCH_EPLB_PLACEMENT is set but MOEWATCH_EPLB is not 1: the placement is not "
                     "served"]
