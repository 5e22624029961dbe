"""NCCL Inspector records -> all-to-all time in a Window, with its provenance.

Matching to layers (docs/telemetry.md, "All-to-all time from NCCL"): an MoE layer under expert
parallelism issues one all-to-all to dispatch and one to combine, in layer order, every step. So the
records of one rank are matched to (step, layer, phase) by position, and only when position is
certain:
- the records given are those of the window (the caller cuts them at the window's bounds);
- the rank's collective records on the communicator have consecutive sequence numbers (`coll_sn`
  counts every collective of the communicator: a gap is a record the Inspector dropped, by its
  8 KiB floor, its ring or its CPU-timing filter, and then no position after it is certain);
- its `All2All` records number exactly 2 x layers x steps;
- every rank of the group has such records.
Record i of a rank is then step i // 2L, layer (i mod 2L) // 2, dispatch when i is even, else
combine. Otherwise the window gets only the per-step total, `extra.a2a_step_seconds`: all-to-all
seconds summed over the window's records, the mean over the ranks that have records.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ...telemetry import STEP_A2A_KEY, Window
from ..base import SourceError
from .inspector import ALL_TO_ALL, CollectiveMean, CollectiveRecord

PER_LAYER, PER_STEP = "per-layer", "per-step"
PROVENANCE_KEY = "a2a_time"  # Window.extra["source"][...]: where the all-to-all time came from


@dataclass(frozen=True)
class AllToAllTime:
    """All-to-all time of one window. dispatch/combine_seconds: [L, W] summed over the window's
    steps, only when matched per layer; step_total_seconds: the window's all-to-all seconds, the
    mean over `ranks`."""

    matched: str  # PER_LAYER or PER_STEP
    step_total_seconds: float
    ranks: list[int]
    provenance: dict[str, Any]
    dispatch_seconds: np.ndarray | None = None
    combine_seconds: np.ndarray | None = None
    reasons: list[str] = field(default_factory=list)  # why the match is per step only


def pick_communicator(records: Sequence[CollectiveRecord], world_size: int, communicator: str | None = None
                      ) -> list[CollectiveRecord]:
    """The records of the EP group's communicator: the one named (`id` or `comm_name`), else the one
    communicator of `world_size` ranks that ran all-to-alls. SourceError when that is not one."""
    if communicator is not None:
        chosen = [r for r in records if communicator in (r.communicator, r.comm_name)]
        if not chosen:
            raise SourceError("communicator", f"no NCCL Inspector records of communicator {communicator!r}")
        return chosen
    ids = sorted({r.communicator for r in records if r.op == ALL_TO_ALL and r.num_ranks == world_size})
    if len(ids) != 1:
        found = "none" if not ids else ", ".join(ids)
        raise SourceError("communicator", f"need one communicator of {world_size} ranks with all-to-alls, "
                                          f"found {found}: name it")
    return [r for r in records if r.communicator == ids[0]]


def match_records(records: Sequence[CollectiveRecord], num_layers: int, world_size: int, steps: int,
                  communicator: str | None = None) -> AllToAllTime:
    """A window's records (every rank's, one communicator picked by `pick_communicator`) -> its
    all-to-all time, per layer where the order makes it certain (module docstring), else per step."""
    chosen = pick_communicator(records, world_size, communicator)
    by_rank: dict[int, list[CollectiveRecord]] = defaultdict(list)
    for r in chosen:
        by_rank[r.rank].append(r)
    expected = 2 * num_layers * steps
    reasons: list[str] = []
    totals = {}
    timings: dict[int, np.ndarray] = {}
    for rank in sorted(by_rank):
        ops = sorted(by_rank[rank], key=lambda r: r.seq)
        seqs = [r.seq for r in ops]
        a2a = np.array([r.exec_seconds for r in ops if r.op == ALL_TO_ALL], dtype=np.float64)
        totals[rank] = float(a2a.sum())
        if len(set(seqs)) != len(seqs) or seqs[-1] - seqs[0] + 1 != len(seqs):
            reasons.append(f"rank {rank}: sequence numbers have gaps (records dropped)")
        elif a2a.size != expected:
            reasons.append(f"rank {rank}: {a2a.size} all-to-alls, not 2 x {num_layers} layers x {steps} steps")
        else:
            timings[rank] = a2a
    missing = [r for r in range(world_size) if r not in by_rank]
    if missing:
        reasons.append(f"ranks without records: {missing}")
    ranks = sorted(totals)
    provenance = {"kind": "nccl-inspector", "communicator": chosen[0].communicator,
                  "comm_name": chosen[0].comm_name, "records": len(chosen), "ranks": ranks,
                  "timing_sources": sorted({r.timing_source for r in chosen})}
    total = float(np.mean([totals[r] for r in ranks]))
    if reasons:
        return AllToAllTime(PER_STEP, total, ranks, {**provenance, "matched": PER_STEP, "why": reasons},
                            reasons=reasons)
    # [W, S, L, 2] -> summed over steps: [L, W] per phase
    per = np.stack([timings[r] for r in range(world_size)]).reshape(world_size, steps, num_layers, 2).sum(axis=1)
    return AllToAllTime(PER_LAYER, total, ranks, {**provenance, "matched": PER_LAYER},
                        dispatch_seconds=per[:, :, 0].T.copy(), combine_seconds=per[:, :, 1].T.copy())


def from_prom_means(means: Sequence[CollectiveMean], calls_per_step: int, steps: int,
                    comm_name: str | None = None) -> AllToAllTime:
    """The textfile form's all-to-all means -> a per-step total. The form writes a mean per bucket and
    no count, so the total rests on `calls_per_step`, the all-to-alls one step issues (2 per MoE
    layer when dispatch and combine are NCCL all-to-alls): the window's total is the mean over
    buckets and GPUs x calls_per_step x steps. Never per layer."""
    chosen = [m for m in means if m.op == ALL_TO_ALL and (comm_name is None or m.comm_name == comm_name)]
    if not chosen:
        raise SourceError("nccl_collective_exec_time_microseconds", "no All2All buckets"
                          + ("" if comm_name is None else f" for communicator {comm_name!r}"))
    if calls_per_step <= 0:
        raise SourceError("calls_per_step", f"must be > 0, got {calls_per_step}")
    gpus = sorted({m.gpu for m in chosen})
    mean = float(np.mean([m.mean_exec_seconds for m in chosen]))
    provenance = {"kind": "nccl-inspector-prom", "matched": PER_STEP, "gpus": gpus,
                  "comm_names": sorted({m.comm_name for m in chosen}), "calls_per_step": calls_per_step,
                  "basis": "mean all-to-all time x calls_per_step x steps (the textfile form has no counts)"}
    return AllToAllTime(PER_STEP, mean * calls_per_step * steps, [], provenance,
                        reasons=["the textfile form keeps means, not the order of operations"])


def attach(w: Window, a2a: AllToAllTime) -> Window:
    """The window with the all-to-all time: `dispatch_seconds` and `combine_seconds` when matched per
    layer; always `extra.a2a_step_seconds` and the provenance under `extra.source.a2a_time`."""
    extra = dict(w.extra)
    source = dict(extra.get("source") or {})
    source[PROVENANCE_KEY] = a2a.provenance
    extra["source"] = source
    extra[STEP_A2A_KEY] = a2a.step_total_seconds
    changes: dict[str, Any] = {"extra": extra}
    if a2a.matched == PER_LAYER:
        changes.update(dispatch_seconds=a2a.dispatch_seconds, combine_seconds=a2a.combine_seconds)
    return w.replace(**changes)
