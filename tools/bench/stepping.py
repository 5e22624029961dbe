"""How long an engine's own Python loop would wait while a policy runs: a Python thread steps every
`interval` seconds (sleeps, then notes the time) and the time between its steps is recorded. A policy
that holds the GIL (a Python loop, or C code that does not release it) delays the steps; one that
sleeps or computes with the GIL released does not. The engines call their rebalancing policy on a
thread of their own process (vLLM's async EPLB thread) or in the scheduler's loop (SGLang), so a step
delayed here is their scheduling, sampling or detokenising delayed there.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np


class SteppingThread:
    """Context manager: a daemon thread stepping every `interval` seconds while the block runs;
    `gaps` holds the seconds between consecutive steps (the interval plus any wait)."""

    def __init__(self, interval: float = 0.001) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be > 0, got {interval}")
        self.interval = interval
        self.gaps: list[float] = []
        self._stop = threading.Event()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._step, name="moewatch-stepping", daemon=True)

    def _step(self) -> None:
        last = time.perf_counter()
        self._started.set()
        while not self._stop.is_set():
            time.sleep(self.interval)
            now = time.perf_counter()
            self.gaps.append(now - last)
            last = now

    def __enter__(self) -> "SteppingThread":
        self._thread.start()
        self._started.wait()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def pause_figures(gaps: list[float], interval: float = 0.001) -> dict[str, Any]:
    """Seconds between a stepping thread's steps -> the longest, the 99th percentile and the median
    (None when it never stepped), and how many steps were seen."""
    if not gaps:
        return {"pause_max_seconds": None, "pause_p99_seconds": None, "pause_median_seconds": None,
                "steps": 0, "step_interval_seconds": interval}
    values = np.asarray(gaps, dtype=np.float64)
    return {"pause_max_seconds": float(values.max()), "pause_p99_seconds": float(np.percentile(values, 99)),
            "pause_median_seconds": float(np.median(values)), "steps": int(values.size),
            "step_interval_seconds": interval}
