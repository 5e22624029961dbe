"""Readers of NCCL Inspector output (NCCL's profiler plugin, `plugins/profiler/inspector/`, as of
NCCL 2.30.x; output format version v4.0).

JSON form (`NCCL_INSPECTOR_DUMP_DIR`, one `<host>-pid<pid>.log` per process): one JSON object per
line, `{"header": {...}, "metadata": {...}, "coll_perf": {...}}` or `... "p2p_perf": {...}`. The
header names the communicator (`id`, `comm_name`), the writer's `rank` in it and `n_ranks`; a
collective record has `coll`, `coll_sn` (the communicator's sequence number), `coll_msg_size_bytes`,
`coll_exec_time_us`, `coll_timing_source`, `coll_algobw_gbs`, `coll_busbw_gbs`.

Prometheus textfile form (`NCCL_INSPECTOR_PROM_DUMP=1`, one `nccl_inspector_metrics_<gpu uuid>.prom`
per GPU): gauges `nccl_collective_exec_time_microseconds` and `nccl_bus_bandwidth_gbs` (and the
`nccl_p2p_` pair) per bucket of (communicator, collective, message-size range, algorithm and
protocol); the value is the mean over the bucket's operations since the previous dump, and the
count is not written.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from prometheus_client.parser import text_string_to_metric_families

from ..base import SourceError

ALL_TO_ALL = "All2All"  # ncclFuncToString(ncclFuncAll2All)


@dataclass(frozen=True)
class CollectiveRecord:
    """One completed collective of one rank, as the JSON form writes it."""

    communicator: str  # header.id, the communicator's hash
    comm_name: str
    rank: int
    num_ranks: int
    op: str  # "All2All", "AllReduce", ...
    seq: int  # coll_sn
    message_bytes: int
    exec_seconds: float
    timing_source: str  # kernel_gpu, kernel_cpu, collective_cpu (unknown when not written)


@dataclass(frozen=True)
class InspectorLog:
    """What one or more JSON-lines files hold: the collective records, and how many p2p records were
    seen (not used for timing: a grouped send/recv is one record per peer, and those overlap)."""

    collectives: tuple[CollectiveRecord, ...]
    p2p_records: int


def _field(obj: dict, key: str, typ: type, where: str):
    value = obj.get(key)
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, typ) or isinstance(value, bool):
        raise SourceError(where, f"{key} must be {typ.__name__}, got {value!r}")
    return value


def parse_json_lines(lines: Iterable[str], where: str = "<inspector>") -> InspectorLog:
    """Parse the JSON form, line by line; blank lines are skipped. SourceError (naming `where` and
    the line) on a line that is not an Inspector record: a foreign file is refused whole."""
    records: list[CollectiveRecord] = []
    p2p = 0
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        at = f"{where}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise SourceError(at, f"not JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("header"), dict):
            raise SourceError(at, "not an NCCL Inspector record (no header)")
        if "p2p_perf" in obj:
            p2p += 1
            continue
        perf = obj.get("coll_perf")
        if not isinstance(perf, dict):
            raise SourceError(at, "not an NCCL Inspector record (neither coll_perf nor p2p_perf)")
        header = obj["header"]
        exec_us = _field(perf, "coll_exec_time_us", float, at)
        if not math.isfinite(exec_us) or exec_us < 0:
            raise SourceError(at, f"coll_exec_time_us must be finite and >= 0, got {exec_us!r}")
        records.append(CollectiveRecord(
            communicator=_field(header, "id", str, at), comm_name=str(header.get("comm_name", "unknown")),
            rank=_field(header, "rank", int, at), num_ranks=_field(header, "n_ranks", int, at),
            op=_field(perf, "coll", str, at), seq=_field(perf, "coll_sn", int, at),
            message_bytes=_field(perf, "coll_msg_size_bytes", int, at), exec_seconds=exec_us * 1e-6,
            timing_source=str(perf.get("coll_timing_source", "unknown"))))
    return InspectorLog(tuple(records), p2p)


def read_dump_dir(path: str | Path) -> InspectorLog:
    """Every `*.log` file of an `NCCL_INSPECTOR_DUMP_DIR`, one log (the files of all ranks)."""
    folder = Path(path)
    files = sorted(folder.glob("*.log"))
    if not files:
        raise SourceError(str(folder), "no NCCL Inspector *.log files")
    collectives: list[CollectiveRecord] = []
    p2p = 0
    for file in files:
        log = parse_json_lines(file.read_text().splitlines(), where=str(file))
        collectives.extend(log.collectives)
        p2p += log.p2p_records
    return InspectorLog(tuple(collectives), p2p)


@dataclass(frozen=True)
class CollectiveMean:
    """One bucket of the textfile form: the mean time of one kind of collective on one GPU."""

    comm_name: str
    gpu: str
    op: str
    message_size: str  # the range label, e.g. "8-9MB"
    mean_exec_seconds: float


def prom_collective_means(text: str, where: str = "<inspector prom>") -> list[CollectiveMean]:
    """The `nccl_collective_exec_time_microseconds` buckets of a textfile, in seconds. SourceError
    naming `where` on text that is not a Prometheus exposition."""
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as e:
        raise SourceError(where, f"not a Prometheus exposition ({e})") from None
    out = []
    for family in families:
        for s in family.samples:
            if s.name != "nccl_collective_exec_time_microseconds":
                continue
            out.append(CollectiveMean(s.labels.get("comm_name", "unknown"), s.labels.get("gpu", "unknown"),
                                      s.labels.get("collective", "unknown"), s.labels.get("message_size", ""),
                                      float(s.value) * 1e-6))
    return out
