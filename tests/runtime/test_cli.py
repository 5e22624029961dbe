"""`moewatch runtime`: the contract flags, --json, bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from moewatch.cli import main


def _run(args):
    return CliRunner().invoke(main, args, catch_exceptions=False)


@pytest.mark.parametrize("args, field", [
    (["runtime", "--ranks", "3"], "--slots"),
    (["runtime", "--experts", "4", "--top-k", "5"], "--top-k"),
    (["runtime", "--capacity-factor", "-1"], "--capacity-factor"),
    (["runtime", "--workload", "trace"], "--trace"),
    (["runtime", "--workload", "trace", "--trace", "/no/such/trace.npy", "--ranks", "2"], "--trace"),
    (["runtime", "--hot-experts", "40"], "--hot-experts"),
    (["runtime", "--steps", "0"], "--steps"),
    (["runtime", "--kernel", "triton"], "--kernel"),
    (["runtime", "--backend", "gloo", "--dtype", "bfloat16"], "--dtype"),
    (["runtime", "--socket", "/tmp/" + "s" * 120], "--socket"),
])
def test_bad_input_exits_2_with_one_line_naming_the_flag(args, field, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and field in lines[0] and "Traceback" not in result.output


def test_bad_placement_file(tmp_path):
    path = tmp_path / "placement.json"
    path.write_text(json.dumps({"physical_to_logical_map": [[0, 0, 1, 1]] * 8}))
    result = CliRunner().invoke(main, ["runtime", "--experts", "4", "--placement", str(path)])
    assert result.exit_code == 2 and "--placement" in result.output


@pytest.mark.slow
def test_runtime_json_reports_latency_throughput_and_accounting(tmp_path):
    windows = tmp_path / "windows.jsonl"
    result = _run(["runtime", "--ranks", "2", "--layers", "2", "--experts", "4", "--top-k", "2", "--steps", "6",
                   "--hidden", "16", "--ffn", "16", "--batch-tokens", "16", "--capacity-factor", "1.0",
                   "--overflow", "drop", "--window-steps", "3", "--windows-out", str(windows), "--json"])
    assert result.exit_code == 0
    out = json.loads(result.output)  # --json prints JSON only
    assert out["steps"] == 6 and out["measured_steps"] == 4
    assert 0 < out["step_p50_s"] <= out["step_p99_s"] and out["tokens_per_s"] > 0
    assert out["pairs_routed"] == 6 * 2 * 16 * 2 * 2 == out["pairs_computed"] + out["pairs_dropped"]
    assert out["pairs_lost"] == 0 and out["pairs_dropped"] > 0
    # Where the ranks ran: each on its own core when there are enough, else a warning says why not.
    binding = out["cpu_binding"]
    if binding["cores"] >= 2:
        assert binding["pinned"] and len(binding["rank_cores"]) == 2 and binding["threads_per_rank"] == 1
        assert not set(binding["rank_cores"][0]) & set(binding["rank_cores"][1])
    else:
        assert not binding["pinned"] and "busiest rank" in binding["warning"]
    lines = windows.read_text().splitlines()
    assert len(lines) == 2
    from moewatch.telemetry import Window
    parsed = [Window.from_json(line) for line in lines]
    assert sum(int(w.dropped_tokens.sum()) for w in parsed) == out["pairs_dropped"]
    assert all(w.runtime == "moewatch-runtime" and np.all(w.capacity_factor == 1.0) for w in parsed)
