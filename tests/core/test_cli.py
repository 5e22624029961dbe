"""The lazy CLI: help and the core verbs never import torch; a verb whose module is missing says so."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from moewatch import cli

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import sys
from moewatch.cli import main
try:
    main({args!r}, standalone_mode=False)
except SystemExit:
    pass
print("torch" in sys.modules, "moewatch.agent.daemon" in sys.modules)
"""


def imported_after(args: list[str]) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE.format(args=args)], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    return out.stdout.strip().splitlines()[-1]


def test_help_and_diagnose_import_neither_torch_nor_the_agent():
    assert imported_after(["--help"]) == "False False"
    assert imported_after(["diagnose", str(ROOT / "examples" / "healthy.json"), "--json"]) == "False False"


def test_a_verb_whose_module_is_missing_fails_with_one_clear_line(monkeypatch):
    monkeypatch.setitem(cli.VERBS, "ghost", ("moewatch.not_installed:ghost", "a verb from a missing extra"))
    result = CliRunner().invoke(cli.main, ["ghost", "--anything"], prog_name="moewatch")
    assert result.exit_code == 1
    assert "`moewatch ghost` is unavailable here: No module named 'moewatch.not_installed'" in result.output
    assert "Traceback" not in result.output
