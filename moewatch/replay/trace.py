"""The operator's recorded windows as one trace in time order: what the replay replays.

Inputs are what `moewatch plan --load` reads (moewatch/planner/files.py): a folder an engine adapter
wrote (MOEWATCH_WINDOW_DIR: one window file each, shards of one window included), single window files,
and SGLang's expert-distribution dumps (a `.pt` stat dump, or a folder of dumps: each dump set one
window, moewatch/integrations/sglang/dump.py). Shards of one window sequence are merged as the agent
merges them (moewatch/shards.py); the windows are then ordered by their start time. Every window must
carry a load per expert (`expert_tokens`) and share the first one's EP group and sizes.

Sizes: T windows, L layers, E logical experts, P slots, W ranks.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from ..errors import InputError
from ..planner.files import FileFormatError, is_window_file, read_window, window_files


class TraceError(InputError):
    """Recorded windows the replay cannot use; the message names the file or the field."""


@dataclass(frozen=True)
class Trace:
    """Recorded windows in time order."""

    loads: np.ndarray  # [T, L, E] float64 pairs per logical expert
    steps: np.ndarray  # [T] int64 forward steps in each window
    step_seconds: np.ndarray  # [T] float64 mean wall seconds of a step, NaN where the window has none
    step_tokens: np.ndarray  # [T] float64 mean tokens per step, NaN where the window has none
    start_time: np.ndarray  # [T] unix seconds
    maps: np.ndarray  # [T, L, P] map in force during each window
    world_size: int
    ranks_per_node: int
    runtime: str
    model: str
    ep_group: str
    rebalance_records: list[dict[str, Any]] = field(default_factory=list)  # extra.engine_rebalance, in order
    step_times: list[np.ndarray | None] = field(default_factory=list)  # [T] each window's step_seconds
    rebalancing: dict[str, Any] | None = None  # the engine's own settings (extra.rebalancing), the latest
    refused_shards: int = 0  # shards left out of their window's merge (they disagreed with the others)
    files: tuple[str, ...] = ()
    digest: str = ""

    @property
    def num_windows(self) -> int:
        return int(self.loads.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.loads.shape[1])

    @property
    def num_experts(self) -> int:
        return int(self.loads.shape[2])

    @property
    def num_slots(self) -> int:
        return int(self.maps.shape[2])

    @property
    def total_steps(self) -> int:
        return int(self.steps.sum())


def read_trace(paths: Iterable[str | Path]) -> Trace:
    """Recorded windows from `paths` (folders, window files, SGLang dumps) -> Trace; TraceError or
    FileFormatError (both InputError) naming what is wrong. A file given twice (a folder and a file in
    it) counts once."""
    windows, files, seen = [], [], set()
    for raw in paths:
        for window, made_of in _windows_of(Path(raw)):
            key = frozenset(f.resolve() for f in made_of)
            if key in seen:
                continue
            seen.add(key)
            windows.append(window)
            files += made_of
    if not windows:
        raise TraceError("WINDOWS", "no windows given")
    merged, refused = _merged(windows)
    return replace(trace_of(merged, files), refused_shards=refused)


def _windows_of(path: Path) -> list[tuple[Any, list[Path]]]:
    """[(window, the files it was read from)] of one argument."""
    if path.is_dir():
        files = window_files(path)
        if files:
            return [(read_window(f), [f]) for f in files]
        return _sglang_dumps(path)
    if not path.is_file():
        raise FileFormatError(path, "no such file or folder")
    if path.suffix.lower() == ".pt":
        return _sglang_dumps(path)
    if not is_window_file(path):
        raise FileFormatError(path, "not a window file (JSON or binary) nor an SGLang .pt dump")
    return [(read_window(path), [path])]


def _sglang_dumps(path: Path) -> list[tuple[Any, list[Path]]]:
    """SGLang's dumps (a stat dump file, or a folder of dump sets) as windows, one per dump set; the
    SGLang room's reader names a bad file (SourceError, an InputError)."""
    from ..integrations.sglang.dump import dump_sets, load_source, window_from_paths

    if path.is_file():
        return [(load_source(path), [path])]
    sets = dump_sets(sorted(path.iterdir()))
    if not sets:
        raise FileFormatError(path, "no window files and no SGLang dumps (expert_distribution_recorder_*.pt) in "
                                    "this folder")
    return [(window_from_paths(s), list(s)) for s in sets]


def _merged(windows: list[Any]) -> tuple[list[Any], int]:
    """(whole windows ordered by start time, shards refused): each shard sequence merged as the agent
    merges it (moewatch/shards.py: the agreeing shards kept, the missing ones named in the window)."""
    from ..shards import merge_recorded

    try:
        whole, refused = merge_recorded(windows)
    except ValueError as exc:
        raise TraceError("WINDOWS", str(exc)) from None
    return sorted(whole, key=lambda w: (w.start_time, w.end_time)), len(refused)


def trace_of(windows: list[Any], files: list[Path] = ()) -> Trace:
    """Whole windows in time order -> Trace; TraceError when one lacks a load per expert or differs
    from the first in EP group or sizes."""
    first = windows[0]
    shape = (first.num_layers, first.num_experts, first.num_slots, first.world_size)
    loads, steps, seconds, tokens, starts, maps, records, step_times = [], [], [], [], [], [], [], []
    rebalancing = None
    for i, w in enumerate(windows):
        where = f"window {i} (start {w.start_time:.3f})"
        if w.expert_tokens is None:
            raise TraceError(where, "expert_tokens: absent (a window of per-rank totals has no load per expert)")
        if (w.model, w.ep_group) != (first.model, first.ep_group):
            raise TraceError(where, f"model/ep_group {w.model}/{w.ep_group}, the first window's are "
                                    f"{first.model}/{first.ep_group}: replay one EP group's windows")
        got = (w.num_layers, w.num_experts, w.num_slots, w.world_size)
        if got != shape:
            raise TraceError(where, f"[layers, experts, slots, ranks] {list(got)}, the first window's are "
                                    f"{list(shape)}")
        loads.append(np.asarray(w.expert_tokens, dtype=np.float64))
        n = int(w.steps)
        steps.append(n)
        has_steps = w.step_seconds is not None and n > 0 and len(w.step_seconds) == n
        seconds.append(float(np.mean(w.step_seconds)) if has_steps else np.nan)
        step_times.append(np.asarray(w.step_seconds, dtype=np.float64) if has_steps else None)
        tokens.append(float(np.mean(w.step_tokens)) if w.step_tokens is not None and n > 0 else np.nan)
        starts.append(float(w.start_time))
        maps.append(np.asarray(w.physical_to_logical_map, dtype=np.int64))
        extra = w.extra or {}
        for record in extra.get("engine_rebalance") or []:
            if isinstance(record, dict):
                records.append({**record, "window": i})
        if isinstance(extra.get("rebalancing"), dict):
            rebalancing = extra["rebalancing"]
    return Trace(np.stack(loads), np.array(steps, dtype=np.int64), np.array(seconds), np.array(tokens),
                 np.array(starts), np.stack(maps), int(first.world_size), int(first.ranks_per_node),
                 str(first.runtime), str(first.model), str(first.ep_group), records, step_times, rebalancing,
                 files=tuple(str(f) for f in files), digest=inputs_digest(files))


def inputs_digest(files: Iterable[Path]) -> str:
    """Hex SHA-256 over the input files' names and bytes, in name order: which recording a result is of."""
    h = hashlib.sha256()
    for path in sorted(Path(f) for f in files):
        h.update(path.name.encode() + b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()
