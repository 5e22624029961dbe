"""SGLang's expert-distribution recorder dumps as Windows.

SGLang writes a dump on `/dump_expert_distribution_record` into SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR
with torch.save (python/sglang/srt/eplb/expert_distribution.py, `_StatAccumulator.dump`,
`_DetailAccumulator.dump`, `_dump_to_file`):

- mode `stat`: rank 0 writes `expert_distribution_recorder_{time}.pt` = {rank, logical_count: int32
  [B, L, E], average_utilization_rate_over_window}. A circular buffer of B forward passes, already
  summed over ranks and mapped to logical experts: rows are out of time order once it wrapped, unused
  rows are zero. Logical counts only: the window has no rank-level counts.
- modes `per_pass` / `per_token`: every rank writes `expert_distribution_recorder_{time}_{rank}.pt` =
  {records: [{forward_pass_id, rank, global_physical_count: [L, P], ...}], last_physical_to_logical_map:
  [L, P]}. Summed over the ranks' records, the physical counts are the pairs each slot computed, so
  the window carries `slot_tokens` and with them real rank load; the logical counts follow through the
  map. The map is the one in force at the dump ("last"): an EPLB rebalance during recording is not seen.

Neither carries timings, per-step batch sizes, nor where tokens started (local/sent/received): those
fields are absent. SGLang's MoE is dropless, so dropped and rerouted pairs are zeros. torch is
imported only inside `read_dump` (weights_only=True, map_location="cpu").

Sizes: L layers, E logical experts, P physical slots, W ranks, B buffer rows.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from ...telemetry import Window, WindowError
from ..base import SourceError

RUNTIME = "sglang"
DUMP_NAME = re.compile(r"^expert_distribution_recorder_(\d+(?:\.\d+)?)(?:_(\d+))?\.pt$")
# Ranks dump on the same request within moments; files further apart belong to different dumps.
SET_GAP_SECONDS = 10.0
# Identity fields a dump does not record: the window holds placeholders (top_k 1, hidden_bytes 0,
# one node) that the triage does not use without timings; the list says so.
NOT_IN_DUMP = ["top_k", "hidden_bytes", "ranks_per_node"]


@dataclass(frozen=True)
class Dump:
    """One dump file, its arrays as numpy."""

    path: Path
    kind: str  # "stat" | "per_pass"
    time: float  # unix seconds it was written (from its name, else the file's mtime)
    rank: int
    logical_count: np.ndarray | None = None  # stat: [B, L, E]
    physical_count: np.ndarray | None = None  # per_pass: [R, L, P], one row per record
    pass_ids: tuple[int, ...] = ()  # per_pass: forward_pass_id of each record
    physical_to_logical_map: np.ndarray | None = None  # per_pass: [L, P]
    extra: dict[str, Any] = field(default_factory=dict)


def dump_time_and_rank(path: Path) -> tuple[float | None, int | None]:
    match = DUMP_NAME.match(path.name)
    if not match:
        return None, None
    return float(match.group(1)), None if match.group(2) is None else int(match.group(2))


def read_dump(path: str | Path) -> Dump:
    """Read one SGLang dump; SourceError names the file and what is wrong with it."""
    path = Path(path)
    if not path.is_file():
        raise SourceError(str(path), "no such file")
    try:
        import torch  # only here: SGLang writes its dumps with torch.save
    except ImportError:
        raise SourceError(str(path), "reading SGLang's .pt dumps needs torch "
                                     "(pip install 'moewatch[runtime]')") from None
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated, not a torch file, or unsafe to unpickle: torch raises many types
        raise SourceError(str(path), f"not a loadable torch file ({type(exc).__name__})") from None
    named_time, named_rank = dump_time_and_rank(path)
    when = named_time if named_time is not None else path.stat().st_mtime
    if not isinstance(data, dict):
        raise SourceError(str(path), "not an SGLang expert-distribution dump (expected a dict)")
    if "logical_count" in data:
        counts = _counts(path, "logical_count", data["logical_count"], 3)
        rate = data.get("average_utilization_rate_over_window")
        return Dump(path, "stat", when, _rank(path, data.get("rank", 0)), logical_count=counts,
                    extra={"average_utilization_rate_over_window": None if rate is None else float(rate)})
    if "records" in data and "last_physical_to_logical_map" in data:
        pmap = _counts(path, "last_physical_to_logical_map", data["last_physical_to_logical_map"], 2)
        records = data["records"]
        if not isinstance(records, list):
            raise SourceError(str(path), "records: expected a list")
        rows, ids, ranks = [], [], set()
        for i, rec in enumerate(records):
            if not isinstance(rec, dict) or "global_physical_count" not in rec:
                raise SourceError(str(path), f"records[{i}]: no global_physical_count")
            row = _counts(path, f"records[{i}].global_physical_count", rec["global_physical_count"], 2)
            if row.shape != pmap.shape:
                raise SourceError(str(path), f"records[{i}].global_physical_count: shape {list(row.shape)} does not "
                                             f"match the map's {list(pmap.shape)}")
            rows.append(row)
            ids.append(int(rec.get("forward_pass_id", i)))
            ranks.add(_rank(path, rec.get("rank", named_rank or 0)))
        if len(ranks) > 1:
            raise SourceError(str(path), f"records from several ranks {sorted(ranks)} in one file")
        rank = ranks.pop() if ranks else (named_rank or 0)
        physical = np.stack(rows) if rows else np.zeros((0, *pmap.shape), dtype=np.int64)
        return Dump(path, "per_pass", when, rank, physical_count=physical, pass_ids=tuple(ids),
                    physical_to_logical_map=pmap)
    raise SourceError(str(path), "not an SGLang expert-distribution dump (no logical_count, no records)")


def _rank(path: Path, value: Any) -> int:
    try:
        rank = int(value)
    except (TypeError, ValueError):
        raise SourceError(str(path), f"rank: expected an integer, got {value!r}") from None
    if rank < 0:
        raise SourceError(str(path), f"rank: {rank} is negative")
    return rank


def _counts(path: Path, name: str, value: Any, ndim: int) -> np.ndarray:
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    try:
        arr = np.asarray(value)
    except ValueError:
        raise SourceError(str(path), f"{name}: ragged array") from None
    if arr.dtype.kind not in "iu":
        raise SourceError(str(path), f"{name}: expected integers, got {arr.dtype}")
    if arr.ndim != ndim or 0 in arr.shape:
        raise SourceError(str(path), f"{name}: expected {ndim} non-empty dimensions, got shape {list(arr.shape)}")
    if arr.min() < 0:
        raise SourceError(str(path), f"{name}: negative counts")
    return arr.astype(np.int64)


# --- windows -----------------------------------------------------------------------------------

def _window(path_label: str, **fields: Any) -> Window:
    L, E = fields["num_layers"], fields["num_experts"]
    base = dict(runtime=RUNTIME, ranks_per_node=fields.pop("ranks_per_node", None) or fields["world_size"],
                epoch=0, hidden_bytes=0, dropped_tokens=np.zeros((L, E), np.int64),
                rerouted_tokens=np.zeros((L, E), np.int64), capacity_factor=np.zeros(L))
    try:
        return Window(**base, **fields)
    except WindowError as exc:
        raise SourceError(path_label, f"does not make a valid window: {exc}") from None


def stat_window(dump: Dump, *, model: str = "sglang", ep_group: str = "ep0", world_size: int = 1,
                top_k: int = 1, physical_to_logical_map: np.ndarray | None = None,
                start_time: float | None = None) -> Window:
    """A stat dump [B, L, E] as one Window of logical counts (rank-level counts, timings absent).

    Rows are summed whatever their order (a wrapped buffer holds the newest B passes, out of order);
    zero rows are unused slots of the buffer and do not count as steps. Without a map the placement
    is SGLang's trivial one (slot s holds expert s % E, E slots) over `world_size` ranks."""
    counts = dump.logical_count
    _, L, E = counts.shape
    used = counts.reshape(counts.shape[0], -1).any(axis=1)
    pmap = (np.tile(np.arange(E, dtype=np.int64), (L, 1)) if physical_to_logical_map is None
            else np.asarray(physical_to_logical_map, dtype=np.int64))
    return _window(str(dump.path), model=model, ep_group=ep_group, world_size=world_size, num_layers=L,
                   num_experts=E, num_slots=pmap.shape[1], top_k=min(top_k, E), steps=int(used.sum()),
                   start_time=dump.time if start_time is None else min(start_time, dump.time), end_time=dump.time,
                   physical_to_logical_map=pmap, expert_tokens=counts.sum(axis=0),
                   extra={"source": {"kind": "sglang-stat-dump", "file": dump.path.name, "not_in_dump": NOT_IN_DUMP,
                                     "buffer_rows": int(counts.shape[0]), "rows_used": int(used.sum()),
                                     # A full buffer may have wrapped: older passes were overwritten.
                                     "buffer_full": bool(used.all()),
                                     **dump.extra}})


