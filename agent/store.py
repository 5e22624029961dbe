"""What the agent remembers per EP group: identity, a bounded rolling history of triaged windows,
the epoch fence, and the windows waiting for the triage job.

One `GroupStore` per (model, ep_group). `accept_window` is the gate every window passes before it
counts: it must follow a hello, match the hello's sizes, end after the previous window, and carry an
epoch no older than the one in force. A window that fails is rejected whole with a reason (the
frames_rejected_total label); nothing of it is kept.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from moewatch.telemetry import Window
from moewatch.triage import WindowDiagnosis
from moewatch.wire import Hello

from .metrics.windows import GroupExportMemory

GroupKey = tuple[str, str]


@dataclass(frozen=True)
class TriagedWindow:
    window: Window
    diagnosis: WindowDiagnosis
    received_at: float


@dataclass
class GroupStore:
    key: GroupKey
    history_windows: int
    # Memory bound: the window arrays of the history and the backlog together stay under this
    # (beyond one triaged window and one waiting).
    history_bytes: int = 64 * 1024 * 1024
    hello: Hello | None = None
    connection_id: int | None = None
    connected: bool = False
    history: deque = field(init=False)
    untriaged: deque = field(init=False)
    last_end_time: float = float("-inf")
    epoch_in_force: int = 0
    max_epoch_seen: int = 0
    windows_accepted: int = 0
    runtime_frames_dropped: int = 0  # the runtime's own cumulative count, as last reported
    # windows its engine processes lost, as each (pid) last reported them: {pid: {reason: count}}
    runtime_windows_lost: dict = field(default_factory=dict)
    lineage: int = 0  # bumped when a different runtime process takes the group over (a restart)
    left_at: float | None = None  # when the last runtime disconnected (for retirement)
    # A sharded group (hellos with shard_count > 1, one process per shard): each shard index's current
    # connection and hello; the group is connected while any of them is.
    shard_connections: dict = field(default_factory=dict)
    shard_hellos: dict = field(default_factory=dict)
    shard_frames_dropped: dict = field(default_factory=dict)  # shard index -> its process's own count
    last_heartbeat: float | None = None
    last_window_received: float | None = None
    history_nbytes: int = 0
    untriaged_nbytes: int = 0
    export: GroupExportMemory = field(default_factory=GroupExportMemory)
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    def __post_init__(self) -> None:
        # Bounded by count and by bytes (add_triaged drops the oldest).
        self.history = deque()
        # Bounded too: while the triage job is this far behind, new windows are refused ("backlog").
        self.untriaged = deque()
        # The lineage each accepted window was sent in, until the triage adds it (stamped at accept,
        # so a window taken for triage before a restart's hello and added after it is still the old
        # runtime's; an entry left by a failed triage is overwritten when its id is reused).
        self._sent_in: dict[int, int] = {}

    # --- connection lifecycle -----------------------------------------------------------------
    def is_new_lineage(self, hello: Hello) -> bool:
        """A hello from another runtime process than the last one: a lower epoch than the one in
        force (a restarted runtime counts from 0 again), or another runtime name or pid."""
        with self.lock:
            old = self.hello
            if old is None:
                return False
            if hello.sharded or old.sharded:
                # Shards are several processes: a restart is a shard index's process changing (another
                # pid or runtime), or the layout changing (shard count); a shard's hello epoch may lag
                # the merged windows' and says nothing of a restart.
                if hello.shard_count != old.shard_count:
                    return True
                mine = self.shard_hellos.get(hello.shard_index)
                return mine is not None and (hello.runtime != mine.runtime
                                             or (hello.pid != mine.pid and bool(hello.pid) and bool(mine.pid)))
            return (hello.epoch < self.epoch_in_force or hello.runtime != old.runtime
                    or (hello.pid != old.pid and bool(hello.pid) and bool(old.pid)))

    def on_hello(self, hello: Hello, connection_id: int) -> bool:
        """Returns True when the hello starts a new lineage: the windows kept so far (and those still
        waiting for triage) are the old runtime's and never count for the new one."""
        with self.lock:
            new_lineage = self.is_new_lineage(hello)
            if new_lineage:
                self.lineage += 1
                self.history.clear()
                self.history_nbytes = 0
                # The count is per runtime process: a reconnect of the same one continues it.
                self.runtime_frames_dropped = 0
            if new_lineage or not hello.sharded:
                self.shard_connections.clear()
                self.shard_hellos.clear()
                self.shard_frames_dropped.clear()
            if hello.sharded:
                self.shard_connections[hello.shard_index] = connection_id
                self.shard_hellos[hello.shard_index] = hello
            self.hello = hello
            self.connection_id = connection_id
            self.connected = True
            # A restarted runtime starts its epochs again; the fence follows what it runs now,
            # while max_epoch_seen keeps growing so the next plan is still newer than any sent.
            self.epoch_in_force = hello.epoch
            self.max_epoch_seen = max(self.max_epoch_seen, hello.epoch)
            self.last_end_time = float("-inf")
            self.left_at = None
            return new_lineage

    def on_disconnect(self, connection_id: int) -> bool:
        """Mark the group disconnected if this connection is still its current one."""
        with self.lock:
            if self.shard_connections:
                index = next((i for i, c in self.shard_connections.items() if c == connection_id), None)
                if index is None:
                    return False
                del self.shard_connections[index]
                if self.shard_connections:
                    return False  # other shards' processes are still connected
            elif self.connection_id != connection_id:
                return False
            self.connected = False
            self.left_at = time.time()
            return True

    def note_heartbeat(self, frames_dropped: int, shard_index: int | None = None, now: float | None = None) -> int:
        """A heartbeat's cumulative count of frames its process dropped -> how much it grew since that
        process's last one. Kept per shard index in a sharded group: its processes count on their own."""
        with self.lock:
            self.last_heartbeat = time.time() if now is None else now
            if shard_index is None:
                previous, self.runtime_frames_dropped = self.runtime_frames_dropped, frames_dropped
            else:
                previous = self.shard_frames_dropped.get(shard_index, 0)
                self.shard_frames_dropped[shard_index] = frames_dropped
        return frames_dropped - previous if frames_dropped >= previous else frames_dropped

    def is_current(self, connection_id: int, hello: Hello | None) -> bool:
        """Whether a connection still speaks for the group (or, sharded, for its shard index): not
        replaced by a newer hello."""
        with self.lock:
            if hello is not None and hello.sharded:
                return self.shard_connections.get(hello.shard_index) == connection_id
            return self.connection_id == connection_id

    # --- windows ------------------------------------------------------------------------------
    def check_window(self, w: Window) -> str | None:
        """None when the window may be accepted, else the rejection reason."""
        hello = self.hello
        if hello is None:
            return "out_of_order"
        sizes = {"world_size": w.world_size, "num_layers": w.num_layers, "num_experts": w.num_experts,
                 "num_slots": w.num_slots}
        if any(getattr(hello, k) != v for k, v in sizes.items()):
            return "mismatch"
        if w.end_time <= self.last_end_time:
            return "out_of_order"
        if w.epoch < self.epoch_in_force:
            return "stale_epoch"
        return None

    def accept_window(self, w: Window, now: float | None = None) -> str | None:
        with self.lock:
            reason = self.check_window(w)
            if reason is not None:
                return reason
            if len(self.untriaged) >= self.history_windows or (
                    self.untriaged and self.untriaged_nbytes + w.nbytes > self.history_bytes):
                return "backlog"
            # One budget for the group: the oldest history makes room for new windows.
            self._trim(self.untriaged_nbytes + w.nbytes)
            self.last_end_time = w.end_time
            self.epoch_in_force = w.epoch
            self.max_epoch_seen = max(self.max_epoch_seen, w.epoch)
            self.untriaged.append(w)
            self._sent_in[id(w)] = self.lineage
            self.untriaged_nbytes += w.nbytes
            self.windows_accepted += 1
            self.last_window_received = time.time() if now is None else now
            return None

    def take_untriaged(self) -> list[Window]:
        with self.lock:
            out = list(self.untriaged)
            self.untriaged.clear()
            self.untriaged_nbytes = 0
            return out

    def add_triaged(self, item: TriagedWindow) -> bool:
        """Append to the history, then drop the oldest windows past history_windows or history_bytes.
        False (not kept) when the window belongs to a lineage that has ended."""
        with self.lock:
            if self._sent_in.pop(id(item.window), self.lineage) != self.lineage:
                return False
            self.history.append(item)
            self.history_nbytes += item.window.nbytes
            self._trim(self.untriaged_nbytes)
            return True

    def _trim(self, pending: int) -> None:
        """Drop the oldest history until it fits history_windows and, with `pending` bytes of
        backlog, history_bytes (the newest triaged window always stays)."""
        while len(self.history) > 1 and (len(self.history) > self.history_windows
                                         or self.history_nbytes + pending > self.history_bytes):
            self.history_nbytes -= self.history.popleft().window.nbytes

    def recent(self, epoch: int | None = None) -> list[TriagedWindow]:
        """History oldest first, optionally only the windows of one epoch."""
        with self.lock:
            items = list(self.history)
        return items if epoch is None else [t for t in items if t.window.epoch == epoch]

    def latest(self) -> TriagedWindow | None:
        with self.lock:
            return self.history[-1] if self.history else None

    def note_epoch(self, epoch: int) -> None:
        with self.lock:
            self.max_epoch_seen = max(self.max_epoch_seen, epoch)

    def next_epoch(self) -> int:
        """A plan's epoch: one past every epoch seen (hello, windows, acks, plans sent)."""
        with self.lock:
            self.max_epoch_seen += 1
            return self.max_epoch_seen

    def status(self) -> dict[str, Any]:
        with self.lock:
            latest = self.history[-1] if self.history else None
            hello = self.hello
            return {
                "model": self.key[0], "ep_group": self.key[1], "connected": self.connected,
                "runtime": hello.runtime if hello else None,
                "sizes": None if hello is None else {"world_size": hello.world_size, "num_layers": hello.num_layers,
                                                     "num_experts": hello.num_experts, "num_slots": hello.num_slots},
                "epoch_in_force": self.epoch_in_force, "max_epoch_seen": self.max_epoch_seen,
                "windows_accepted": self.windows_accepted, "history": len(self.history),
                "history_bytes": self.history_nbytes,
                "last_window_end": None if latest is None else latest.window.end_time,
                "layers": [] if latest is None else [
                    {"layer": d.layer, "verdict": d.verdict, "cause": d.cause, "overflow": d.overflow,
                     "balancedness": d.metrics["balancedness"], "a2a_share": d.metrics["a2a_share"],
                     "rank_load_max_mean": d.metrics["rank_load_max_mean"],
                     "layer_seconds_per_step": d.metrics["layer_seconds_per_step"],
                     "hot_experts": d.metrics["hot_experts"],
                     "first_action": d.actions[0].kind if d.actions else None}
                    for d in latest.diagnosis.layers],
                "summary": None if latest is None else latest.diagnosis.summary,
            }


