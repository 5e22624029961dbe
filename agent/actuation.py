"""Applies as jobs: `Actuator.apply` runs off the controller's lock and off the scheduler's threads.

The controller records a plan in flight under its lock and hands (group, plan) to `submit`; a worker
thread calls `apply` with no lock held and passes the outcome to `on_outcome(group_key, plan,
actuation, seconds)`, which the daemon routes onto the path a runtime's Ack takes. An apply that takes
minutes (a rolling restart) thus never holds up verification, ack timeouts, /status or /metrics of any
group. One apply at a time per group, in order (a group's next plan waits for its previous apply);
groups apply side by side, one thread per group with work, so threads stay within max_groups.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from moewatch.plan import Plan

from moewatch.integrations.base import Actuation, Actuator

log = logging.getLogger("moewatch.agent.actuation")

GroupKey = tuple[str, str]
Outcome = Callable[[GroupKey, Plan, Actuation, float], None]


@dataclass(frozen=True)
class Unfinished:
    """An apply the agent stopped before it finished: `running` (its actuator still holds it) or
    queued (never started)."""

    group_key: GroupKey
    plan: Plan
    running: bool
    seconds: float  # how long it had run (0 when queued)


class ActuationWorker:
    def __init__(self, actuator: Actuator, on_outcome: Outcome, max_queued: int = 256):
        self.actuator = actuator
        self.on_outcome = on_outcome
        self.max_queued = max_queued
        self._lock = threading.Lock()
        self._queued: dict[GroupKey, collections.deque] = {}  # plans waiting behind the group's running apply
        self._running: dict[GroupKey, tuple[Plan, float, threading.Thread]] = {}
        self._stopping = False  # no new work
        self._closed = False  # stop() returned: outcomes of applies left running are dropped

    def submit(self, group_key: GroupKey, plan: Plan) -> bool:
        """Queue an apply; False when the agent is stopping or max_queued plans already wait."""
        with self._lock:
            if self._stopping:
                return False
            if group_key in self._running:
                if sum(len(q) for q in self._queued.values()) >= self.max_queued:
                    return False
                self._queued.setdefault(group_key, collections.deque()).append(plan)
                return True
            self._start(group_key, plan)
            return True

    def _start(self, group_key: GroupKey, plan: Plan) -> None:
        """Start the group's worker on `plan` (lock held)."""
        thread = threading.Thread(target=self._run, args=(group_key, plan), name="moewatch-actuate", daemon=True)
        self._running[group_key] = (plan, time.monotonic(), thread)
        thread.start()

    def _run(self, group_key: GroupKey, plan: Plan) -> None:
        while True:
            started = time.monotonic()
            try:
                actuation = self.actuator.apply(group_key, plan)
            except Exception as exc:  # an actuator bug fails its plan, never the worker
                log.exception("actuator %s failed on epoch %d", getattr(self.actuator, "name", "?"), plan.epoch)
                actuation = Actuation("failed", f"actuator raised {exc.__class__.__name__}: {exc}")
            seconds = time.monotonic() - started
            with self._lock:
                closed = self._closed
            if not closed:
                try:
                    self.on_outcome(group_key, plan, actuation, seconds)
                except Exception:
                    log.exception("actuation outcome handling failed")
            with self._lock:
                queue = self._queued.get(group_key)
                if self._stopping or not queue:
                    self._queued.pop(group_key, None)
                    self._running.pop(group_key, None)
                    return
                plan = queue.popleft()
                self._running[group_key] = (plan, time.monotonic(), threading.current_thread())

    def busy(self, group_key: GroupKey) -> bool:
        with self._lock:
            return group_key in self._running

    def stop(self, timeout: float = 5.0) -> list[Unfinished]:
        """Take no more work; wait up to `timeout` s in all for running applies (an outcome that arrives
        meanwhile is reported as usual), then leave them: their threads are daemons, and a command an
        actuator started keeps running on its own. Returns what did not finish: applies still running
        and queued plans never started; no outcome is reported for them."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._stopping = True
            queued = [Unfinished(key, plan, False, 0.0) for key, q in self._queued.items() for plan in q]
            self._queued.clear()
            running = list(self._running.items())
        for _, (_, _, thread) in running:
            thread.join(max(0.0, deadline - time.monotonic()))
        now = time.monotonic()
        with self._lock:
            self._closed = True
            still = [Unfinished(key, plan, True, round(now - since, 3))
                     for key, (plan, since, _) in self._running.items()]
        return still + queued
