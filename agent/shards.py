"""The step between the receiver and the store for sharded EP groups: the shards of one window sequence
are held until all are in or their deadline passes, then merged into one whole window
(moewatch/shards.py) that goes on to the store like any runtime's window. Unsharded windows never
come here.

`ShardMerger` decides (pure state, a clock passed in): which sequences to emit and in what order,
what was missing, refused or late, which engine rebalance calls disagree across shards.
`ShardStep` acts on its decisions: delivers merged windows, counts (agent/metrics/shards.py), audits
digest mismatches and logs once per reason and interval. Windows leave in sequence order: a
complete sequence waits behind an older incomplete one until that one's deadline.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from moewatch import shards as shard_merge
from moewatch.telemetry import Window, WindowError

from .audit import AuditLog
from .config import LimitsSettings
from .metrics import shards as metrics
from .metrics.state import MetricsState
from .throttle import Throttle

log = logging.getLogger("moewatch.agent.shards")

GroupKey = tuple[str, str]
# Engine rebalance calls remembered per group to compare digests across shards (a call's records
# may land in neighbouring sequences on different ranks).
CALLS_REMEMBERED = 256


@dataclass
class Mismatch:
    """An engine rebalance call whose digests differ across shards: {shard index: digest}."""

    key: GroupKey
    call: int
    sequence: int
    digests: dict[int, str]
    ranks: dict[int, int]


@dataclass
class Emitted:
    """One sequence merged (or, with `error`, not mergeable): what it had and lacked."""

    key: GroupKey
    sequence: int
    count: int
    window: Window | None
    received: list[int]
    missing: list[int]
    refused: list[tuple[int, str]]
    error: str | None = None
    mismatches: list[Mismatch] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return self.window is not None and not self.missing and not self.refused


@dataclass
class Offered:
    """What became of one shard: `refused` (late_shard, duplicate_shard) or None (held), the digest
    mismatches a refused one revealed, and the sequences it let go."""

    refused: str | None = None
    mismatches: list[Mismatch] = field(default_factory=list)
    emitted: list[Emitted] = field(default_factory=list)


@dataclass
class _Sequence:
    deadline: float
    shards: dict[int, Window] = field(default_factory=dict)

    def complete(self) -> bool:
        """Every index of some count is in (a disagreeing count is refused at the merge)."""
        counts = collections.Counter(w.shard.count for w in self.shards.values())
        return any(len({i for i, w in self.shards.items() if w.shard.count == n}) == n for n in counts)


@dataclass
class _Group:
    pending: dict[int, _Sequence] = field(default_factory=dict)
    emitted_through: int | None = None  # the highest sequence let go: a shard at or below it is late
    calls: collections.OrderedDict = field(default_factory=collections.OrderedDict)  # call -> {index: digest}
    ranks: dict[int, int] = field(default_factory=dict)  # shard index -> its rank, as last seen
    reported_calls: set = field(default_factory=set)
    delivered_calls: collections.OrderedDict = field(default_factory=collections.OrderedDict)  # call -> None
    windows: dict[str, int] = field(default_factory=lambda: {o: 0 for o in metrics.OUTCOMES})
    missing: int = 0
    refused: collections.Counter = field(default_factory=collections.Counter)
    last: dict[str, Any] | None = None


class ShardMerger:
    """Holds each sharded group's pending sequences. Not thread-safe: ShardStep serialises calls."""

    def __init__(self, limits: LimitsSettings):
        self.limits = limits
        self._groups: dict[GroupKey, _Group] = {}

    def offer(self, window: Window, now: float) -> Offered:
        """Take one shard (a window with extra.shard)."""
        shard = window.shard
        key = (window.model, window.ep_group)
        group = self._groups.setdefault(key, _Group())
        out = Offered()
        self._remember_digests(group, window)
        held = group.pending.get(shard.sequence)
        if held is None and group.emitted_through is not None and shard.sequence <= group.emitted_through:
            out.refused = metrics.LATE_SHARD
        elif held is not None and shard.index in held.shards:
            out.refused = metrics.DUPLICATE_SHARD
        else:
            if held is None:
                wait = self.limits.shard_deadline_seconds(window.end_time - window.start_time)
                held = group.pending[shard.sequence] = _Sequence(deadline=now + wait)
            held.shards[shard.index] = window
        if out.refused is not None:
            group.refused[out.refused] += 1
            # Its sequence has left (or holds its twin): compare what it says now.
            out.mismatches = self._mismatches(key, group, [window], shard.sequence)
        out.emitted = self._drain(key, group, now)
        return out

    def due(self, now: float) -> list[Emitted]:
        """Sequences whose time has come (deadline passed), every group."""
        return [e for key, group in list(self._groups.items()) for e in self._drain(key, group, now)]

    def pending(self, key: GroupKey) -> int:
        group = self._groups.get(key)
        return 0 if group is None else len(group.pending)

    def forget(self, key: GroupKey) -> None:
        """A new lineage or a forgotten group: what was held belonged to processes that are gone."""
        self._groups.pop(key, None)

    def status(self, key: GroupKey) -> dict[str, Any] | None:
        group = self._groups.get(key)
        if group is None:
            return None
        return {"pending_sequences": sorted(group.pending), "emitted_through": group.emitted_through,
                "windows": dict(group.windows), "shards_missing": group.missing,
                "shards_refused": dict(group.refused), "latest": group.last}

    # --- inside -----------------------------------------------------------------------------------
    def _drain(self, key: GroupKey, group: _Group, now: float) -> list[Emitted]:
        out = []
        while group.pending:
            sequence = min(group.pending)
            held = group.pending[sequence]
            over = len(group.pending) > self.limits.max_shard_sequences
            if not (held.complete() or held.deadline <= now or over):
                break
            del group.pending[sequence]
            group.emitted_through = sequence
            out.append(self._emit(key, group, sequence, held))
        return out

    def _emit(self, key: GroupKey, group: _Group, sequence: int, held: _Sequence) -> Emitted:
        shards = sorted(held.shards.values(), key=lambda w: w.shard.index)
        try:
            merged, refused = shard_merge.merge_sequence(shards)
            window, error = self._calls_once(group, merged), None
            report = merged.shards_report
            count, received, missing = report.count, list(report.received), list(report.missing)
            refused_items = [(w.shard.index, reason) for w, reason in refused]
        except (WindowError, ValueError) as exc:  # a shard that lied about its counts: the sequence is lost
            window, error = None, str(exc)
            count, received, missing = shards[0].shard.count, [], []
            refused_items = [(w.shard.index, metrics.INVALID_MERGE) for w in shards]
        emitted = Emitted(key, sequence, count, window, received, missing, refused_items, error,
                          self._mismatches(key, group, shards, sequence))
        group.windows["complete" if emitted.complete else "partial"] += window is not None
        group.missing += len(missing)
        group.refused.update(reason for _, reason in refused_items)
        group.last = {"sequence": sequence, "count": count, "received": received, "missing": missing,
                      "refused": [{"index": i, "reason": r} for i, r in refused_items]}
        return emitted

    @staticmethod
    def _calls_once(group: _Group, window: Window) -> Window:
        """The merged window without the rebalance records of calls an earlier merged window carried
        (ranks may record one call in neighbouring sequences): the agent counts each call once."""
        records = window.extra.get(shard_merge.REBALANCE_KEY)
        if not isinstance(records, list):
            return window
        kept = []
        for record in records:
            call = record.get("call") if isinstance(record, dict) else None
            if isinstance(call, int) and not isinstance(call, bool):
                if call in group.delivered_calls:
                    continue
                group.delivered_calls[call] = None
                if len(group.delivered_calls) > CALLS_REMEMBERED:
                    group.delivered_calls.popitem(last=False)
            kept.append(record)
        if len(kept) == len(records):
            return window
        return window.replace(extra={**window.extra, shard_merge.REBALANCE_KEY: kept})

    def _remember_digests(self, group: _Group, window: Window) -> None:
        """Each shard's digest of each rebalance call it recorded (the oldest calls forgotten)."""
        shard = window.shard
        group.ranks[shard.index] = shard.rank
        for call, digest in shard_merge.rebalance_digests(window).items():
            group.calls.setdefault(call, {}).setdefault(shard.index, digest)
            group.calls.move_to_end(call)
        while len(group.calls) > CALLS_REMEMBERED:
            old, _ = group.calls.popitem(last=False)
            group.reported_calls.discard(old)

    def _mismatches(self, key: GroupKey, group: _Group, windows: list[Window], sequence: int) -> list[Mismatch]:
        """The calls these windows recorded whose digests differ across the shards that recorded them
        (in this sequence or a neighbouring one), each reported once."""
        out = []
        calls = sorted({call for w in windows for call in shard_merge.rebalance_digests(w)})
        for call in calls:
            seen = group.calls.get(call, {})
            if len(set(seen.values())) > 1 and call not in group.reported_calls:
                group.reported_calls.add(call)
                out.append(Mismatch(key, call, sequence, dict(seen), {i: group.ranks.get(i, -1) for i in seen}))
        return out


