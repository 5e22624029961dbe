"""The agent's shard step (agent/shards.py): the shards of a sharded EP group's window sequence are held
until all are in or the deadline passes, merged (moewatch/shards.py) and triaged as one window;
missing, late and refused shards are named and counted; an engine rebalance whose digests differ
across shards is audited and counted. End to end: several shard processes connected to one running
agent over its unix socket and TCP."""

from __future__ import annotations

import json
import socket
import urllib.request

import numpy as np
import pytest

from moewatch import wire
from moewatch.agent.audit import AuditLog, read_audit
from moewatch.agent.config import AgentConfig
from moewatch.agent.metrics.state import MetricsState
from moewatch.agent.shards import ShardMerger, ShardStep
from moewatch.agent.top import render
from moewatch.telemetry import Window
from moewatch.thresholds import ConfigError

L, E, W = 2, 8, 4
GROUP = ("m", "g")


def limits(**fields):
    return AgentConfig.from_mapping({"limits": fields}).limits


def shard(rank: int, sequence: int, *, count: int = W, length: float = 1.0, epoch: int = 0, records=None,
          start: float = 1000.0) -> Window:
    """Shard `rank` of window `sequence`, as an engine adapter sends one: its own tokens' expert
    counts (one slot per expert), its own rank's layer time, no rank-level counts."""
    rng = np.random.default_rng(1000 * sequence + rank)
    layer = np.zeros((L, W))
    layer[:, rank] = rng.uniform(0.01, 0.02, L)
    extra = {"shard": {"index": rank, "count": count, "rank": rank, "sequence": sequence}}
    if records is not None:
        extra["engine_rebalance"] = records
    zeros = np.zeros((L, E), np.int64)
    return Window(runtime="vllm", model="m", ep_group="g", world_size=W, ranks_per_node=W, num_layers=L,
                  num_experts=E, num_slots=E, top_k=2, epoch=epoch, steps=5, start_time=start + sequence * length,
                  end_time=start + (sequence + 1) * length, hidden_bytes=4096,
                  physical_to_logical_map=np.tile(np.arange(E), (L, 1)), expert_tokens=rng.integers(0, 50, (L, E)),
                  dropped_tokens=zeros, rerouted_tokens=zeros, capacity_factor=np.zeros(L), layer_seconds=layer,
                  extra=extra)


def summed(name: str, windows) -> np.ndarray:
    return np.sum([getattr(w, name) for w in windows], axis=0)


# --- the merger's decisions ---------------------------------------------------------------------------

def test_a_complete_sequence_leaves_at_once_and_sequences_leave_in_order():
    merger = ShardMerger(limits(shard_deadline_windows=2.0, shard_min_deadline_seconds=0))
    emitted = [merger.offer(shard(rank, 1), now=0.0).emitted for rank in range(W)]
    assert emitted[:-1] == [[], [], []] and [e.sequence for e in emitted[-1]] == [1]
    # Sequence 1 went out with its last shard; sequence 3 is complete before 2, and waits behind it.
    assert merger.status(GROUP)["emitted_through"] == 1
    merger.offer(shard(0, 2), now=0.1)
    for rank in range(W):
        assert merger.offer(shard(rank, 3), now=0.2).emitted == []
    out = []
    for rank in (1, 2, 3):
        out += merger.offer(shard(rank, 2), now=0.3).emitted
    assert [e.sequence for e in out] == [2, 3] and all(e.complete for e in out)
    np.testing.assert_array_equal(out[0].window.expert_tokens, summed("expert_tokens", [shard(r, 2) for r in range(W)]))
    assert out[0].window.traffic is not None and out[0].window.layer_seconds is not None


def test_the_deadline_follows_the_window_length_then_the_window_goes_without_the_missing_shard():
    merger = ShardMerger(limits(shard_deadline_windows=1.5, shard_min_deadline_seconds=2.0))
    for rank in range(3):
        merger.offer(shard(rank, 4, length=10.0), now=100.0)
    assert merger.due(now=114.9) == []  # 1.5 windows of 10 s
    (emitted,) = merger.due(now=115.0)
    assert (emitted.sequence, emitted.received, emitted.missing, emitted.complete) == (4, [0, 1, 2], [3], False)
    window = emitted.window
    assert window.extra["shards"] == {"count": W, "received": [0, 1, 2], "missing": [3], "refused": []}
    assert "shards" in window.missing_evidence and window.layer_seconds is None
    np.testing.assert_array_equal(window.expert_tokens, summed("expert_tokens", [shard(r, 4) for r in range(3)]))
    # The shard that comes after its window left is late, not a window of its own.
    late = merger.offer(shard(3, 4, length=10.0), now=116.0)
    assert late.refused == "late_shard" and late.emitted == []
    assert merger.status(GROUP)["shards_refused"] == {"late_shard": 1} and merger.status(GROUP)["shards_missing"] == 1


