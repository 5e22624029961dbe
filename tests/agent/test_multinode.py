"""Two torchrun "nodes" on this machine (two torchrun processes, --nnodes 2, c10d rendezvous on
127.0.0.1, gloo, one rank per node) running `python -m moewatch.runtime` with the real agent.

1. Act mode: the windows carry the node layout, the hot experts are replicated by a node-aware plan
   applied live on both nodes, no pair is lost, and /metrics shows the cross-node share per layer.
2. One node is killed (or hangs) while the other waits on it mid-migration: the survivor keeps the
   old placement, answers the plan with a failed Ack and exits within the collective timeout; the
   agent sees the group go and keeps serving other groups.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moewatch.agent.audit import read_audit
from moewatch.runtime.launcher import free_port

# Seed 1 makes experts 3 (layer 0) and 6 (layer 1) the hot ones, each with a single slot out of 10.
RUNTIME = ["--layers", "2", "--experts", "8", "--slots", "10", "--hidden", "32", "--ffn", "64",
           "--batch-tokens", "64", "--zipf", "0", "--hot-experts", "1", "--hot-share", "0.7",
           "--window-steps", "10", "--seed", "1", "--threads-per-rank", "1", "--json"]
COLLECTIVE_TIMEOUT = 20


# c10d numbers the nodes in the order of their addresses: "127.0.0.1" sorts before "localhost", so
# node 0 runs global rank 0 (as the leader pod does in agent/deploy/kubernetes-multinode.yaml).
LOCAL_ADDRS = ("127.0.0.1", "localhost")


def start_nodes(tmp: Path, *runtime_args: str) -> list[subprocess.Popen]:
    """Two torchrun processes forming one EP group of 2 ranks, 1 per node (node 0 hosts the store)."""
    port = free_port()
    nodes = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"mw{port}",
               "--rdzv-conf", f"is_host={'true' if node == 0 else 'false'}", "--max-restarts", "0",
               "--local-addr", LOCAL_ADDRS[node], "-m", "moewatch.runtime", *runtime_args]
        nodes.append(subprocess.Popen(cmd, stdout=open(tmp / f"node{node}.out", "w"),
                                      stderr=open(tmp / f"node{node}.err", "w"), start_new_session=True))
    return nodes


def workers(node: subprocess.Popen) -> dict[int, int]:
    """{global rank: pid} of the workers a torchrun process started."""
    out = {}
    children = Path(f"/proc/{node.pid}/task/{node.pid}/children")
    for pid in (children.read_text().split() if children.exists() else []):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        rank = next((int(v.split(b"=", 1)[1]) for v in env if v.startswith(b"RANK=")), None)
        if rank is not None:
            out[rank] = int(pid)
    return out


def stop_nodes(nodes: list[subprocess.Popen], sig=signal.SIGKILL) -> None:
    for node in nodes:
        if node.poll() is None:
            for pid in workers(node).values():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            os.killpg(node.pid, sig)
            node.wait(30)


def result_of(tmp: Path) -> dict:
    """Rank 0's JSON result: node 0 prints it, node 1 prints nothing."""
    assert (tmp / "node1.out").read_text() == ""
    lines = [line for line in (tmp / "node0.out").read_text().splitlines() if line.startswith("{")]
    assert lines, "no result: " + (tmp / "node0.err").read_text()[-2000:]
    return json.loads(lines[-1])


@pytest.mark.slow
def test_two_torchrun_nodes_get_a_node_aware_plan_applied_live(start_agent, short_tmp, helpers):
    agent = start_agent(policy={"mode": "act", "persist_windows": 2, "cooldown_seconds": 1, "max_plans_per_hour": 1},
                        jobs={"plan_interval_seconds": 0.3}, verify={"windows": 2, "rollback_time_rise": 100.0})
    nodes = start_nodes(short_tmp, *RUNTIME, "--steps", "0", "--seconds", "120",
                        "--socket", agent.cfg.server.socket, "--collective-timeout", str(COLLECTIVE_TIMEOUT))
    try:
        group = helpers.wait_group(agent, ("moewatch-ref", "ep0"), timeout=60)
        assert group.hello.world_size == 2 and group.hello.ranks_per_node == 1
        audit = agent.cfg.log.audit_log
        assert helpers.wait_for(lambda: any(r["event"] in ("verified", "rollback", "plan_failed")
                                            for r in read_audit(audit)), timeout=60), read_audit(audit)
        records = read_audit(audit)
        sent = next(r for r in records if r["event"] == "plan_sent")
        epoch = sent["epoch"]
        assert next(r for r in records if r["event"] == "plan_applied")["epoch"] == epoch
        assert any(r["event"] == "verified" and r["epoch"] == epoch for r in records)
        proposed = [r for r in records if r["event"] == "decision" and r["result"] == "proposed"]
        assert proposed and all(r["after"]["num_nodes"] == 2 and "node-aware, 2 nodes" in r["reason"]
                                for r in proposed)
        before = [t for t in group.recent() if t.window.epoch < epoch]
        assert helpers.wait_for(lambda: len(group.recent(epoch=epoch)) >= 2, timeout=30)
        after = group.recent(epoch=epoch)
        for t in before + after:  # every window carries the node layout
            assert t.window.world_size == 2 and t.window.ranks_per_node == 1
        for layer in range(2):
            hot = int(np.argmax(after[-1].window.expert_tokens[layer]))
            holders = np.flatnonzero(np.array(after[-1].window.physical_to_logical_map[layer]) == hot) // 5
            assert set(holders.tolist()) == {0, 1}, "the hot expert has a replica on both nodes"

        def balancedness(windows):
            return float(np.mean([[d.metrics["balancedness"] for d in t.diagnosis.layers] for t in windows]))
        assert balancedness(after) > balancedness(before) + 0.15
        # Cross-node traffic per layer on /metrics: with one rank per node it is the cross-rank share.
        assert helpers.wait_for(lambda: helpers.sample_value(helpers.scrape(agent.http_url), "moewatch_epoch",
                                                             model="moewatch-ref") == epoch, timeout=10)
        text = helpers.scrape(agent.http_url)
        for layer in ("0", "1"):
            cross_node = helpers.sample_value(text, "moewatch_layer_cross_node_ratio", model="moewatch-ref",
                                              layer=layer)
            cross_rank = helpers.sample_value(text, "moewatch_layer_cross_rank_ratio", model="moewatch-ref",
                                              layer=layer)
            assert cross_node is not None and 0 < cross_node == pytest.approx(cross_rank)
        # Stop the group: rank 0 decides the stop at a step boundary, both ranks leave together.
        for node in nodes:
            for pid in workers(node).values():
                os.kill(pid, signal.SIGTERM)
        for node in nodes:
            node.wait(60)
    finally:
        stop_nodes(nodes)
    assert [node.returncode for node in nodes] == [0, 0], (short_tmp / "node0.err").read_text()[-3000:]
    result = result_of(short_tmp)
    assert result["pairs_lost"] == 0 and result["pairs_routed"] == result["pairs_computed"] > 0
    assert result["epoch"] == epoch and result["config"]["ranks"] == 2 and result["config"]["ranks_per_node"] == 1
    assert next(a for a in result["acks"] if a["plan_epoch"] == epoch)["ok"]