class ShardStep:
    """Acts on the merger's decisions: each merged window to `deliver` (which returns a rejection
    reason or None), counters, the audit line of a digest mismatch, throttled log lines."""

    def __init__(self, limits: LimitsSettings, state: MetricsState, audit: Callable[[], AuditLog | None],
                 deliver: Callable[[Window], str | None], log_interval: float,
                 clock: Callable[[], float] = time.monotonic):
        self.merger = ShardMerger(limits)
        self.state = state
        self.audit = audit
        self.deliver = deliver
        self.clock = clock
        self._throttle = Throttle(log_interval, clock)
        # One lock for deciding and delivering: merged windows reach the store in sequence order
        # whichever thread (a reader, the triage job) lets them go.
        self._lock = threading.Lock()

    def on_hello(self, key: GroupKey) -> None:
        metrics.init_group(self.state, key)

    def offer(self, window: Window) -> None:
        """A shard from a runtime; what becomes of it is counted, never returned as a frame rejection."""
        with self._lock:
            offered = self.merger.offer(window, self.clock())
            key = (window.model, window.ep_group)
            if offered.refused is not None:
                self._refused(key, offered.refused, f"shard {window.shard.index} of sequence {window.shard.sequence}")
            for mismatch in offered.mismatches:
                self._mismatch(mismatch)
            self._apply(offered.emitted)
            self.state[metrics.SHARD_SEQUENCES_PENDING].set(key, self.merger.pending(key))

    def flush_due(self) -> None:
        """Merge the sequences whose deadline passed (the triage job calls this first)."""
        with self._lock:
            emitted = self.merger.due(self.clock())
            self._apply(emitted)
            for key in {e.key for e in emitted}:
                self.state[metrics.SHARD_SEQUENCES_PENDING].set(key, self.merger.pending(key))

    def forget(self, key: GroupKey) -> None:
        with self._lock:
            self.merger.forget(key)
            self.state[metrics.SHARD_SEQUENCES_PENDING].set(key, 0)

    def status(self, key: GroupKey) -> dict[str, Any] | None:
        with self._lock:
            return self.merger.status(key)

    # --- acting -----------------------------------------------------------------------------------
    def _apply(self, emitted: list[Emitted]) -> None:
        for e in emitted:
            for mismatch in e.mismatches:
                self._mismatch(mismatch)
            for index, reason in e.refused:
                self._refused(e.key, reason, f"shard {index} of sequence {e.sequence}"
                                             + (f": {e.error}" if e.error else ""))
            if e.missing:
                self.state[metrics.SHARDS_MISSING_TOTAL].inc(e.key, len(e.missing))
                self._log("missing", e.key, "%s/%s: window sequence %d merged at its deadline without shards %s "
                          "of %d", *e.key, e.sequence, e.missing, e.count)
            if e.window is None:
                continue
            self.state[metrics.SHARD_WINDOWS_TOTAL].inc((*e.key, "complete" if e.complete else "partial"))
            reason = self.deliver(e.window)
            if reason is not None:
                self._log(f"deliver:{reason}", e.key, "%s/%s: merged window of sequence %d rejected (%s)", *e.key,
                          e.sequence, reason)

    def _refused(self, key: GroupKey, reason: str, what: str) -> None:
        self.state[metrics.SHARDS_REFUSED_TOTAL].inc((*key, reason))
        self._log(f"refused:{reason}", key, "%s/%s: %s refused (%s)", *key, what, reason)

    def _mismatch(self, m: Mismatch) -> None:
        self.state[metrics.DIGEST_MISMATCHES_TOTAL].inc(m.key)
        self._log("digest", m.key, "%s/%s: engine rebalance call %d has different digests across shards %s (ranks "
                  "%s): ranks may hold different expert maps", *m.key, m.call, m.digests, m.ranks)
        audit = self.audit()
        if audit is not None:
            audit.record("engine_rebalance_digest_mismatch", model=m.key[0], ep_group=m.key[1], call=m.call,
                         sequence=m.sequence, digests={str(i): d for i, d in sorted(m.digests.items())},
                         ranks={str(i): r for i, r in sorted(m.ranks.items())})

    def _log(self, reason: str, key: GroupKey, message: str, *args: Any) -> None:
        held = self._throttle(f"{reason}:{key}")
        if held is not None:
            log.warning(message + (f" ({held} more since the last line)" if held else ""), *args)