def test_short_windows_wait_at_least_the_minimum_deadline():
    merger = ShardMerger(limits(shard_deadline_windows=1.0, shard_min_deadline_seconds=2.0))
    merger.offer(shard(0, 0, length=0.1), now=0.0)
    assert merger.due(now=1.9) == [] and len(merger.due(now=2.0)) == 1


def test_a_duplicate_is_refused_and_too_many_pending_sequences_let_the_oldest_go():
    merger = ShardMerger(limits(shard_min_deadline_seconds=60, max_shard_sequences=2))
    merger.offer(shard(0, 0), now=0.0)
    assert merger.offer(shard(0, 0), now=0.0).refused == "duplicate_shard"
    merger.offer(shard(0, 1), now=0.0)
    (forced,) = merger.offer(shard(0, 2), now=0.0).emitted
    assert forced.sequence == 0 and forced.missing == [1, 2, 3]
    assert merger.pending(GROUP) == 2


def test_a_shard_with_another_map_is_refused_by_reason_and_the_rest_merged():
    merger = ShardMerger(limits(shard_min_deadline_seconds=60))
    odd = shard(2, 0)
    odd = odd.replace(physical_to_logical_map=np.tile(np.roll(np.arange(E), 1), (L, 1)))
    out = []
    for w in (shard(0, 0), shard(1, 0), odd, shard(3, 0)):
        out += merger.offer(w, now=0.0).emitted
    (emitted,) = out
    assert emitted.refused == [(2, "map_mismatch")] and emitted.missing == [] and not emitted.complete
    assert emitted.window.extra["shards"]["refused"] == [2] and "shards" in emitted.window.missing_evidence
    np.testing.assert_array_equal(emitted.window.expert_tokens,
                                  summed("expert_tokens", [shard(r, 0) for r in (0, 1, 3)]))


