"""`moewatch report` draws a PNG of a window and rejects bad input like diagnose does."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from moewatch.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_report_writes_a_png(tmp_path):
    out = tmp_path / "r.png"
    result = CliRunner().invoke(main, ["report", str(ROOT / "examples" / "comm-bound-placement.json"),
                                       "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000


def test_report_bad_input_exits_two(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    result = CliRunner().invoke(main, ["report", str(bad), "--out", str(tmp_path / "r.png")])
    assert result.exit_code == 2 and "unknown schema" in result.stderr
    assert not (tmp_path / "r.png").exists()
