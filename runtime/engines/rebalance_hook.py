"""What the vLLM policy and the SGLang hook share around moewatch's planner in an engine's own
rebalancing: the switch and its settings, the decisions and fallbacks a process has recorded for
its next window, and the rule that an error is logged once and counted after.

Per process and never part of a decision: every rank decides from its inputs and the settings
alone (moewatch.planner.rebalance), so this state cannot make two ranks disagree.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from moewatch.planner.rebalance import DecisionRecords, RebalanceDecision, RebalanceSettings, switched_on


class RebalanceHookState:
    """One engine's hook in this process: its settings once installed, the last decision, the
    records not yet sent, and how many calls the engine's own algorithm answered after an error."""

    def __init__(self, engine: str, own_algorithm: str, logger: logging.Logger):
        self.engine = engine  # "vllm" or "sglang": the records' `engine` field
        self.own_algorithm = own_algorithm  # "vLLM's own EPLB policy", for the log lines
        self.logger = logger
        self.installed = False
        self.settings: RebalanceSettings | None = None
        self.last_decision: RebalanceDecision | None = None
        self.fallbacks = 0
        self.records = DecisionRecords()

    def settings_from_env(self, environ: Mapping[str, str]) -> RebalanceSettings | None:
        """The settings when MOEWATCH_EPLB is on and they parse; None (one warning for a bad one)
        leaves the engine's algorithm in place."""
        if not switched_on(environ):
            return None
        try:
            return RebalanceSettings.from_env(environ)
        except ValueError as exc:
            self.logger.warning("moewatch: %s; %s stays", exc, self.own_algorithm)
            return None

    def install(self, settings: RebalanceSettings) -> None:
        self.settings, self.installed = settings, True

    def decided(self, decision: RebalanceDecision) -> None:
        self.last_decision = decision
        self.records.append({"engine": self.engine, **decision.record()})

    def fell_back(self, exc: Exception) -> None:
        """An error inside moewatch's answer: the engine's own algorithm answers instead. Logged the
        first time, counted every time, and recorded for the next window."""
        self.fallbacks += 1
        if self.fallbacks == 1:
            self.logger.warning("moewatch: EPLB %s failed (%s: %s); %s answers this call and any later failure "
                                "(counted, not logged again)", "policy" if self.engine == "vllm" else "hook",
                                type(exc).__name__, exc, self.own_algorithm, exc_info=exc)
        self.last_decision = None
        self.records.append({"engine": self.engine, "fallback": True, "error": f"{type(exc).__name__}: {exc}"})

    def take_records(self) -> list[dict[str, Any]]:
        """The records of this process's calls since the last take (decisions and fallbacks), for the
        windows the adapter sends (`extra["engine_rebalance"]`)."""
        return self.records.take()


def package_version(name: str) -> str:
    """The installed engine's version for a warning, or "unknown"."""
    try:
        module = __import__(name)
        return str(getattr(module, "__version__", "unknown"))
    except Exception:
        return "unknown"
