"""The GPU check's vLLM run with EPLB and moewatch's policy: its verdict over windows (pure), and its
CPU path, the same model, prompts, engine process and window reading on vLLM's CPU build with EPLB
off (vLLM refuses EPLB without CUDA)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moewatch.planner.placement_math import contiguous_placement
from moewatch.runtime.engines.common import logical_window
from moewatch.tools import vllm_eplb_run
from moewatch.tools.vllm_eplb_run import EXPERTS, LAYERS, REDUNDANT_EXPERTS, verdict

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
SLOTS = EXPERTS + REDUNDANT_EXPERTS
START = contiguous_placement(LAYERS, EXPERTS, SLOTS)
BALANCED = np.tile(np.concatenate([np.arange(0, 16, 2), [0], np.arange(1, 16, 2), [1]]), (LAYERS, 1))


def window(pmap: np.ndarray | None, slot_share_rank0: float, records: list | None = None):
    """A window of two ranks whose slots on rank 0 carry `slot_share_rank0` of the pairs (None: logical
    counts only, as without EPLB)."""
    slot_tokens, expert_tokens = None, np.full((LAYERS, EXPERTS), 10)
    if pmap is not None:
        on_rank0 = round(100 * slot_share_rank0)
        slot_tokens = np.full((LAYERS, SLOTS), 100 - on_rank0)
        slot_tokens[:, :SLOTS // 2] = on_rank0
        expert_tokens = np.zeros((LAYERS, EXPERTS), dtype=np.int64)
        np.add.at(expert_tokens, (np.arange(LAYERS)[:, None], pmap), slot_tokens)
    return logical_window(runtime="vllm", model="tiny", ep_group="g", top_k=2, hidden_bytes=512,
                          expert_tokens=expert_tokens, steps=8, start_time=0.0, end_time=1.0,
                          world_size=2, slot_tokens=slot_tokens, physical_to_logical_map=pmap,
                          extra={"engine_rebalance": records or []})


# as the policy writes them (rebalance_hook: the engine, then RebalanceDecision.record())
MOVED_ALL = {"engine": "vllm", "layers_by_reason": {"moved": list(range(LAYERS))},
             "layer_outcomes": {"moved": LAYERS}}
FALLBACK = {"engine": "vllm", "fallback": True, "error": "ValueError: boom"}


def test_a_decided_rebalance_that_raised_balancedness_passes():
    windows = [window(START, 0.8), window(START, 0.8, [MOVED_ALL]), window(BALANCED, 0.5), window(BALANCED, 0.52)]
    out = verdict(windows)
    assert out["ok"], out
    assert out["changes"] == [{"window": 2, "layers": [0, 1, 2]}]
    assert out["decided"] == 1 and out["fallbacks"] == 0
    assert out["agent_checks"] == {"not_worse": 1, "worse": 0}  # settled on window 2 against window 1
    assert out["balancedness_before"] == pytest.approx(0.625, abs=1e-3)  # mean / max of 800 and 200
    assert out["balancedness_after"] > 0.95


def test_a_layer_moved_over_several_windows_is_explained_by_the_one_record():
    half = START.copy()
    half[0] = BALANCED[0]
    windows = [window(START, 0.8), window(START, 0.8, [MOVED_ALL]), window(half, 0.7), window(BALANCED, 0.5)]
    out = verdict(windows)
    assert out["ok"], out
    assert [c["layers"] for c in out["changes"]] == [[0], [1, 2]]


def test_what_the_windows_fail_to_show_is_named():
    no_record = verdict([window(START, 0.8), window(BALANCED, 0.5)])
    assert not no_record["ok"] and "no decided record moved" in no_record["why"]
    fallback = verdict([window(START, 0.8), window(START, 0.8, [MOVED_ALL, FALLBACK]), window(BALANCED, 0.5)])
    assert not fallback["ok"] and "answered by vLLM's own policy" in fallback["why"]
    worse = verdict([window(START, 0.55), window(START, 0.55, [MOVED_ALL]), window(BALANCED, 0.8)])
    assert not worse["ok"] and worse["agent_checks"] == {"not_worse": 0, "worse": 1}
    assert worse["why"] == "the agent found layers worse after 1 rebalance(s); balancedness did not rise"
    # moved on the first window: the agent has no window before it to check against
    unchecked = verdict([window(START, 0.8, [MOVED_ALL]), window(BALANCED, 0.5)])
    assert not unchecked["ok"] and unchecked["why"] == "the agent settled no check of a rebalance"
    # records the agent would not read (no engine) explain nothing
    malformed = verdict([window(START, 0.8), window(START, 0.8, [{"layers_by_reason": {"moved": [0, 1, 2]}}]),
                         window(BALANCED, 0.5)])
    assert not malformed["ok"] and "no decided record moved" in malformed["why"]
    still = verdict([window(START, 0.8), window(START, 0.8)])
    assert not still["ok"] and "never changed over 2 windows" in still["why"]
    off = verdict([window(None, 0.8), window(None, 0.8)])
    assert not off["ok"] and "no window carries the map in force" in off["why"]


def test_the_part_says_what_it_lacked_without_two_gpus():
    from moewatch.tools import gpu_check

    out = gpu_check.vllm_eplb_part(1)
    assert out["ran"] is False and out["ok"] is None and "needs 2 GPUs" in out["why"] and "saw 1" in out["why"]


@pytest.mark.slow
def test_cpu_path_serves_the_skewed_model_and_reads_its_windows():
    assert VLLM_PYTHON.is_file(), f"{VLLM_PYTHON} is missing: `make vllm-env` builds vLLM's environment"
    prompts, prompt_len, max_tokens, rounds = 8, 48, 8, 2
    out = vllm_eplb_run.run(str(VLLM_PYTHON), ranks=1, eplb=False, rounds=rounds, prompts=prompts,
                            prompt_len=prompt_len, max_tokens=max_tokens, timeout_s=400)
    assert out["ran"], out.get("why")
    assert [r["tokens"] for r in out["served"]] == [prompts * max_tokens] * rounds
    pairs = np.array(out["expert_pairs"])
    # every computed token (the prompt and each generated token but the last) routes top-2 in each layer
    assert pairs.shape == (LAYERS, EXPERTS)
    assert pairs.sum(axis=1).tolist() == [rounds * prompts * (prompt_len + max_tokens - 1) * 2] * LAYERS
    # the scaled gate rows make the hot experts, which the GPU run's rebalance must spread
    hot = np.isin(np.arange(EXPERTS), vllm_eplb_run.HOT_EXPERTS)
    assert (pairs[:, hot].mean(axis=1) > 1.5 * pairs[:, ~hot].mean(axis=1)).all(), pairs
    assert out["windows"] >= 2 and not out["ok"]
    assert "no window carries the map in force" in out["verdict"]["why"]


def test_the_engine_environment_prices_this_model_so_the_gate_lets_a_skew_move(tmp_path, monkeypatch):
    from moewatch.planner.rebalance import MOVED, RebalanceSettings, gated_rebalance, switched_on

    monkeypatch.setenv("MOEWATCH_EPLB_GAIN_MARGIN", "1000")  # the caller's settings never reach the engine
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    (tmp_path / "config.json").write_text('{"hidden_size": 256, "moe_intermediate_size": 128}')
    off = vllm_eplb_run.engine_environment(tmp_path / "w", False, tmp_path / "c", tmp_path)
    assert off["MOEWATCH_WINDOW_DIR"] == str(tmp_path / "w") and not switched_on(off)
    assert "MOEWATCH_EPLB_GAIN_MARGIN" not in off and "VLLM_CPU_OMP_THREADS_BIND" not in off
    on = vllm_eplb_run.engine_environment(tmp_path / "w", True, tmp_path / "c", tmp_path)
    settings = RebalanceSettings.from_env(on)
    assert switched_on(on) and settings.gain_margin == 1.0
    assert (settings.horizon_steps, settings.window_steps) == (vllm_eplb_run.STEP_INTERVAL, vllm_eplb_run.WINDOW_SIZE)
    assert settings.expert_bytes == 3 * 256 * 128 * 2
    # A window of the run's decode steps (32 prompts, top-2) with the hot experts at 3x the others' load:
    # the gate, priced as the engine's environment prices it, moves every layer off the contiguous start.
    share = np.where(np.isin(np.arange(EXPERTS), vllm_eplb_run.HOT_EXPERTS), 3.0, 1.0)
    load = np.tile(vllm_eplb_run.WINDOW_SIZE * 64 * share / share.sum(), (LAYERS, 1))
    decision = gated_rebalance(load, SLOTS, vllm_eplb_run.RANKS, current=START, settings=settings)
    assert decision.reasons == (MOVED,) * LAYERS, decision.reasons
    assert (decision.balancedness_after > decision.balancedness_before).all()
