"""The mending's two loops (incremental.py: replica counts, then swaps), and the packing's greedy
loop and swap rounds (packing.lpt_pack, packing._SwapState.pair_round and top_round, behind every
solve_placement), compiled with numba where it is installed.

An engine calls its rebalancing policy inside a budget of tens of milliseconds. The numpy loops in
incremental._mend_counts and _swap_down spend most of a call on the fixed cost of their array
operations, some forty a swap round and hundreds of rounds a call, whatever the number of
layers left to mend. Here each layer runs its own steps as plain loops, so a step costs what its
candidates cost.

It is the same algorithm, step for step and bit for bit: the same candidates in the same order,
the same float operations (a GPU's load is summed in numpy's own order: `numpy_sum`), the same
first maximum. Every rank of an engine runs the policy itself, so an engine whose ranks all have
numba (vLLM ships it) gets the same maps as one whose ranks all lack it; tests compare the two
paths map for map. MOEWATCH_PLANNER_COMPILED=0 keeps the numpy loops. A call's layers are split
over a few threads (over_layers): the loops release the GIL and each layer is its own. The numba functions are in
_mending_kernels.py, imported only when asked for.

Sizes: W GPUs, S = P // W slots per GPU, M heavy GPUs a round, K partners each.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import numpy as np


SWITCH = "MOEWATCH_PLANNER_COMPILED"

_lock = threading.Lock()
_kernel = None  # the compiled functions (Kernel), once built
_unavailable: str | None = None  # why there is none
# What an unset switch means in this process: on, except where the process asked otherwise
# (`compile_only_when_asked`: the agent).
_default_on = True
# Threads the compiled loops split a call's layers over. The loops release the GIL and each layer is
# mended on its own, so the call takes the time of its slowest share of layers. One core stays free
# for the engine's own Python loop: on a 2-core machine, two threads mending at 8 nodes halved the
# Zipf placing call but let a thread stepping every 1 ms wait up to 5.3 ms (1.6 ms with one).
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
_THREADS = max(1, min(4, _CORES - 1))
_pool: ThreadPoolExecutor | None = None


def wanted(environ=os.environ) -> bool:
    """False when MOEWATCH_PLANNER_COMPILED turns the compiled rounds off (0, false, no, off); when
    it is unset, the process's default (on, unless `compile_only_when_asked` was called)."""
    value = environ.get(SWITCH, "").strip().lower()
    if not value:
        return _default_on
    return value not in ("0", "false", "no", "off")


def compile_only_when_asked() -> None:
    """Numpy's loops in this process unless MOEWATCH_PLANNER_COMPILED is set on. For the agent: it
    plans off any engine's step budget, and loading numba costs it over 100 MB of resident memory,
    more than a sidecar's memory limit leaves room for."""
    global _default_on
    _default_on = False


@dataclass(frozen=True)
class Kernel:
    """The compiled loops; each takes and returns what its numpy twin in incremental.py does."""

    mend_counts: Callable
    swap_down: Callable
    lpt_assign: Callable  # packing.lpt_pack's loop
    pair_round: Callable  # packing._SwapState.pair_round
    top_round: Callable  # packing._SwapState.top_round


def kernel() -> Kernel | None:
    """The compiled loops, or None when numba is not installed (or switched off). Compiled on first
    use, once per process, or read from numba's cache on disk where the package folder (or
    NUMBA_CACHE_DIR) is writable."""
    global _kernel, _unavailable
    if not wanted():
        return None
    if _kernel is not None or _unavailable is not None:
        return _kernel
    with _lock:
        if _kernel is None and _unavailable is None:
            try:
                _kernel = _build()
            except ImportError as exc:
                _unavailable = f"numba is not installed ({exc})"
    return _kernel


def over_layers(num_layers: int, run: Callable[[slice], np.ndarray]) -> np.ndarray:
    """run(layers) -> [len] a compiled loop's result for a run of consecutive layers, called on up to
    _THREADS threads at once, one run each -> [num_layers]. The same result as one call over all:
    no layer's work depends on another's (the loops write each layer's rows in place)."""
    global _pool
    parts = min(_THREADS, num_layers)
    if parts <= 1:
        return run(slice(0, num_layers))
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_THREADS, thread_name_prefix="moewatch-mending")
    edges = np.linspace(0, num_layers, parts + 1).astype(np.int64)
    runs = [_pool.submit(run, slice(int(a), int(b))) for a, b in zip(edges[:-1], edges[1:])]
    return np.concatenate([part.result() for part in runs])


def unavailable_reason() -> str | None:
    """Why kernel() returns None, once it has been asked (None while it works)."""
    if not wanted():
        return f"{SWITCH} is off" if os.environ.get(SWITCH, "").strip() else f"{SWITCH} is not set on"
    return _unavailable


def _build() -> Kernel:
    from . import _mending_kernels as kernels

    return Kernel(mend_counts=kernels.mend_counts, swap_down=kernels.swap_down, lpt_assign=kernels.lpt_assign,
                  pair_round=kernels.pair_round, top_round=kernels.top_round)


def warm_up_packing() -> str:
    """Compile the packing's loops now rather than in the first solve_placement (the agent's first
    plan), by solving a small placement on two nodes with replicas; -> a line for the log. Call it off
    the caller's path (a thread)."""
    import numpy as np

    from .solve import solve_placement

    if kernel() is None:
        return f"the packing runs numpy's loops: {unavailable_reason()}"
    solve_placement(np.array([[5.0, 3.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]] * 2), 4, 12, 2)
    return "the packing runs compiled"


def warm_up() -> str:
    """Compile the loops now rather than in the engine's first rebalance, by mending a small placement
    through the planner's own path (so with the argument types it passes); -> a line for the log
    saying which loops the mending runs. Call it off the engine's path (a thread): compiling takes
    seconds where numba's cache is empty."""
    import numpy as np

    from .incremental import repair_placement

    compiled = kernel()
    if compiled is None:
        return f"the mending runs numpy's loops: {unavailable_reason()}"
    # two GPUs carrying 4 and 2: over the target, so both loops run
    repair_placement(np.array([[3.0, 1.0, 1.0, 1.0]]), np.array([[0, 1, 2, 3]]), 2, 0.005)
    import numba

    return f"the mending runs compiled (numba {numba.__version__})"
