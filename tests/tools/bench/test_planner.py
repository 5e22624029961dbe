"""`moewatch bench planner` from the command line."""

from __future__ import annotations

from click.testing import CliRunner

from moewatch.cli import main


def test_bench_planner_is_registered():
    result = CliRunner().invoke(main, ["bench", "planner", "--help"])
    assert result.exit_code == 0 and "--write" in result.stdout
