"""DeepEP low-latency statistics -> seconds, torch-free.

DeepEP's low-latency `dispatch` and `combine` take optional statistics tensors: per layer and rank,
`dispatch_wait_recv_cost_stats` / `combine_wait_recv_cost_stats`, int64 [num_ranks] by source
rank, the SM clock cycles the receiving rank spent waiting for that source's data, cumulative over
calls. The wrapper that passes them sits in the engine adapter (a GPU path); what it reads back (one
[W] row per rank, stacked) is turned into seconds here: the Window's optional `wait_seconds`
[L][W] (the adapter adds the dispatch and the combine waits), which the triage then uses
in place of its own transfer/wait estimate (docs/triage.md, step 1).
"""

from __future__ import annotations

import numpy as np


def wait_seconds(before: np.ndarray, after: np.ndarray, sm_clock_hz: float) -> np.ndarray:
    """Cumulative wait cycles read at a window's start and end -> the window's wait per layer and
    receiving rank, in seconds. before, after: int [L, W_recv, W_src] -> float [L, W_recv].

    The waits for different sources overlap in time, so their sum would count the same wall time more
    than once; the window carries the longest (a lower bound of the rank's wait, exact when the waits
    overlap fully). A counter that went down (the tensors were zeroed or
    reallocated) counts whole from zero."""
    b = np.asarray(before, dtype=np.int64)
    a = np.asarray(after, dtype=np.int64)
    if a.ndim != 3 or a.shape[1] != a.shape[2] or b.shape != a.shape:
        raise ValueError(f"wait cycles must be [L, W, W] twice, got {b.shape} and {a.shape}")
    if not sm_clock_hz > 0:
        raise ValueError(f"sm_clock_hz must be > 0, got {sm_clock_hz}")
    grown = np.where(a >= b, a - b, a)
    return grown.max(axis=2).astype(np.float64) / float(sm_clock_hz)
