"""Files the planner reads and writes.

Loads (pairs per logical expert):
- recorded windows: a folder of window files (what an engine adapter writes to MOEWATCH_WINDOW_DIR,
  shards included) or one window file (JSON `moewatch.window/v1` or the binary form); their
  `expert_tokens` [L, E] summed, and the engine's slot count P when every window has the same;
- `.npy`: [L, E], or [S, L, E] per step;
- `.json`: a bare [L][E] (or [S][L][E]) list, or an object whose `logical_count` holds one;
- `.pt`: SGLang's expert-distribution stat dump, an object with `logical_count` [S, L, E], read by
  moewatch.integrations.sglang.dump (torch.load(weights_only=True) where torch is installed; the
  core never needs torch else).
Routing traces for affinity:
- `.npy` / `.npz` / `.json`: a trace [T, L, k] of expert ids (key `trace`), or transition counts
  [L-1, E, E] (key `transitions`); a bare `.npy` is told apart by its shape.
Plans (both hold `physical_to_logical_map` [L][P], the contract):
- moewatch JSON: `Plan.to_dict()` (epoch, physical_to_logical_map, capacity_factor, reason, meta);
- SGLang `--init-expert-location` JSON: {"physical_to_logical_map": [[...]]}.
Every reader raises FileFormatError naming the file and the field at fault.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError
from ..plan import Plan, PlanError

PLAN_FORMATS = ("moewatch", "sglang")


class FileFormatError(InputError):
    """A file the planner cannot use; the message names the file and the field (`field` is the path)."""

    def __init__(self, path: str | Path, message: str):
        self.path = str(path)
        super().__init__(self.path, message)


@dataclass(frozen=True)
class LoadFile:
    load: np.ndarray  # [L, E] float64, summed over steps
    steps: np.ndarray | None  # [S, L, E] float64 when the file held per-step counts
    source: str  # "npy", "json", "sglang-pt", "windows"
    num_slots: int | None = None  # recorded windows: the engine's slot count P, when they all have one
    windows: int = 0  # recorded windows: how many were summed


def read_load(path: str | Path) -> LoadFile:
    """Read pairs per logical expert from recorded windows (a folder or one file), .npy, .json or
    SGLang's .pt stat dump."""
    path = Path(path)
    suffix = path.suffix.lower()
    if path.is_dir():
        return _read_window_folder(path)
    if not path.is_file():
        raise FileFormatError(path, "no such file")
    if _is_binary_window(path):
        return _load_of_windows([path])
    if suffix == ".npy":
        raw, source = _read_npy(path), "npy"
    elif suffix == ".json":
        data = _read_json(path)
        if isinstance(data, dict) and "schema" in data and "logical_count" not in data:
            return _load_of_windows([path])
        if isinstance(data, dict):
            if "logical_count" not in data:
                raise FileFormatError(path, "object has no `logical_count`")
            data = data["logical_count"]
        raw, source = data, "json"
    elif suffix == ".pt":
        raw, source = _read_sglang_pt(path), "sglang-pt"
    else:
        raise FileFormatError(path, f"unknown load file type {suffix!r} (use .npy, .json or SGLang's .pt)")
    counts = _count_array(path, "logical_count", raw)
    if counts.ndim == 2:
        return LoadFile(counts, None, source)
    if counts.ndim == 3:
        return LoadFile(counts.sum(axis=0), counts, source)
    raise FileFormatError(path, f"logical_count: expected [layers][experts] or [steps][layers][experts], "
                                f"got {counts.ndim} dimensions")


def _read_window_folder(folder: Path) -> LoadFile:
    files = window_files(folder)
    if not files:
        raise FileFormatError(folder, "no window files (*.json or binary windows) in this folder")
    return _load_of_windows(files)


def window_files(folder: Path) -> list[Path]:
    """Every window file in `folder` (JSON `*.json`, binary ones by their magic), in name order; the
    temporary files a writer renames into place are not windows yet."""
    return sorted(p for p in Path(folder).iterdir() if p.is_file() and not p.name.endswith(".tmp")
                  and is_window_file(p))


def is_window_file(path: Path) -> bool:
    """A JSON file or a binary window (by its magic); a JSON file's content decides when it is read."""
    return Path(path).suffix.lower() == ".json" or _is_binary_window(path)