def per_pass_window(dumps: Iterable[Dump], *, model: str = "sglang", ep_group: str = "ep0", top_k: int = 1,
                    world_size: int | None = None, start_time: float | None = None) -> Window:
    """Every rank's per_pass dump of one dump set as one Window with per-slot counts and rank load.

    W is the number of ranks (they must be 0..W-1, one file each) unless given."""
    dumps = sorted(dumps, key=lambda d: d.rank)
    if not dumps:
        raise SourceError("<dumps>", "no per_pass dump")
    label = str(dumps[0].path.parent)
    ranks = [d.rank for d in dumps]
    if len(set(ranks)) != len(ranks):
        raise SourceError(label, f"two dumps of the same rank in one set (ranks {ranks})")
    W = world_size or len(dumps)
    if ranks != list(range(len(ranks))) or len(ranks) != W:
        raise SourceError(label, f"per_pass dumps of ranks {ranks}: every rank 0..{W - 1} must have dumped "
                                 "(per_pass counts are per rank)")
    pmap = dumps[0].physical_to_logical_map
    for d in dumps[1:]:
        if not np.array_equal(d.physical_to_logical_map, pmap):
            raise SourceError(str(d.path), "last_physical_to_logical_map differs from rank 0's")
    L, P = pmap.shape
    E = int(pmap.max()) + 1
    slots = sum(d.physical_count.sum(axis=0) for d in dumps)
    expert = np.zeros((L, E), dtype=np.int64)
    np.add.at(expert, (np.arange(L)[:, None], pmap), slots)
    steps = len({pid for d in dumps for pid in d.pass_ids})
    end = max(d.time for d in dumps)
    return _window(label, model=model, ep_group=ep_group, world_size=W, num_layers=L, num_experts=E,
                   num_slots=P, top_k=min(top_k, E), steps=steps,
                   start_time=end if start_time is None else min(start_time, end), end_time=end,
                   physical_to_logical_map=pmap, expert_tokens=expert, slot_tokens=slots,
                   extra={"source": {"kind": "sglang-per-pass-dump", "not_in_dump": NOT_IN_DUMP,
                                     "files": [d.path.name for d in dumps]}})


