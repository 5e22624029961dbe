"""`moewatch replay` on windows the real vLLM CPU build wrote with moewatch's plugin (MOEWATCH_WINDOW_DIR):
a tiny random-weight Qwen3-MoE whose experts 2 to 4 win more of the routing (moewatch bench vllm's model,
tools/vllm_eplb_run.py's hot experts), served in-process, eager, for a few rounds; its windows are
recorded once per session. The replay calls vLLM's own DefaultEplbPolicy.rebalance_experts in .venv-vllm
and SGLang's eplb_algorithms.rebalance_experts (EplbAlgorithm.deepseek) in .venv, in one run
(runtime/engines/eplb_policy_driver.py), and moewatch's gated_rebalance in the command's process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
import torch

from moewatch.planner.files import read_plan, window_files
from moewatch.replay.trace import inputs_digest, read_trace

REPO = Path(__file__).resolve().parents[3]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
DRIVER = Path(__file__).parent / "vllm_driver.py"
LAYERS, EXPERTS, HOT = 4, 16, (2, 3, 4)
# The tiny model's expert: gate, up and down projections, 256 x 128 each, float32.
EXPERT_BYTES = 3 * 256 * 128 * 4
RANKS, SLOTS = 4, 20


@pytest.fixture(scope="session")
def recorded_vllm_windows(tmp_path_factory) -> Path:
    """The folder of windows vLLM's CPU build wrote serving the hot-expert model: 8 prompts, 12 tokens
    each, 3 rounds, a window every 2 steps."""
    from moewatch.tools.bench.vllm import save_tiny_model

    assert VLLM_PYTHON.is_file(), f"{VLLM_PYTHON} is missing: `make vllm-env` builds vLLM's environment"
    folder = tmp_path_factory.mktemp("replay-vllm")
    save_tiny_model(str(folder / "model"), seed=0, layers=LAYERS, experts=EXPERTS, hot_experts=HOT, hot_scale=3.0)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 1024, (n,), generator=g).tolist() for n in (40, 9, 27, 64, 5, 33, 18, 50)]
    (folder / "prompts.json").write_text(json.dumps(prompts))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOEWATCH_", "VLLM_"))}
    env.update(MOEWATCH_WINDOW_DIR=str(folder / "windows"), MOEWATCH_WINDOW_STEPS="2", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CACHE_ROOT=str(folder / "vllm-cache"))
    proc = subprocess.run([str(VLLM_PYTHON), str(DRIVER), str(folder / "model"), str(folder / "prompts.json"),
                           str(folder / "out.json"), "--max-tokens", "12", "--rounds", "3"],
                          env=env, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return folder / "windows"


def replay(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moewatch.cli", "replay", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def best_runnable(result: dict) -> tuple[str, str, float]:
    """The (policy, interval, net per hour) the recommendation must name, computed from the figures."""
    enough = {i["label"] for i in result["intervals"] if i["rebalances"] >= 2}
    found = [(f["net_seconds_per_hour"], -f["slots_moved"], policy, label)
             for policy in ("off", "static", "vllm_default", "moewatch")
             for label, f in result["policies"][policy].items() if label == "-" or label in enough]
    net, _, policy, label = max(found)
    if policy != "off" and net < result["min_gain"] * 3600:
        return "off", "-", 0.0
    return policy, label, net


@pytest.mark.slow
def test_replay_of_real_vllm_windows_calls_both_engines_own_policies_and_recommends_the_best_net(
        recorded_vllm_windows, tmp_path):
    windows = recorded_vllm_windows
    out = tmp_path / "replay"
    proc = replay(str(windows), "--engine", "vllm", "--ranks", str(RANKS), "--slots", str(SLOTS),
                  "--policies", "off,static,vllm_default,sglang_deepseek,moewatch", "--intervals", "1w,2w,4w",
                  "--vllm-python", str(VLLM_PYTHON), "--sglang-python", sys.executable,
                  "--expert-bytes", str(EXPERT_BYTES), "--migration-rate", "1e11",
                  "--out", str(out), "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout)
    result = json.loads((out / "replay.json").read_text())
    assert printed == result

    # Inputs: the windows vLLM wrote, all of them, digested as the trace reads them.
    files = window_files(windows)
    trace = read_trace([windows])
    assert result["inputs"]["windows"] == trace.num_windows >= 9
    assert result["inputs"]["digest"] == inputs_digest(files)
    assert result["inputs"]["runtime"] == "vllm" and result["inputs"]["recorded"]["ranks"] == 1
    assert result["command"].startswith("moewatch replay ") and str(windows) in result["command"]
    assert result["machine"]["wall_seconds"] > 0 and "other_cpu_cores" in result["machine"]
    # The cost model was fitted to the windows' own step times.
    assert result["step_cost"]["source"] == "fitted" and result["step_cost"]["seconds_per_busiest_pair"] is not None
    assert result["migration"]["rate_source"].startswith("operator")

    # Each engine's own function answered every rebalance of every interval, from its environment.
    for policy in ("vllm_default", "sglang_deepseek"):
        for interval in result["intervals"]:
            f = result["policies"][policy][interval["label"]]
            assert len(f["solve_seconds"]) == f["rebalances"] == interval["rebalances"] > 0
            assert len(f["balancedness_per_window"]) == trace.num_windows
        assert any(f["slots_moved"] > 0 for f in result["policies"][policy].values())
    # Hot experts: every rebalancing policy balances better than the contiguous start.
    off = result["policies"]["off"]["-"]["balancedness"]
    assert result["policies"]["static"]["-"]["balancedness"] > off
    assert max(f["balancedness"] for f in result["policies"]["vllm_default"].values()) > off

    # The recommendation is the best net among what vLLM can run, at an interval that rebalanced twice.
    advice = result["recommendation"]
    policy, label, net = best_runnable(result)
    assert (advice["policy"], advice["interval"]) == (policy, label)
    assert advice["net_seconds_per_hour"] == pytest.approx(net)
    # The --eplb-config JSON of every choice vLLM can run (the recommended one among them) parses into
    # vLLM 0.32's own EPLBConfig with the values given.
    configs = {policy: alt["settings"]["eplb_config"] for policy, alt in result["alternatives"].items()}
    assert set(configs) == {"static", "vllm_default", "moewatch"}
    if advice["choice"] != "off":
        assert advice["settings"] == result["alternatives"][advice["policy"]]["settings"]
    assert all(config["num_redundant_experts"] == SLOTS - EXPERTS for config in configs.values())
    check = subprocess.run([str(VLLM_PYTHON), "-c",
                            "import dataclasses, json, sys; from vllm.config.parallel import EPLBConfig; print(json."
                            "dumps([dataclasses.asdict(EPLBConfig(**c)) for c in json.loads(sys.argv[1])]))",
                            json.dumps(list(configs.values()))], capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr[-2000:]
    parsed = json.loads(check.stdout.strip().splitlines()[-1])
    for config, got in zip(configs.values(), parsed):
        assert all(got[key] == value for key, value in config.items())
    for policy, alt in result["alternatives"].items():
        assert f"--eplb-config '{json.dumps(configs[policy])}'" in alt["settings"]["args"]
        if policy != "static":
            assert configs[policy]["step_interval"] == alt["interval_steps"]
    static = result["alternatives"]["static"]["settings"]
    assert static["env"] == "MOEWATCH_EPLB=1 MOEWATCH_EPLB_PLACEMENT=placement.json"
    assert result["alternatives"]["moewatch"]["settings"]["env"].startswith("MOEWATCH_EPLB=1 ")
    plan = read_plan(out / "placement.json")
    assert plan.physical_to_logical_map.shape == (LAYERS, SLOTS)

    # The picture: a line per rebalancing policy in each panel, off and static dashed across.
    svg = ET.parse(out / "replay.svg").getroot()
    lines = svg.findall("{http://www.w3.org/2000/svg}polyline")
    assert len(lines) == 2 * 3
    dashed = [e for e in svg.findall("{http://www.w3.org/2000/svg}line") if e.get("stroke-dasharray")]
    assert len(dashed) >= 2 * 2
    labels = {e.text for e in svg.findall("{http://www.w3.org/2000/svg}text")}
    assert {str(i["steps"]) for i in result["intervals"]} <= labels


@pytest.mark.slow
def test_replay_of_too_few_real_vllm_windows_says_so_in_one_line_and_exits_3(recorded_vllm_windows, tmp_path):
    few = tmp_path / "few"
    few.mkdir()
    for path in window_files(recorded_vllm_windows)[:3]:
        (few / path.name).write_bytes(path.read_bytes())
    proc = replay(str(few), "--ranks", str(RANKS), "--slots", str(SLOTS), "--policies", "off,static",
                  "--out", str(tmp_path / "out"))
    assert proc.returncode == 3, proc.stderr
    said = [line for line in proc.stderr.splitlines() if not line.startswith("replay: ")]
    assert said == ["moewatch: replay: no recommendation: too few windows for a recommendation: 3 recorded, "
                    "at least 4 needed"]
    result = json.loads((tmp_path / "out" / "replay.json").read_text())
    assert result["recommendation"] is None and result["no_recommendation"].startswith("too few windows")
    assert np.isfinite(result["policies"]["static"]["-"]["balancedness"])
