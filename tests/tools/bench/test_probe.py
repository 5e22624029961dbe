"""`moewatch bench probe`: bad input in one line, and the --json contract (a tiny run)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from moewatch.cli import main


def _run(args):
    return CliRunner().invoke(main, args, catch_exceptions=False)


def test_bad_input_exits_2_with_one_line_naming_the_flag(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    result = CliRunner().invoke(main, ["bench", "probe", "--block-steps", "7", "--window-steps", "50"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "--block-steps" in lines[0] and "Traceback" not in result.output


@pytest.mark.slow
def test_bench_probe_json_contract(tmp_path):
    result = _run(["bench", "probe", "--json", "--ranks", "2", "--layers", "1", "--experts", "4", "--hidden", "16",
                   "--ffn", "16", "--batch-tokens", "16", "--windows", "2", "--window-steps", "2",
                   "--block-steps", "1", "--warmup-steps", "0",
                   "--results-dir", str(tmp_path)])
    assert result.exit_code == 0
    out = json.loads(result.stdout)  # progress goes to stderr; stdout is JSON only
    assert out["overhead_ratio"] > 0 and out["overhead_ratio_of_means"] > 0
    assert out["steps_measured"] == 8 and out["windows_built"] >= 2 and out["windows_invalid"] == 0
    record = json.loads(next(tmp_path.glob("probe-*.json")).read_text())
    assert record["bench"] == "probe" and record["result"] == out