def test_shards_whose_merge_breaks_the_contract_are_refused_whole_never_half_merged():
    """Each shard is valid alone, but shard 1's per-rank totals put its pairs on rank 0 while the map
    puts them on every rank: the merged window would break rank_tokens = slot counts per rank."""
    merger = ShardMerger(limits())
    good = shard(0, 0)
    liar = shard(1, 0)
    totals = np.zeros((L, W), np.int64)
    totals[:, 0] = liar.expert_tokens.sum(axis=1)
    liar = liar.replace(rank_tokens=totals)
    good = good.replace(rank_tokens=good.expert_tokens.reshape(L, W, E // W).sum(axis=2))
    out = []
    for w in (good, liar, shard(2, 0).replace(rank_tokens=shard(2, 0).expert_tokens.reshape(L, W, 2).sum(axis=2)),
              shard(3, 0).replace(rank_tokens=shard(3, 0).expert_tokens.reshape(L, W, 2).sum(axis=2))):
        out += merger.offer(w, now=0.0).emitted
    (emitted,) = out
    assert emitted.window is None and "rank_tokens" in emitted.error
    assert emitted.refused == [(i, "invalid_merge") for i in range(W)]
    assert merger.status(GROUP)["shards_refused"] == {"invalid_merge": W}


# --- the step's actions: counters, audit, delivery -------------------------------------------------------

def record(call: int, digest: str) -> dict:
    return {"engine": "vllm", "call": call, "digest": digest, "layer_outcomes": {"moved": 1}, "experts_moved": 2}


def test_a_rebalance_whose_digests_differ_across_shards_is_audited_and_counted_once(tmp_path):
    state = MetricsState()
    audit = AuditLog(tmp_path / "audit.jsonl")
    delivered = []
    clock = [0.0]
    step = ShardStep(limits(shard_min_deadline_seconds=60), state, lambda: audit,
                     lambda w: delivered.append(w), log_interval=60, clock=lambda: clock[0])
    step.on_hello(GROUP)
    assert state.get("moewatch_engine_rebalance_digest_mismatches_total", GROUP) == 0
    for rank in range(W):
        step.offer(shard(rank, 0, records=[record(5, "aa"), record(6, "bb" if rank != 3 else "cc")]))
    # A call's records may land in the next window on one rank: still compared.
    for rank in range(W):
        step.offer(shard(rank, 1, records=[record(7, "dd")] if rank else []))
    assert state.get("moewatch_engine_rebalance_digest_mismatches_total", GROUP) == 1
    # Call 7 recorded by rank 0 in sequence 2 and by the others in sequence 1: compared across sequences.
    step.offer(shard(0, 2, records=[record(7, "ee")]))
    step.offer(shard(1, 2, records=[record(7, "ee")]))
    assert state.get("moewatch_engine_rebalance_digest_mismatches_total", GROUP) == 1  # told when sequence 2 leaves
    clock[0] = 60.0
    step.flush_due()
    step.offer(shard(2, 2, records=[record(7, "ee")]))  # late, and a call's mismatch is reported once
    assert state.get("moewatch_engine_rebalance_digest_mismatches_total", GROUP) == 2
    lines = [r for r in read_audit(tmp_path / "audit.jsonl") if r["event"] == "engine_rebalance_digest_mismatch"]
    assert [(r["model"], r["ep_group"], r["call"], r["sequence"]) for r in lines] == [("m", "g", 6, 0),
                                                                                       ("m", "g", 7, 2)]
    assert lines[0]["digests"] == {"0": "bb", "1": "bb", "2": "bb", "3": "cc"} and lines[0]["ranks"]["3"] == 3
    assert lines[1]["digests"] == {"0": "ee", "1": "dd", "2": "dd", "3": "dd"}
    assert len(delivered) == 3 and delivered[0].extra["engine_rebalance"][0]["digest"] == "aa"
    # Each call reaches the store once, in the first merged window that carries it.
    calls = [[r["call"] for r in w.extra.get("engine_rebalance", [])] for w in delivered]
    assert calls == [[5, 6], [7], []]
    audit.close()


def test_a_rebalance_whose_digests_agree_is_not_a_mismatch(tmp_path):
    state = MetricsState()
    step = ShardStep(limits(), state, lambda: None, lambda w: None, log_interval=60)
    step.on_hello(GROUP)
    for rank in range(W):
        step.offer(shard(rank, 0, records=[record(5, "aa")]))
    assert state.get("moewatch_engine_rebalance_digest_mismatches_total", GROUP) == 0
    assert state.get("moewatch_shard_windows_total", (*GROUP, "complete")) == 1


def test_missing_late_and_refused_shards_are_counted_by_reason(tmp_path):
    state = MetricsState()
    clock = [0.0]
    step = ShardStep(limits(shard_min_deadline_seconds=5, shard_deadline_windows=0.01), state, lambda: None,
                     lambda w: None, log_interval=60, clock=lambda: clock[0])
    step.on_hello(GROUP)
    for rank in range(2):
        step.offer(shard(rank, 0))
    step.offer(shard(2, 0, epoch=4))
    assert state.get("moewatch_shard_sequences_pending", GROUP) == 1
    clock[0] = 5.0
    step.flush_due()
    step.offer(shard(3, 0))
    assert state.get("moewatch_shards_missing_total", GROUP) == 1
    assert state.get("moewatch_shards_refused_total", (*GROUP, "epoch_mismatch")) == 1
    assert state.get("moewatch_shards_refused_total", (*GROUP, "late_shard")) == 1
    assert state.get("moewatch_shard_windows_total", (*GROUP, "partial")) == 1
    assert state.get("moewatch_shard_sequences_pending", GROUP) == 0


# --- one running agent, several shard processes over the unix socket and TCP ------------------------------

def shard_hello(index: int, pid: int) -> wire.Hello:
    return wire.Hello(runtime="vllm", model="m", ep_group="g", world_size=W, num_layers=L, num_experts=E,
                      num_slots=E, ranks_per_node=2, pid=pid, shard_index=index, shard_count=W)


class ShardProcess:
    """One DP rank's connection: over the agent's unix socket, or TCP when given a port."""

    def __init__(self, index: int, path: str | None = None, port: int | None = None):
        if port is None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(path)
        else:
            self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.sendall(wire.encode(shard_hello(index, pid=4000 + index)))

    def send(self, window: Window) -> None:
        self.sock.sendall(wire.encode(window))

    def open(self) -> bool:
        self.sock.settimeout(0.2)
        try:
            return self.sock.recv(1) != b""
        except socket.timeout:
            return True

    def close(self) -> None:
        self.sock.close()


def status(url: str) -> dict:
    with urllib.request.urlopen(url + "/status", timeout=5) as resp:
        return json.loads(resp.read())


def test_shards_over_the_socket_and_tcp_make_one_groups_windows_on_metrics_and_status(start_agent, helpers):
    daemon = start_agent(server={"tcp_listen": "127.0.0.1:0"},
                         limits={"shard_deadline_windows": 0.01, "shard_min_deadline_seconds": 0.3})
    path, port = daemon.cfg.server.socket, daemon.receiver.tcp_port
    processes = [ShardProcess(0, path=path), ShardProcess(1, path=path), ShardProcess(2, port=port),
                 ShardProcess(3, port=port)]
    try:
        assert helpers.wait_for(lambda: len(daemon._connections) == W)
        group = daemon.store.get(GROUP)
        for sequence in (0, 1):
            for process, rank in zip(processes, range(W)):
                process.send(shard(rank, sequence))
        for rank in range(3):  # rank 3's shard of sequence 2 never comes
            processes[rank].send(shard(rank, 2))
        assert helpers.wait_for(lambda: len(group.recent()) == 3, timeout=15), status(daemon.http_url)
        text = helpers.scrape(daemon.http_url)
        value = helpers.sample_value
        assert value(text, "moewatch_shard_windows_total", model="m", ep_group="g", outcome="complete") == 2
        assert value(text, "moewatch_shard_windows_total", model="m", ep_group="g", outcome="partial") == 1
        assert value(text, "moewatch_shards_missing_total", model="m", ep_group="g") == 1
        assert value(text, "moewatch_windows_total", model="m", ep_group="g") == 3
        assert value(text, "moewatch_layer_evidence_missing", model="m", ep_group="g", layer="0",
                     evidence="shards") == 1
        assert value(text, "moewatch_runtime_connected", model="m", ep_group="g") == 1
        # One group, built from every shard: the triaged windows are the merged ones.
        windows = [t.window for t in group.recent()]
        for sequence, window in enumerate(windows):
            ranks = range(W) if sequence < 2 else range(3)
            expected = summed("expert_tokens", [shard(r, sequence) for r in ranks])
            np.testing.assert_array_equal(window.expert_tokens, expected)
        assert windows[0].traffic is not None and windows[0].layer_seconds is not None
        body = status(daemon.http_url)
        (item,) = body["groups"]
        assert item["windows_accepted"] == 3 and "shards" in item["summary"]["missing"]
        assert item["shards"]["windows"] == {"complete": 2, "partial": 1}
        assert item["shards"]["latest"] == {"sequence": 2, "count": W, "received": [0, 1, 2], "missing": [3],
                                            "refused": []}
        assert ("shards: 2 windows complete, 1 partial, 1 shards missing; latest sequence 2: 3 of 4, lacking 3"
                in render(body, colour=False))
        # No shard replaced another, and the group takes no plan (no connection speaks for all of it).
        assert all(p.open() for p in processes) and daemon.connection_of(GROUP) is None
        processes[3].send(shard(3, 2))
        assert helpers.wait_for(lambda: daemon.metrics.get("moewatch_shards_refused_total",
                                                           (*GROUP, "late_shard")) == 1)
        # Shards leaving one by one: the group is connected until the last one goes.
        for process in processes[:3]:
            process.close()
        assert helpers.wait_for(lambda: len(daemon._connections) == 1) and group.connected
        processes[3].close()
        assert helpers.wait_for(lambda: not group.connected)
    finally:
        for process in processes:
            process.close()


def test_a_restarted_shard_process_starts_a_new_lineage_and_drops_what_was_held(start_agent, helpers):
    daemon = start_agent(limits={"shard_min_deadline_seconds": 60})
    path = daemon.cfg.server.socket
    first = [ShardProcess(i, path=path) for i in range(2)]
    try:
        assert helpers.wait_for(lambda: len(daemon._connections) == 2)
        first[0].send(shard(0, 9))
        assert helpers.wait_for(lambda: daemon.shards.status(GROUP) is not None
                                and daemon.shards.status(GROUP)["pending_sequences"] == [9])
        group = daemon.store.get(GROUP)
        lineage = group.lineage
        # Shard 1's process reconnects unchanged: the same lineage, nothing dropped.
        first[1].close()
        again = ShardProcess(1, path=path)
        assert helpers.wait_for(lambda: group.shard_connections.get(1) not in (None,) and len(daemon._connections) == 2)
        assert group.lineage == lineage and daemon.shards.status(GROUP)["pending_sequences"] == [9]
        # Shard 0 comes back as another process: a restart; the old processes' held shards go.
        restarted = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        restarted.connect(path)
        restarted.sendall(wire.encode(shard_hello(0, pid=9999)))
        assert helpers.wait_for(lambda: group.lineage == lineage + 1)
        assert daemon.shards.status(GROUP) is None
        restarted.close()
        again.close()
    finally:
        for process in first:
            process.close()


def test_a_digest_mismatch_reaches_the_audit_log_and_metrics_of_a_running_agent(start_agent, helpers):
    daemon = start_agent()
    path = daemon.cfg.server.socket
    processes = [ShardProcess(i, path=path) for i in range(W)]
    try:
        assert helpers.wait_for(lambda: len(daemon._connections) == W)
        for rank, process in enumerate(processes):
            process.send(shard(rank, 0, records=[record(1, "ff" if rank == 2 else "ee")]))
        assert helpers.wait_for(lambda: daemon.metrics.get("moewatch_engine_rebalance_digest_mismatches_total",
                                                           GROUP) == 1)
        assert helpers.wait_for(lambda: len(daemon.store.get(GROUP).recent()) == 1)
        lines = [r for r in read_audit(daemon.cfg.log.audit_log) if r["event"] == "engine_rebalance_digest_mismatch"]
        assert len(lines) == 1 and lines[0]["digests"] == {"0": "ee", "1": "ee", "2": "ff", "3": "ee"}
        # The merged window carries the call once: the engine's rebalance is counted once, not per shard.
        assert daemon.metrics.get("moewatch_engine_rebalance_calls_total", (*GROUP, "vllm", "decided")) == 1
    finally:
        for process in processes:
            process.close()


def test_each_shard_process_counts_its_own_dropped_frames(start_agent, helpers):
    """Heartbeats carry each process's cumulative count: two shards' counts are not one count that
    jumps between them (which would add 5 every time shard 1 follows shard 0)."""
    daemon = start_agent()
    processes = [ShardProcess(i, path=daemon.cfg.server.socket) for i in range(2)]
    try:
        assert helpers.wait_for(lambda: len(daemon._connections) == 2)
        for dropped in ((3, 5), (3, 5), (4, 5)):
            for process, count in zip(processes, dropped):
                process.sock.sendall(wire.encode(wire.Heartbeat(time=1.0, epoch=0, step=1, frames_dropped=count)))
        assert helpers.wait_for(lambda: daemon.metrics.get("moewatch_runtime_frames_dropped_total", GROUP) == 9)
        assert helpers.wait_for(lambda: daemon.store.get(GROUP).shard_frames_dropped == {0: 4, 1: 5})
        assert daemon.metrics.get("moewatch_runtime_frames_dropped_total", GROUP) == 9
    finally:
        for process in processes:
            process.close()


def test_one_connection_speaks_for_one_shard(start_agent, helpers):
    """A second hello on a shard's connection naming another shard index is a mismatch, not a takeover."""
    daemon = start_agent()
    process = ShardProcess(0, path=daemon.cfg.server.socket)
    try:
        assert helpers.wait_for(lambda: len(daemon._connections) == 1)
        process.sock.sendall(wire.encode(shard_hello(1, pid=4000)))
        assert helpers.wait_for(lambda: daemon.metrics.get("moewatch_frames_rejected_total", ("mismatch",)) == 1)
        assert list(daemon._connections) == [("m", "g", 0)]
    finally:
        process.close()


def test_the_deadline_settings_are_checked_at_the_edge_naming_the_field():
    for name, value in (("shard_deadline_windows", 0), ("shard_min_deadline_seconds", -1), ("max_shard_sequences", 0)):
        with pytest.raises(ConfigError, match=f"limits.{name}"):
            limits(**{name: value})
    assert limits(shard_deadline_windows=2.0, shard_min_deadline_seconds=1.0).shard_deadline_seconds(3.0) == 6.0


def test_a_shards_connection_sends_its_own_shard_only(start_agent, helpers):
    """A window naming another shard index (or count) than its connection's hello is a mismatch: a
    connection speaks for one shard, so one process cannot fill a sequence alone."""
    daemon = start_agent()
    process = ShardProcess(0, path=daemon.cfg.server.socket)
    try:
        assert helpers.wait_for(lambda: len(daemon._connections) == 1)
        process.send(shard(1, 0))
        process.send(shard(0, 0, count=2))
        assert helpers.wait_for(lambda: daemon.metrics.get("moewatch_frames_rejected_total", ("mismatch",)) == 2)
        process.send(shard(0, 0))
        assert helpers.wait_for(lambda: daemon.shards.status(GROUP) is not None
                                and daemon.shards.status(GROUP)["pending_sequences"] == [0])
    finally:
        process.close()
