"""The GPU check script's closed loop, rehearsed on CPU ranks (gloo): the same code path as on NCCL,
one rank per device, minus the devices."""

from __future__ import annotations

import pytest

from moewatch.tools import gpu_check

CONTRACT = ("step_p50_before_s", "step_p50_after_s", "step_p99_before_s", "step_p99_after_s", "step_p50_ratio",
            "windows_to_fix", "migration_stall_s", "pairs_lost", "control")


def test_one_gpu_is_reported_as_not_run():
    out = gpu_check.closed_loop(1)
    assert out["ran"] is False and out["ok"] is None and "two ranks" in out["why"]


@pytest.mark.slow
def test_closed_loop_rehearsal_on_gloo_reports_the_bench_contract():
    # A small shape: this checks the wiring and the accounting, not the speed-up (no timed assertions).
    # Windows of the demo's 16 steps: verification reads time per step over 3 windows, and over 3 windows
    # of 4 steps on two shared cores other work faked a regression and rolled back the good plan.
    out = gpu_check.closed_loop(2, backend="gloo", shape={"hidden": 64, "ffn": 128, "batch-tokens": 128,
                                                           "window-steps": 16}, seconds=6, control_seconds=2)
    assert out["ran"] and "error" not in out, out.get("error")
    r = out["result"]
    for key in CONTRACT:
        assert key in r, key
    assert r["pairs_lost"] == 0 and r["pairs_routed"] > 0
    assert r["plans_applied"] >= 1 and r["balancedness_after"] > r["balancedness_before"]
    assert set(r["migration_stall_s"]) >= {"total", "per_plan"} and len(r["migration_stall_s"]["per_plan"]) >= 1
    assert r["control"]["plans"] == 0 and r["control"]["windows"] >= 1
    assert set(out["checks"]) == {"pairs_lost", "acted", "no_false_rollback", "step_p50_ratio", "windows_to_fix",
                                  "stall_per_plan"}
    assert out["checks"]["pairs_lost"] and out["checks"]["acted"]


def test_engine_policy_part_runs_on_the_cpu_path_and_compares_bytes():
    # The same part the GPU check runs on device-resident tensors; here the "device" is the CPU, so
    # each call must equal itself byte for byte and be a map vLLM accepts.
    out = gpu_check.engine_policy("cpu", quick=True)
    assert out["ok"], out
    for engine in ("vllm", "sglang"):
        calls = out[engine]["calls"]
        assert len(calls) == 2 and all(c["same_as_cpu"] for c in calls)
        assert calls[0]["slots_moved"] > 0  # the first window moves away from the engines' start
    # the vLLM run with EPLB needs two GPUs: not run here, which is not a failure of the part
    assert out["vllm_run"] == {"ran": False, "ok": None, "gpus": 0, "why": out["vllm_run"]["why"]}
    assert "needs 2 GPUs" in out["vllm_run"]["why"]


def test_engine_counters_part_runs_on_the_cpu_path_and_its_verdict_can_fail(monkeypatch):
    # The part a lent GPU runs under CUDA-graph replay with sync debug mode "error" (never run on a
    # GPU yet); here the same steps run eagerly on the CPU: padded batches, padding rows masked to -1,
    # a shared expert appended as id E, a window flushed every 7 steps through the recorder's copy.
    out = gpu_check.engine_counters("cpu", quick=True)
    assert out["ok"], out
    assert out["windows"] == out["windows_expected"] == 5 and out["device_copies"] == 5
    assert out["counts_match"] and out["pairs_counted"] == 4 * 2 * out["real_tokens"]
    assert out["discarded"] == [out["real_tokens"]] * 4 and out["padded_tokens"] > out["real_tokens"]

    # Padding counted (every row of the padded batch armed): the verdict says so.
    from moewatch.runtime.engines import common

    arm = common.PairWeights.arm
    monkeypatch.setattr(common.PairWeights, "arm", lambda self, n: arm(self, 256 if n else 0))
    broken = gpu_check.engine_counters("cpu", quick=True)
    assert not broken["ok"] and broken["discarded"] != broken["discarded_expected"]
