"""`moewatch bench vllm`: its error path (the runs themselves need vLLM's environment)."""

from __future__ import annotations

import subprocess
import sys


def test_bench_vllm_refuses_a_missing_environment_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "moewatch.cli", "bench", "vllm", "--python", "/nonexistent/python",
                           "--json"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "--python: /nonexistent/python does not exist" in proc.stderr and "Traceback" not in proc.stderr
