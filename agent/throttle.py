"""Log lines under attack: at most one per key per interval, with a count of the ones held back."""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable


class Throttle:
    """At most one log line per key per interval; the lines held back are counted into the next one."""

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic):
        self.interval = interval
        self.clock = clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = collections.defaultdict(int)
        self._lock = threading.Lock()

    def __call__(self, key: str) -> int | None:
        """None: stay quiet. Else the number of lines held back since the last one (log it)."""
        now = self.clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval:
                self._held[key] += 1
                return None
            self._last[key] = now
            return self._held.pop(key, 0)

    def log(self, logger: logging.Logger, level: int, key: str, message: str, *args) -> None:
        """`message` unless held back; the first line after held ones says how many were."""
        held = self(key)
        if held is None:
            return
        if held:
            message += " (%d more like this since the last line)"
            args = (*args, held)
        logger.log(level, message, *args)