@pytest.mark.slow
@pytest.mark.parametrize("fate, timeout", [("killed", COLLECTIVE_TIMEOUT), ("hung", 6)])
def test_a_node_lost_mid_migration_leaves_the_survivor_on_the_old_placement(start_agent, short_tmp, helpers,
                                                                             fate, timeout):
    """killed: node 1's processes are SIGKILLed while rank 0 waits on them for weights (gloo sees the
    connection close). hung: node 1 stays up but never answers; the collective timeout ends the wait."""
    agent = start_agent(policy={"mode": "act", "persist_windows": 2, "cooldown_seconds": 1, "max_plans_per_hour": 1},
                        jobs={"plan_interval_seconds": 0.3})
    marker = short_tmp / "stalled"
    stall = json.dumps({"rank": 1, "epoch": 1, "stage": "stall", "marker": str(marker)})
    nodes = start_nodes(short_tmp, *RUNTIME, "--steps", "0", "--seconds", "120", "--socket", agent.cfg.server.socket,
                        "--collective-timeout", str(timeout), "--inject-migration-failure", stall)
    try:
        group = helpers.wait_group(agent, ("moewatch-ref", "ep0"), timeout=60)
        # Rank 1 stops inside the migration to epoch 1, after every rank agreed to move weights.
        assert helpers.wait_for(marker.exists, timeout=60), (short_tmp / "node1.err").read_text()[-2000:]
        doomed = next(i for i, node in enumerate(nodes) if 1 in workers(node))
        assert doomed == 1 and 0 in workers(nodes[0]), "node 0 runs rank 0"
        survivor = nodes[0]
        if fate == "killed":
            stop_nodes([nodes[1]])
        # The survivor finds the peer gone, or the collective times out, and leaves on its own: a
        # wedged survivor fails here (TimeoutExpired) rather than hanging the test.
        survivor.wait(timeout + 30)
        assert fate == "killed" or nodes[1].poll() is None, "the hung node was still up while rank 0 gave up"
    finally:
        stop_nodes(nodes)
    err = (short_tmp / "node0.err").read_text()
    assert survivor.returncode != 0
    assert "rank 0: the EP group lost a peer" in err and "placement of epoch 0 kept" in err, err[-3000:]
    # The agent got the failed Ack, saw the group go, kept its epoch, and still serves other groups.
    assert helpers.wait_for(lambda: any(r["event"] == "plan_failed" and r["epoch"] == 1
                                        for r in read_audit(agent.cfg.log.audit_log)), timeout=10)
    assert helpers.wait_for(lambda: not group.connected, timeout=10)
    assert group.epoch_in_force == 0
    other = helpers.FakeRuntime(agent.cfg.server.socket, model="other", ep_group="g2").connect()
    try:
        load, pmap = helpers.hot_load(2, 8), helpers.contiguous(2, 8, 12)
        other.send(helpers.make_window(load, pmap, 4, model="other", ep_group="g2"))
        other_group = helpers.wait_group(agent, ("other", "g2"), timeout=10)
        assert helpers.wait_for(lambda: len(other_group.history) == 1, timeout=10)
        text = helpers.scrape(agent.http_url)
        assert helpers.sample_value(text, "moewatch_windows_total", model="other") == 1
        assert helpers.sample_value(text, "moewatch_runtime_connected", model="moewatch-ref") == 0
    finally:
        other.close()
