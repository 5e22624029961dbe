"""What the vLLM policy and the SGLang hook share around moewatch's planner in an engine's own
rebalancing: the switch and its settings, the decisions and fallbacks a process has recorded for
its next window, and the rule that an error is logged once and counted after.

Per process and never part of a decision: every rank decides from its inputs and the settings
alone (moewatch.planner.rebalance), so this state cannot make two ranks disagree.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from moewatch.planner import mending_compiled
from moewatch.planner.rebalance import DecisionRecords, RebalanceDecision, RebalanceSettings, switched_on


class RebalanceHookState:
    """One engine's hook in this process: its settings once installed, the last decision, the
    records not yet sent, and how many calls the engine's own algorithm answered after an error."""

    def __init__(self, engine: str, engine_name: str, own_algorithm: str, logger: logging.Logger):
        self.engine = engine  # "vllm" or "sglang": the records' `engine` field and the package
        self.engine_name = engine_name  # "vLLM", for the log lines
        self.own_algorithm = own_algorithm  # "vLLM's own EPLB policy", for the log lines
        self.logger = logger
        self.installed = False
        self.settings: RebalanceSettings | None = None
        self.last_decision: RebalanceDecision | None = None
        self.fallbacks = 0
        self.declines = 0  # calls `declined`: the engine's algorithm answered, no error
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

    def install_from_env(self, environ: Mapping[str, str], import_engine: Callable[[], Any],
                         interface_problem: Callable[[Any], str | None],
                         attach: Callable[[Any, RebalanceSettings], None]) -> bool:
        """What both adapters do at start: with MOEWATCH_EPLB on and good settings, import the
        engine's modules (`import_engine`), check the interface they expose (`interface_problem`
        returns what differs, or None) and `attach` moewatch's answer; True when it is in place.
        Idempotent. Never raises: a bad setting, a missing module or another interface leaves the
        engine's own algorithm in place, with one warning naming the engine's version."""
        if self.installed:
            return True
        settings = self.settings_from_env(environ)
        if settings is None:
            return False
        version = package_version(self.engine)
        try:
            modules = import_engine()
        except ImportError as exc:
            self.logger.warning("moewatch: %s %s lacks what moewatch's EPLB answer needs (%s); %s stays",
                                self.engine_name, version, exc, self.own_algorithm)
            return False
        problem = interface_problem(modules)
        if problem is not None:
            self.logger.warning("moewatch: %s %s: %s; %s stays", self.engine_name, version, problem,
                                self.own_algorithm)
            return False
        self.settings, self.installed = settings, True
        attach(modules, settings)
        threading.Thread(target=self._warm_up, name="moewatch-eplb-warm-up", daemon=True).start()
        return True

    def _warm_up(self) -> None:
        # numba compiles the mending's loops on first use: here, while the engine loads its model,
        # not in its first rebalance. A failure only means the first call compiles (or runs numpy).
        try:
            self.logger.info("moewatch: %s's EPLB answer is in place; %s", self.engine_name,
                             mending_compiled.warm_up())
        except Exception as exc:  # noqa: BLE001 - a warm-up never stops the engine
            self.logger.warning("moewatch: compiling the mending ahead failed (%s: %s); its first use compiles it",
                                type(exc).__name__, exc)

    def decided(self, decision: RebalanceDecision, **identity: Any) -> None:
        """A decision, recorded for the next window with `identity` (vLLM: the call's ordinal and
        digest, vllm_eplb.py)."""
        self.last_decision = decision
        self.records.append({"engine": self.engine, **identity, **decision.record()})

    def fell_back(self, exc: Exception, **identity: Any) -> None:
        """An error inside moewatch's answer: the engine's own algorithm answers instead. Logged the
        first time, counted every time, and recorded for the next window (with `identity`, as in
        `decided`)."""
        self.fallbacks += 1
        if self.fallbacks == 1:
            self.logger.warning("moewatch: EPLB %s failed (%s: %s); %s answers this call and any later failure "
                                "(counted, not logged again)", "policy" if self.engine == "vllm" else "hook",
                                type(exc).__name__, exc, self.own_algorithm, exc_info=exc)
        self.last_decision = None
        self.records.append({"engine": self.engine, **identity, "fallback": True,
                             "error": f"{type(exc).__name__}: {exc}"})

    def declined(self, reason: str, **identity: Any) -> None:
        """moewatch's answer does not fit what the engine asked (a static placement of other sizes): the
        engine's own algorithm answered. Recorded like a fallback, counted apart from the errors (so the
        first error is still logged); the caller warns once, naming what differs."""
        self.declines += 1
        self.last_decision = None
        self.records.append({"engine": self.engine, **identity, "fallback": True, "error": reason})

    def take_records(self) -> list[dict[str, Any]]:
        """The records of this process's calls since the last take (decisions and fallbacks), for the
        windows the adapter sends (`extra["engine_rebalance"]`)."""
        return self.records.take()


def recorded_expert_bytes(environ: Mapping[str, str], engine_name: str, logger: logging.Logger) -> float | None:
    """Bytes of one expert's weights for the records of the engine's own rebalances (MOEWATCH_EPLB_EXPERT_BYTES),
    None when unset; a bad value is said once and the rebalances are recorded without bytes."""
    if not environ.get("MOEWATCH_EPLB_EXPERT_BYTES"):
        return None
    try:
        return RebalanceSettings.from_env(environ).expert_bytes
    except ValueError as exc:
        logger.warning("moewatch: %s; %s's rebalances are recorded without bytes", exc, engine_name)
        return None


def package_version(name: str) -> str:
    """The installed engine's version for a warning, or "unknown"."""
    try:
        module = __import__(name)
        return str(getattr(module, "__version__", "unknown"))
    except Exception:
        return "unknown"
