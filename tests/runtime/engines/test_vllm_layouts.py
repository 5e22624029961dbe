"""moewatch's vLLM plugin under the parallel layouts operators run on GPUs, shown on the CPU by
driving vLLM's own Python for each branch (vllm_layout_driver.py, inside .venv-vllm; its docstring
names every vLLM function it drives): data-parallel attention with EP (rows gathered across DP
before routing, or each rank's own), sequence-parallel MoE (DP x TP, tokens chunked across TP),
dual batch overlap, DP ranks kept in lockstep by dummy batches, and Model Runner V2's warm-up.

In each, the processes of one EP group write shards of one window: their counts add up exactly to
the histogram of the real tokens every rank routed (no padding row, no other rank's row, nothing
twice), each shard names which of how many it is, the EP rank it routes for and a sequence every
rank agrees on, and the window describes the whole group (world size, ranks per node)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from moewatch.shards import merge_sequence
from moewatch.telemetry import Window, validate

REPO = Path(__file__).resolve().parents[3]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
DRIVER = Path(__file__).parent / "vllm_layout_driver.py"
CASES = ("dp_gathered", "dp_own", "sp_chunk", "sp_gathered", "dbo", "lockstep", "mrv2_warmup")


@pytest.fixture(scope="module")
def cases() -> dict:
    """Every case in one engine-environment process (importing vLLM takes most of a minute here)."""
    assert VLLM_PYTHON.is_file(), f"{VLLM_PYTHON} is missing: `make vllm-env` builds vLLM's environment"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOEWATCH_", "VLLM_"))}
    proc = subprocess.run([str(VLLM_PYTHON), str(DRIVER), *CASES], env=env, capture_output=True, text=True,
                          timeout=420)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            case = json.loads(line)
            out[case["case"]] = case
    assert set(out) == set(CASES), (sorted(out), proc.stderr[-2000:])
    return out


def shards_of(case: dict) -> list[dict]:
    return [w for p in case["processes"] for w in p["windows"]]


def check_one_window_of_shards(case: dict, *, count: int, world_size: int) -> None:
    """One sequence, `count` shards (indices 0..count-1, EP ranks as vLLM numbers them: DP rank x TP
    size + TP rank), each of group ep0 sized for the whole group; their counts sum to the real tokens'
    histogram exactly."""
    shards = shards_of(case)
    assert len(shards) == count, shards
    assert sorted(w["shard"]["index"] for w in shards) == list(range(count))
    assert {w["shard"]["sequence"] for w in shards} == {0}
    assert all(w["shard"]["count"] == count for w in shards)
    for p, w in zip([p for p in case["processes"] for _ in p["windows"]], shards):
        tp_size = count // 2 if count > 2 else 1
        assert w["shard"]["rank"] == p["dp_rank"] * tp_size + p["tp_rank"], (p, w["shard"])
    assert {(w["ep_group"], w["world_size"], w["ranks_per_node"]) for w in shards} == {("ep0", world_size, world_size)}
    total = np.sum([w["expert_tokens"] for w in shards], axis=0)[0]
    np.testing.assert_array_equal(total, case["expected"])
    # The agent's merge: one valid window of the group, its counts the same histogram, and its
    # rank-to-rank traffic built with each shard's pairs in its source rank's row.
    merged, refused = merge_sequence([Window.from_json(w["json"]) for w in shards])
    assert refused == [] and merged.shards_report.missing == ()
    validate(merged)
    np.testing.assert_array_equal(merged.expert_tokens[0], case["expected"])
    sent_by_rank = np.zeros(world_size, dtype=np.int64)
    for w in shards:
        sent_by_rank[w["shard"]["rank"]] += int(np.sum(w["expert_tokens"]))
    np.testing.assert_array_equal(merged.traffic[0].sum(axis=1), sent_by_rank)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dp_gathered", "dp_own"])
def test_dp_attention_with_ep_each_dp_rank_counts_its_own_real_rows_in_one_shard(cases, name):
    """DP 2 + EP, rank 1 with 2 real rows of 8 (padded to rank 0's batch): gathered before routing
    (vLLM's naive dispatch) or not, each DP rank counts its own real rows, never DP rank 0's."""
    check_one_window_of_shards(cases[name], count=2, world_size=2)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sp_chunk", "sp_gathered"])
def test_sequence_parallel_moe_every_tp_rank_counts_its_chunk(cases, name):
    """DP 2 x TP 2 with sequence-parallel MoE: vLLM chunks each DP rank's rows across its TP ranks
    (padding the odd batch); all four processes report, each its chunk's real rows."""
    case = cases[name]
    assert all(p["reporting"] for p in case["processes"])
    check_one_window_of_shards(case, count=4, world_size=4)


@pytest.mark.slow
def test_dual_batch_overlap_counts_each_micro_batchs_real_rows_only(cases):
    """100 and 70 real rows padded to 128 and split at 64 by vLLM: the second micro-batch holds the
    padding (58 and 58 rows), which counts nothing; the first counts every row it has."""
    case = cases["dbo"]
    assert case["slices"] == [[[0, 64], [64, 128]]] * 2
    check_one_window_of_shards(case, count=2, world_size=2)
    assert [int(np.sum(w["expert_tokens"])) for w in shards_of(case)] == [2 * 100, 2 * 70]


@pytest.mark.slow
def test_dp_ranks_idle_in_dummy_batches_keep_the_same_windows_and_sequences(cases):
    """Windows of 2 steps: rank 1 runs one step, then two of vLLM's dummy batches while rank 0 runs
    steps. Both end windows at the same steps (the dummy batch is a step of 0 tokens), so sequence 0
    and 1 each have one shard per rank; what they counted adds up to the real rows' histogram."""
    case = cases["lockstep"]
    per_rank = [[(w["shard"]["sequence"], w["steps"], w["shard"]["index"]) for w in p["windows"]]
                for p in case["processes"]]
    assert per_rank == [[(0, 2, 0), (1, 1, 0)], [(0, 2, 1), (1, 1, 1)]]
    assert [w["step_tokens"] for w in case["processes"][1]["windows"]] == [[1, 0], [0]]
    total = np.sum([w["expert_tokens"] for w in shards_of(case)], axis=0)[0]
    np.testing.assert_array_equal(total, case["expected"])


@pytest.mark.slow
def test_model_runner_v2_warm_up_steps_count_nothing(cases):
    """vLLM's V2 warm-up (warmup_kernels) sends a realistic prefill of 8 tokens and decode steps
    through execute_model, without dummy_run, inside the worker's compile_or_warm_up_model: no step
    of the plugin's; a served step afterwards is one."""
    case = cases["mrv2_warmup"]
    assert case["warm_up_error"] == []
    assert case["warm_up_tokens"][:2] == [8, 4] and sum(case["warm_up_tokens"]) > 0  # vLLM's warm-up ran
    assert case["compile_or_warm_up_model_wrapped"]
    assert (case["steps_in_warm_up"], case["steps_after_a_served_step"]) == (0, 1)
