"""How loaded the machine was while a command ran, recorded beside its figures (the benches' result
files and `moewatch replay`'s): the machine's busy CPU time (/proc/stat) less this process tree's own
(this process and the children it waited for), over the wall time between two samples. A run during
which other processes held BUSY_OTHER_CORES of a core or more is busy."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BUSY_OTHER_CORES = 0.10  # other processes' mean CPU, in cores, at or above which a run is busy


@dataclass(frozen=True)
class MachineSample:
    """One look at the machine: wall clock, busy CPU seconds of all processes, of this process tree."""

    unix_time: float
    monotonic: float
    machine_busy_seconds: float | None  # None: no /proc/stat here
    own_seconds: float
    load_average: tuple[float, float, float]


def machine_busy_seconds(proc_stat: str | None = None) -> float | None:
    """Busy CPU seconds of the whole machine since boot from /proc/stat's `cpu` line (user, nice,
    system, irq, softirq, steal; guest time is already inside user)."""
    try:
        text = proc_stat if proc_stat is not None else Path("/proc/stat").read_text()
    except OSError:
        return None
    fields = text.splitlines()[0].split()
    if fields[0] != "cpu":
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """This process's CPU seconds and those of the children it has waited for."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def sample() -> MachineSample:
    return MachineSample(time.time(), time.monotonic(), machine_busy_seconds(), own_cpu_seconds(),
                         tuple(round(x, 2) for x in os.getloadavg()))


def other_cpu_cores(before: MachineSample, after: MachineSample) -> float | None:
    """Mean CPU (in cores) other processes used between two samples; None without /proc/stat."""
    wall = after.monotonic - before.monotonic
    if before.machine_busy_seconds is None or after.machine_busy_seconds is None or wall <= 0:
        return None
    others = (after.machine_busy_seconds - before.machine_busy_seconds) - (after.own_seconds - before.own_seconds)
    return max(others, 0.0) / wall


def load_between(before: MachineSample, after: MachineSample) -> dict[str, Any]:
    """The machine's load between two samples, as a result file records it."""
    others = other_cpu_cores(before, after)
    wall = after.monotonic - before.monotonic
    return {
        "wall_seconds": round(wall, 2),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "load_average_before": list(before.load_average),
        "load_average_after": list(after.load_average),
        "own_cpu_cores": round((after.own_seconds - before.own_seconds) / wall, 3) if wall > 0 else None,
        "other_cpu_cores": None if others is None else round(others, 3),
        "busy_threshold_cores": BUSY_OTHER_CORES,
        # Without /proc/stat nothing says the machine was quiet: such a run counts as busy.
        "busy": others is None or others >= BUSY_OTHER_CORES,
    }
