"""The engines' own rebalancing settings, read by the adapters from the engines' own config objects
and sent in each window's extra.rebalancing for the agent's watch: vLLM's ParallelConfig / EPLBConfig
(in .venv-vllm, through the plugin's _rebalancing_extra), SGLang's ExecMoe (its --enable-eplb,
--eplb-rebalance-num-iterations and utilisation gate)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from sglang.srt.arg_groups.fields.exec_ import ExecMoe

from moewatch.engine_rebalancing import RebalancingSettings
from moewatch.integrations.sglang.rebalancing import rebalancing_settings as sglang_settings
from moewatch.runtime.engines import sglang_eplb

REPO = Path(__file__).resolve().parents[3]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
DRIVER = Path(__file__).parent / "vllm_rebalancing_driver.py"


def vllm_extra(eplb_config: dict, **env_extra: str) -> dict:
    assert VLLM_PYTHON.is_file(), f"{VLLM_PYTHON} is missing: `make vllm-env` builds vLLM's environment"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOEWATCH_", "VLLM_"))}
    env.update(env_extra)
    proc = subprocess.run([str(VLLM_PYTHON), str(DRIVER), json.dumps(eplb_config)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_vllms_eplb_config_reaches_the_windows_observed_only_with_moewatchs_policy():
    got = vllm_extra({"step_interval": 500, "use_async": False}, MOEWATCH_EPLB="1")
    assert got["off"] == {}  # EPLB off: nothing to watch
    settings = RebalancingSettings.from_extra(got["on"])
    assert settings == RebalancingSettings(500, asynchronous=False, observed=True, source="vllm eplb_config")
    default = RebalancingSettings.from_extra(vllm_extra({})["on"])  # vLLM's defaults, its own policy
    assert (default.interval_steps, default.asynchronous, default.observed) == (3000, True, False)


def test_sglangs_settings_observed_only_while_its_utilisation_gate_cannot_skip_a_rebalance():
    on = ExecMoe(enable_eplb=True, eplb_rebalance_num_iterations=500)
    assert sglang_settings(on, hook_installed=True) == RebalancingSettings(
        500, asynchronous=False, observed=True, source="sglang eplb_rebalance_num_iterations")
    assert not sglang_settings(on, hook_installed=False).observed  # SGLang's own algorithm: no record per call
    gated = ExecMoe(enable_eplb=True, eplb_rebalance_num_iterations=500, eplb_min_rebalancing_utilization_threshold=0.7)
    assert not sglang_settings(gated, hook_installed=True).observed  # a skipped rebalance calls nothing
    assert sglang_settings(ExecMoe(), hook_installed=True) is None


def test_outside_an_sglang_server_the_hook_sends_no_settings_and_says_nothing(caplog):
    assert "rebalancing" not in sglang_eplb.window_extra()
    assert not [r for r in caplog.records if "moewatch" in r.getMessage()]