class Store:
    """Every group the agent has heard from, bounded by max_groups (the daemon makes room for a live
    runtime by evicting `longest_disconnected`)."""

    def __init__(self, history_windows: int, max_groups: int, history_bytes: int = 64 * 1024 * 1024):
        self.history_windows = history_windows
        self.history_bytes = history_bytes
        self.max_groups = max_groups
        self._groups: dict[GroupKey, GroupStore] = {}
        self._lock = threading.Lock()

    def get_or_create(self, key: GroupKey) -> GroupStore | None:
        """None when the group is new and the store is full."""
        with self._lock:
            group = self._groups.get(key)
            if group is None:
                if len(self._groups) >= self.max_groups:
                    return None
                group = self._groups[key] = GroupStore(key, self.history_windows, self.history_bytes)
            return group

    def longest_disconnected(self) -> GroupStore | None:
        """The group whose runtime left first (the one to make room with when the store is full), or
        None when every group has a runtime connected."""
        with self._lock:
            groups = list(self._groups.values())
        gone = [g for g in groups if not g.connected]
        # A group that never completed a hello (left_at None) has the least to lose.
        return min(gone, key=lambda g: -1.0 if g.left_at is None else g.left_at, default=None)

    def remove(self, key: GroupKey) -> GroupStore | None:
        with self._lock:
            return self._groups.pop(key, None)

    def get(self, key: GroupKey) -> GroupStore | None:
        with self._lock:
            return self._groups.get(key)

    def groups(self) -> list[GroupStore]:
        with self._lock:
            return list(self._groups.values())