def dump_sets(paths: Iterable[Path]) -> list[list[Path]]:
    """Group dump files into sets, oldest first: a stat dump alone; per_pass files of one request
    together (times within SET_GAP_SECONDS, no rank twice)."""
    stat, per_pass = [], []
    for p in paths:
        t, rank = dump_time_and_rank(p)
        if t is None:
            continue
        (stat if rank is None else per_pass).append((t, rank, p))
    sets: list[tuple[float, list[Path]]] = [(t, [p]) for t, _, p in stat]
    current: list[tuple[float, int, Path]] = []
    for t, rank, p in sorted(per_pass, key=lambda x: x[:2]):
        if current and (t - current[-1][0] > SET_GAP_SECONDS or rank in {r for _, r, _ in current}):
            sets.append((current[0][0], [q for *_, q in current]))
            current = []
        current.append((t, rank, p))
    if current:
        sets.append((current[0][0], [q for *_, q in current]))
    return [s for _, s in sorted(sets, key=lambda x: x[0])]


def window_from_paths(paths: list[Path], **identity: Any) -> Window:
    dumps = [read_dump(p) for p in paths]
    kinds = {d.kind for d in dumps}
    if kinds == {"stat"} and len(dumps) == 1:
        return stat_window(dumps[0], **identity)
    if kinds == {"per_pass"}:
        return per_pass_window(dumps, **identity)
    raise SourceError(str(paths[0].parent), f"cannot combine dumps of kinds {sorted(kinds)} in one window")


def load_source(source: str | Path, **identity: Any) -> Window:
    """`moewatch diagnose` on a dump: a stat dump file, or a folder (its newest dump set)."""
    path = Path(source)
    if path.is_dir():
        sets = dump_sets(sorted(path.iterdir()))
        if not sets:
            raise SourceError(str(path), "is a folder without SGLang dumps (expert_distribution_recorder_*.pt); "
                                         "expected a window file, a dump or a folder of dumps")
        return window_from_paths(sets[-1], **identity)
    dump = read_dump(path)
    if dump.kind == "per_pass":
        raise SourceError(str(path), "a per_pass dump holds one rank's counts: pass the folder holding every "
                                     "rank's dump")
    return stat_window(dump, **identity)


class DumpWatcher:
    """The agent's view of SGLang's dump folder: each new dump set becomes one Window, once.

    A per_pass set is taken when its newest file is `settle_seconds` old (the other ranks have had
    time to write theirs). A file that cannot be read is reported once through `on_error` and skipped.
    Windows follow one another: each starts where the previous dump ended."""

    def __init__(self, folder: str | Path, *, settle_seconds: float = 5.0, clock: Callable[[], float] = time.time,
                 on_error: Callable[[str], None] | None = None, **identity: Any):
        self.folder = Path(folder)
        self.settle_seconds = settle_seconds
        self.clock = clock
        self.on_error = on_error or (lambda message: None)
        self.identity = identity
        self._seen: set[str] = set()
        self._last_end: float | None = None
        self.windows = 0
        self.errors = 0

    def poll(self) -> list[Window]:
        try:
            names = [p for p in self.folder.iterdir() if p.name not in self._seen]
        except OSError as exc:
            self.errors += 1
            self.on_error(f"{self.folder}: {exc.strerror or exc}")
            return []
        out = []
        now = self.clock()
        for group in dump_sets(names):
            newest = max(_mtime(p) for p in group)
            if len(group) > 1 or dump_time_and_rank(group[0])[1] is not None:
                if now - newest < self.settle_seconds:
                    continue
            self._seen.update(p.name for p in group)
            try:
                window = window_from_paths(group, start_time=self._last_end, **self.identity)
            except SourceError as exc:
                self.errors += 1
                self.on_error(str(exc))
                continue
            self._last_end = window.end_time
            self.windows += 1
            out.append(window)
        return out


def _mtime(path: Path) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0
