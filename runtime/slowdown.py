"""An emulated slow device: one rank's expert compute takes F times as long, chosen at start or live.

This is an emulation, not a model of any real hardware fault: the rank runs its expert kernel F times
(the integer part) plus once more over the first (F - floor F) share of its rows, and keeps the first
run's output, so the results are exactly those of an unslowed run while the rank's compute phase
(the probe's DISPATCH_END -> COMPUTE_END span, hence Window.compute_seconds) lasts about F times as
long. Only expert compute is slowed: routing, the all-to-alls and everything else run at full speed.
The agent is never told: it has to find the slow rank from the windows, as it would a real one.

Sources of the factor, per rank:
- at start: `RuntimeConfig.slow_rank` runs at `slow_factor`, every other rank at 1.0;
- live: `RuntimeConfig.slowdown_file`, JSON {"<rank>": factor, ...} (ranks not named run at 1.0).
  Each rank stats the file at step boundaries (not per layer) and re-reads it when it changed. Once
  the file exists it overrides the start setting; a missing file gives no slowdown of its own (the
  start setting applies); a bad file logs one warning and the previous factors stay in force.
  `write_slowdown` writes the file atomically (temp file + rename), so a rank never reads half of it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from typing import Callable, Mapping

import torch

log = logging.getLogger("moewatch.runtime.slowdown")


def check_factor(value: object, where: str) -> float:
    """A slowdown factor as a float: finite and >= 1; ValueError naming `where` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: expected a number, got {value!r}")
    if not math.isfinite(value) or value < 1.0:
        raise ValueError(f"{where}: must be finite and >= 1.0, got {value!r}")
    return float(value)


def write_slowdown(path: str | os.PathLike, factors: Mapping[int, float]) -> None:
    """Write {rank: factor} as the slowdown file, atomically (a rank reads the old or the new file, whole)."""
    body = {str(int(rank)): check_factor(factor, f"rank {rank}") for rank, factor in factors.items()}
    target = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(target))
    fd, temp = tempfile.mkstemp(prefix=".slowdown-", suffix=".json", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(body, out)
        os.replace(temp, target)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise


def read_slowdown(path: str | os.PathLike) -> dict[int, float]:
    """{rank: factor} from a slowdown file; ValueError (OSError when unreadable) saying what is wrong."""
    with open(path, encoding="utf-8") as handle:
        try:
            data = json.load(handle)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON ({exc.msg})") from None
    if not isinstance(data, dict):
        raise ValueError('expected an object {"<rank>": factor, ...}')
    out: dict[int, float] = {}
    for key, factor in data.items():
        if not (isinstance(key, str) and key.isdigit()):
            raise ValueError(f"key {key!r} is not a rank number")
        out[int(key)] = check_factor(factor, f"rank {key}")
    return out


def start_factor(rank: int, slow_rank: int | None, slow_factor: float) -> float:
    """The factor `rank` starts at: slow_factor on the slow rank, 1.0 elsewhere."""
    return float(slow_factor) if slow_rank == rank else 1.0


class Slowdown:
    """The factor one rank runs at, with the live file folded in at step boundaries (`refresh`)."""

    def __init__(self, rank: int, slow_rank: int | None = None, slow_factor: float = 1.0,
                 path: str | None = None):
        self.rank = rank
        self.start_factor = start_factor(rank, slow_rank, slow_factor)
        self.path = path
        self.factor = self.start_factor
        self._seen: tuple | None = None  # (inode, size, mtime_ns) of the file last looked at; () when absent

    def refresh(self) -> float:
        """Stat the file (cheap); re-read it only when it changed. Returns the factor in force."""
        if self.path is None:
            return self.factor
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            if self._seen != ():
                self._seen = ()
                self.factor = self.start_factor
            return self.factor
        except OSError as exc:
            return self._keep(("error", exc.errno), f"cannot stat ({exc.strerror})")
        # The inode changes on every atomic replace, so two writes within the clock's granularity
        # are still told apart.
        seen = (st.st_ino, st.st_size, st.st_mtime_ns)
        if seen == self._seen:
            return self.factor
        try:
            factors = read_slowdown(self.path)
        except FileNotFoundError:  # replaced or removed between the stat and the open: look next step
            return self.factor
        except OSError as exc:
            return self._keep(seen, f"cannot read ({exc.strerror})")
        except ValueError as exc:
            return self._keep(seen, str(exc))
        self._seen = seen
        self.factor = factors.get(self.rank, 1.0)
        return self.factor

    def _keep(self, seen: tuple, why: str) -> float:
        # One warning per bad version of the file, not one per step.
        if seen != self._seen:
            log.warning("slowdown file %s: %s; rank %d keeps factor %g", self.path, why, self.rank, self.factor)
            self._seen = seen
        return self.factor


ExpertCompute = Callable[[torch.Tensor, list, torch.Tensor, torch.Tensor], torch.Tensor]


def run_slowed(compute: ExpertCompute, factor: float, rows: torch.Tensor, segment_counts: list[int],
               w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """compute(rows, segment_counts, w13, w2), taking about `factor` times as long; the first run's output.

    floor(factor) full runs, then one over the first round((factor - floor) * rows) rows (the
    segments cut to that prefix): the kernel's cost grows with its rows, so the extra is proportional."""
    out = compute(rows, segment_counts, w13, w2)
    if factor <= 1.0:
        return out
    for _ in range(int(factor) - 1):
        compute(rows, segment_counts, w13, w2)
    prefix = int(round((factor - int(factor)) * rows.shape[0]))
    if prefix > 0:
        compute(rows[:prefix], prefix_counts(segment_counts, prefix), w13, w2)
    return out


def prefix_counts(segment_counts: list[int], rows: int) -> list[int]:
    """The segment counts of the first `rows` rows of a grouped batch (same number of segments)."""
    out, left = [], rows
    for count in segment_counts:
        take = min(count, left)
        out.append(take)
        left -= take
    return out
