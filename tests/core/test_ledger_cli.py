"""`moewatch ledger SOURCE...`: one line per rebalance (or --json) from a folder of recorded windows, the
same entries the core computes; an audit log's rebalance_ledger lines; bad input exits 2 with one line."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from moewatch import cli

STEPS = 4


def folder_of_windows(hand, folder, stall: float = 0.2):
    """Five windows of 10 ms steps, the second carrying an engine's own rebalance with one step `stall`
    longer, 6 ms steps after it; the files are written in reverse so the command must order them."""
    folder.mkdir()
    for i in range(5):
        seconds = [0.010 if i < 2 else 0.006] * STEPS
        extra = {}
        if i == 1:
            seconds[-1] += stall
            extra["engine_rebalance"] = [{"engine": "sglang", "policy": "engine", "time": 101.5,
                                          "layers_changed": [0], "slots_moved": 2, "bytes_moved": 2e6}]
        w = hand.window(hand.uniform(2, 10), [0.001] * 2, [0.001] * 2, [0.003] * 2, steps=STEPS,
                        start_time=100.0 + i, end_time=100.5 + i, step_seconds=seconds, extra=extra)
        (folder / f"window-{9 - i}.json").write_text(w.to_json())
    return folder


def test_a_window_folder_gives_one_entry_per_rebalance(hand, tmp_path):
    folder = folder_of_windows(hand, tmp_path / "windows")
    result = CliRunner().invoke(cli.main, ["ledger", str(folder), "--json", "--windows", "2"])
    assert result.exit_code == 0, result.output
    [entry] = json.loads(result.stdout)
    assert (entry["model"], entry["ep_group"], entry["policy"], entry["engine"]) == ("m", "g", "engine_own", "sglang")
    assert entry["settled"] and entry["windows"] == {"before": 1, "during": 1, "after": 2}
    assert entry["stall_seconds"] == pytest.approx(0.2)
    assert entry["gain_seconds_per_step"] == pytest.approx(0.004)
    # Settled once its two windows after are in: the steps seen by then (no interval, no next rebalance).
    assert (entry["horizon_steps"], entry["horizon"]) == (2 * STEPS, "observed")
    assert entry["net_seconds"] == pytest.approx(0.004 * 8 - 0.2) and entry["outcome"] == "did_not_pay"
    assert entry["break_even_steps"] == pytest.approx(50.0)
    text = CliRunner().invoke(cli.main, ["ledger", str(folder), "--windows", "2"])
    assert text.exit_code == 0 and len(text.stdout.splitlines()) == 1
    line = text.stdout
    assert "m/g sglang's own policy: 1 layers, 2 slots (2.0 MB)" in line
    assert "stall 0.200 s, gain 4.000 ms/step, net -0.168 s over 8 steps (observed), break-even 50.0 steps" in line
    assert line.rstrip().endswith("did not pay")


def test_an_audit_log_gives_the_entries_the_agent_settled(tmp_path):
    log = tmp_path / "audit.jsonl"
    entry = {"policy": "agent_plan", "engine": "moewatch-runtime", "rebalanced_at": 50.0, "settled": True,
             "layers_changed": [1], "slots_moved": 3, "stall_seconds": 0.1, "gain_seconds_per_step": 0.001,
             "net_seconds": 0.3, "horizon_steps": 400, "horizon": "observed", "break_even_steps": 100.0,
             "outcome": "paid"}
    lines = [{"time": 1.0, "event": "agent_started"},
             {"time": 60.0, "event": "rebalance_ledger", "model": "m", "ep_group": "g", **entry}]
    log.write_text("".join(json.dumps(x) + "\n" for x in lines))
    result = CliRunner().invoke(cli.main, ["ledger", str(log), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == [{"model": "m", "ep_group": "g", **entry, "audited_at": 60.0}]
    text = CliRunner().invoke(cli.main, ["ledger", str(log)]).stdout
    assert "the agent's plan" in text and "net +0.300 s over 400 steps" in text and text.rstrip().endswith("paid")


@pytest.mark.parametrize("make, message", [
    (lambda p: p / "missing", "no such file or folder"),
    (lambda p: (p / "empty").mkdir() or p / "empty", "no window files"),
    (lambda p: (p / "bad.json").write_text('{"schema": "moewatch.window/v1"}') and p / "bad.json", "invalid window"),
    (lambda p: (p / "log.jsonl").write_text('{"event": "x"}\nnot json\n') and p / "log.jsonl", "log.jsonl:2: not a JSON"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, make, message):
    result = CliRunner().invoke(cli.main, ["ledger", str(make(tmp_path))])
    assert result.exit_code == 2
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr, result.stderr
