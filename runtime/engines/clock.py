"""Step time on a device without a host sync: events recorded around each step and read only once
they have completed.

A device event (`torch.cuda.Event(enable_timing=True)`) is recorded on the stream when the host
reaches it; the device passes it later. `query()` asks, without waiting, whether it has; only then
is `elapsed_time` read (it raises on an unfinished event rather than wait). So the clock never
calls `synchronize`, `wait` or `elapsed_time` on an event that has not completed, and a step whose
events are not done yet is simply not read yet: `harvest()` returns what is complete, in step
order, and keeps the rest (at most `max_pending` steps; beyond that the oldest are dropped and
counted, which keeps memory bounded if the device stalls).

A failure anywhere in the timing path (an event type that cannot be made, recorded or read) turns
the clock off with one warning; the engine goes on, and its windows leave the step time out.
Events hold no tensors, so nothing here keeps the engine's memory alive.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Callable

log = logging.getLogger(__name__)


class EventClock:
    """begin_step() / end_step() around each step (host side, in order); harvest() -> the seconds of
    the steps whose events have completed since the last harvest, oldest first."""

    def __init__(self, make_event: Callable[[], Any], max_pending: int = 4096):
        self.make_event = make_event
        self.max_pending = max_pending
        self.enabled = True
        self.dropped = 0  # steps whose events were never read (pending beyond max_pending, or off)
        self.error = ""
        self._pending: deque[tuple[Any, Any]] = deque()
        self._start: Any = None

    def _off(self, exc: BaseException) -> None:
        self.enabled = False
        self.error = f"{type(exc).__name__}: {exc}"
        self.dropped += len(self._pending)
        self._pending.clear()
        self._start = None
        log.warning("moewatch: device step timing is off (%s); windows leave step time out", self.error)

    def begin_step(self) -> None:
        if not self.enabled:
            return
        try:
            self._start = self.make_event()
            self._start.record()
        except Exception as exc:
            self._off(exc)

    def end_step(self) -> None:
        if not self.enabled or self._start is None:
            return
        try:
            end = self.make_event()
            end.record()
        except Exception as exc:
            self._off(exc)
            return
        self._pending.append((self._start, end))
        self._start = None
        while len(self._pending) > self.max_pending:
            self._pending.popleft()
            self.dropped += 1

    @property
    def pending(self) -> int:
        return len(self._pending)

    def harvest(self) -> list[float]:
        """Seconds of each completed step, oldest first, in order: it stops at the first step whose
        end event the device has not passed (query() False), and reads nothing after it."""
        out: list[float] = []
        if not self.enabled:
            return out
        try:
            while self._pending:
                start, end = self._pending[0]
                if not end.query():
                    break
                out.append(start.elapsed_time(end) / 1000.0)  # milliseconds -> seconds
                self._pending.popleft()
        except Exception as exc:
            self._off(exc)
            return []
        return out


def cuda_event_factory() -> Callable[[], Any]:
    """Timing events on the current CUDA stream (GPU only)."""
    import torch

    return lambda: torch.cuda.Event(enable_timing=True)
