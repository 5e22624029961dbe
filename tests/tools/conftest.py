"""The tools' tests drive the agent: they share the agent tests' window builders and fixtures
(loaded from tests/agent/conftest.py; importlib mode gives conftest files no package to import from)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("moewatch_tests_agent_conftest",
                                               Path(__file__).resolve().parents[1] / "agent" / "conftest.py")
_agent = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_agent)

helpers = _agent.helpers
short_tmp = _agent.short_tmp