def read_window(path: Path) -> Any:
    """One window file (JSON or binary), checked whole -> Window; FileFormatError naming the file."""
    from ..telemetry import Window, WindowError  # the planner reads windows only here

    path = Path(path)
    try:
        blob = path.read_bytes()
        return Window.from_bytes(blob) if blob[:4] == b"MWW1" else Window.from_json(blob)
    except OSError as exc:
        raise FileFormatError(path, f"cannot read ({exc.strerror or exc})") from None
    except WindowError as exc:
        raise FileFormatError(path, f"invalid window: {exc}") from None


def _is_binary_window(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == b"MWW1"
    except OSError as exc:
        raise FileFormatError(path, f"cannot read ({exc.strerror or exc})") from None


def _load_of_windows(paths: list[Path]) -> LoadFile:
    """Windows (each checked whole) -> their expert_tokens [L, E] summed; every window must have the
    first one's L and E, and carry expert_tokens (a window of per-rank totals says nothing per expert)."""
    total: np.ndarray | None = None
    slot_counts: set[int] = set()
    for path in paths:
        window = read_window(path)
        if window.expert_tokens is None:
            raise FileFormatError(path, "expert_tokens: absent (a window of per-rank totals has no load per expert)")
        counts = window.expert_tokens.astype(np.float64)
        if total is not None and counts.shape != total.shape:
            raise FileFormatError(path, f"expert_tokens: {list(counts.shape)} [layers, experts], the windows before "
                                        f"it have {list(total.shape)}")
        total = counts if total is None else total + counts
        slot_counts.add(int(window.num_slots))
    assert total is not None
    return LoadFile(total, None, "windows", slot_counts.pop() if len(slot_counts) == 1 else None, len(paths))


def _read_npy(path: Path) -> np.ndarray:
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise FileFormatError(path, f"not a readable .npy array ({exc})") from None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(), parse_constant=_reject_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FileFormatError(path, f"not valid JSON ({exc})") from None
    except ValueError as exc:
        raise FileFormatError(path, str(exc)) from None


def _reject_constant(name: str) -> float:
    raise ValueError(f"non-finite number {name} is not allowed")


def _read_sglang_pt(path: Path) -> np.ndarray:
    """[B, L, E] logical counts of SGLang's stat dump, through the SGLang room's one reader of its dumps."""
    from ..integrations.base import SourceError
    from ..integrations.sglang.dump import read_dump  # here: the SGLang room sits above the planner

    try:
        dump = read_dump(path)
    except SourceError as exc:
        raise FileFormatError(path, str(exc)[len(exc.field) + 2:]) from None  # the message without its path
    if dump.kind != "stat":
        raise FileFormatError(path, "a per_pass dump holds one rank's counts: the planner reads SGLang's stat dump "
                                    "(an object with `logical_count`)")
    return dump.logical_count


def _count_array(path: Path, field_name: str, raw: Any) -> np.ndarray:
    try:
        arr = np.asarray(raw)
    except ValueError:
        raise FileFormatError(path, f"{field_name}: ragged nested list") from None
    if arr.dtype == object or arr.dtype.kind not in "iuf":
        raise FileFormatError(path, f"{field_name}: entries must be numbers")
    if arr.ndim < 2 or 0 in arr.shape:
        raise FileFormatError(path, f"{field_name}: expected a non-empty matrix, got shape {list(arr.shape)}")
    arr = arr.astype(np.float64)
    if not np.all(np.isfinite(arr)):
        raise FileFormatError(path, f"{field_name}: counts must be finite")
    if np.any(arr < 0):
        raise FileFormatError(path, f"{field_name}: counts must be >= 0")
    return arr


# --- routing traces ---------------------------------------------------------------------------

def read_affinity(path: str | Path, num_layers: int, num_experts: int) -> tuple[str, np.ndarray]:
    """-> ("trace", [T, L, k] int64) or ("transitions", [L-1, E, E] float64), checked against the
    load's L and E."""
    path = Path(path)
    if not path.is_file():
        raise FileFormatError(path, "no such file")
    suffix = path.suffix.lower()
    if suffix == ".npz":
        try:
            archive = np.load(path, allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            raise FileFormatError(path, f"not a readable .npz archive ({exc})") from None
        with archive:
            keys = [k for k in ("trace", "transitions") if k in archive.files]
            if not keys:
                raise FileFormatError(path, "archive has neither `trace` nor `transitions`")
            kind, raw = keys[0], archive[keys[0]]
    elif suffix == ".json":
        data = _read_json(path)
        if not isinstance(data, dict) or not any(k in data for k in ("trace", "transitions")):
            raise FileFormatError(path, "expected an object with `trace` or `transitions`")
        kind = "trace" if "trace" in data else "transitions"
        raw = data[kind]
    elif suffix == ".npy":
        raw = _read_npy(path)
        shape = getattr(raw, "shape", ())
        if len(shape) == 3 and shape[0] == num_layers - 1 and shape[1] == shape[2] == num_experts:
            kind = "transitions"
        elif len(shape) == 3 and shape[1] == num_layers:
            kind = "trace"
        else:
            raise FileFormatError(path, f"shape {list(shape)} is neither a trace [tokens, {num_layers}, k] nor "
                                        f"transitions [{num_layers - 1}, {num_experts}, {num_experts}]")
    else:
        raise FileFormatError(path, f"unknown trace file type {suffix!r} (use .npy, .npz or .json)")
    if kind == "trace":
        return kind, _trace_array(path, raw, num_layers, num_experts)
    arr = _count_array(path, "transitions", raw)
    if arr.shape != (num_layers - 1, num_experts, num_experts):
        raise FileFormatError(path, f"transitions: shape {list(arr.shape)} does not match "
                                    f"[{num_layers - 1}, {num_experts}, {num_experts}] from the load")
    return kind, arr


def _trace_array(path: Path, raw: Any, num_layers: int, num_experts: int) -> np.ndarray:
    try:
        arr = np.asarray(raw)
    except ValueError:
        raise FileFormatError(path, "trace: ragged nested list") from None
    if arr.ndim != 3 or arr.shape[0] < 1 or arr.shape[2] < 1:
        raise FileFormatError(path, f"trace: expected [tokens][layers][k], got shape {list(arr.shape)}")
    if arr.shape[1] != num_layers:
        raise FileFormatError(path, f"trace: {arr.shape[1]} layers, the load has {num_layers}")
    if arr.dtype.kind == "f" and np.all(np.isfinite(arr)) and np.all(arr == np.round(arr)):
        arr = arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise FileFormatError(path, "trace: expert ids must be integers")
    arr = arr.astype(np.int64)
    if arr.min() < 0 or arr.max() >= num_experts:
        raise FileFormatError(path, f"trace: expert ids must be in [0, {num_experts})")
    return arr


# --- plans --------------------------------------------------------------------------------------

def plan_to_json(plan: Plan, fmt: str = "moewatch") -> str:
    """A plan as moewatch JSON (the whole Plan) or SGLang `--init-expert-location` JSON (the map)."""
    if fmt == "moewatch":
        return json.dumps(plan.to_dict(), allow_nan=False)
    if fmt == "sglang":
        return json.dumps({"physical_to_logical_map": plan.physical_to_logical_map.tolist()})
    raise ValueError(f"format: expected one of {PLAN_FORMATS}, got {fmt!r}")


def write_plan(path: str | Path, plan: Plan, fmt: str = "moewatch") -> None:
    """Write atomically (a temporary file renamed over the target)."""
    path = Path(path)
    text = plan_to_json(plan, fmt)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def read_plan(path: str | Path) -> Plan:
    """Read a moewatch plan JSON, or an SGLang `--init-expert-location` JSON (epoch 0, dropless)."""
    path = Path(path)
    if not path.is_file():
        raise FileFormatError(path, "no such file")
    if path.suffix.lower() != ".json":
        raise FileFormatError(path, f"plans are JSON files, got {path.suffix!r}")
    data = _read_json(path)
    if not isinstance(data, dict) or "physical_to_logical_map" not in data:
        raise FileFormatError(path, "expected an object with `physical_to_logical_map`")
    try:
        if "epoch" in data or "capacity_factor" in data:
            plan = Plan.from_dict(data)
        else:
            pmap = data["physical_to_logical_map"]
            layers = len(pmap) if isinstance(pmap, list) else 0
            plan = Plan(0, pmap, np.zeros(layers), reason="read from SGLang --init-expert-location JSON")
    except PlanError as exc:
        raise FileFormatError(path, str(exc)) from None
    if plan.physical_to_logical_map.min() < 0:
        layer, slot = map(int, np.argwhere(plan.physical_to_logical_map < 0)[0])
        raise FileFormatError(path, f"physical_to_logical_map: layer {layer} slot {slot}: expert id outside [0, E)")
    return plan
