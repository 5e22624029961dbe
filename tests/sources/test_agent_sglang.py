"""The agent watching SGLang's dump folder: each dump SGLang's own recorder writes becomes one
triaged window of its group, once; /status shows the source."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from moewatch.agent.config import AgentConfig, build_config
from moewatch.agent.daemon import Daemon

PMAP = np.array([[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 2, 3]])


@pytest.fixture
def agent_dir():
    path = Path(tempfile.mkdtemp(prefix="mws-", dir="/tmp"))  # short: unix socket paths are limited
    yield path
    shutil.rmtree(path, ignore_errors=True)


def agent_base(folder, export_interval: float) -> dict:
    """The sections of an agent on `folder` with fast triage and exports (planning left to the test)."""
    return {"server": {"socket": str(folder / "a.sock"), "listen": "127.0.0.1:0"},
            "log": {"audit_log": str(folder / "audit.jsonl")},
            "jobs": {"triage_interval_seconds": 0.05, "plan_interval_seconds": 3600,
                     "export_interval_seconds": export_interval}}


def wait_for(predicate, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.mark.slow
def test_agent_ingests_each_sglang_dump_once(sglang_recorder, agent_dir, monkeypatch):
    dumps = agent_dir / "dumps"
    dumps.mkdir()
    daemon = Daemon(AgentConfig.from_mapping(agent_base(agent_dir, 0.2), sglang={
        "dump_dir": str(dumps), "poll_seconds": 0.1, "model": "dsv3", "ep_group": "pod-a"})).start()
    try:
        meta = sglang_recorder.metadata(PMAP, ep_size=2)
        hot = np.full(PMAP.shape, 10)
        hot[:, 0] = 400
        sglang_recorder.dump(dumps, monkeypatch, "stat", meta, 0, [(0, hot), (1, hot)], buffer_size=8)
        assert wait_for(lambda: daemon.store.get(("dsv3", "pod-a")) is not None
                        and len(daemon.store.get(("dsv3", "pod-a")).history) == 1)
        group = daemon.store.get(("dsv3", "pod-a"))
        latest = group.latest()
        assert latest.window.runtime == "sglang" and latest.window.steps == 2
        assert [d.verdict for d in latest.diagnosis.layers] == ["imbalance-bound"] * 2
        time.sleep(0.5)  # several more polls: the same dump is not ingested again
        assert group.windows_accepted == 1
        status = json.loads(urllib.request.urlopen(daemon.http_url + "/status", timeout=5).read())
        assert status["sglang"]["dump_windows"] == 1 and status["sglang"]["dump_errors"] == 0
        assert status["groups"][0]["runtime"] == "sglang"
    finally:
        daemon.stop()


@pytest.mark.parametrize("url", ["ftp://host/metrics", "localhost:30000/metrics", "http:///metrics"])
def test_metrics_url_is_validated(url):
    from moewatch.thresholds import ConfigError

    with pytest.raises(ConfigError, match="^sglang.metrics_url: "):
        AgentConfig.from_mapping({"sglang.metrics_url": url, "sglang.num_experts": 4})


def test_metrics_url_needs_the_placement_in_force():
    from moewatch.thresholds import ConfigError

    with pytest.raises(ConfigError, match="^sglang.metrics_url: its windows need the placement in force"):
        AgentConfig.from_mapping({"sglang.metrics_url": "http://127.0.0.1:30000/metrics"})
    for extra in ({"sglang.num_experts": 8}, {"sglang.placement_file": "/etc/sglang/expert_location.json"}):
        AgentConfig.from_mapping({"sglang.metrics_url": "http://127.0.0.1:30000/metrics", **extra})


def samples(text: str, name: str) -> dict[tuple, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {tuple(sorted(s.labels.items())): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name}


@pytest.mark.slow
def test_agent_makes_windows_from_the_metrics_heatmap(sglang_heatmap, agent_dir):
    url, record, restart = sglang_heatmap
    placement = agent_dir / "expert_location.json"  # what SGLang was started with (--init-expert-location)
    placement.write_text(json.dumps({"physical_to_logical_map": PMAP.tolist()}))
    settings = AgentConfig.from_mapping(agent_base(agent_dir, 0.1), sglang={
        "metrics_url": url, "placement_file": str(placement), "poll_seconds": 0.1, "model": "dsv3",
        "ep_group": "pod-a"})
    record(np.array([[5, 5], [5, 5]]))  # before the agent's first scrape: the baseline
    daemon = Daemon(settings).start()
    try:
        assert wait_for(lambda: daemon.sources["sglang"].scraper.scrapes >= 1)
        skewed = np.array([[90, 10], [50, 50]])
        record(skewed)
        assert wait_for(lambda: daemon.store.get(("dsv3", "pod-a")) is not None
                        and len(daemon.store.get(("dsv3", "pod-a")).history) == 1)
        latest = daemon.store.get(("dsv3", "pod-a")).latest()
        w = latest.window
        assert w.runtime == "sglang" and w.expert_tokens is None and np.array_equal(w.rank_tokens, skewed)
        assert np.array_equal(w.physical_to_logical_map, PMAP) and (w.world_size, w.num_slots) == (2, 6)
        hot, even = latest.diagnosis.layers
        assert (hot.verdict, hot.cause, even.verdict) == ("imbalance-bound", None, "healthy")

        def exposition():
            return urllib.request.urlopen(daemon.http_url + "/metrics", timeout=5).read().decode()

        group = (("ep_group", "pod-a"), ("model", "dsv3"))
        assert wait_for(lambda: samples(exposition(), "moewatch_layer_balancedness_ratio")
                        .get((*group[:1], ("layer", "0"), *group[1:])) == pytest.approx(50 / 90))
        text = exposition()
        missing = samples(text, "moewatch_layer_evidence_missing")
        layer0 = {dict(k)["evidence"]: v for k, v in missing.items() if dict(k)["layer"] == "0"}
        assert layer0["expert_load"] == 1 and layer0["rank_load"] == 0 and layer0["a2a_time"] == 1
        assert samples(text, "moewatch_layer_routed_pairs_total") == {}  # not measured, not zero
        lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
        assert lint.returncode == 0, lint.stdout + lint.stderr
        restart()  # SGLang restarted: its counters start from zero, and count whole
        record(np.array([[7, 3], [4, 6]]))
        assert wait_for(lambda: len(daemon.store.get(("dsv3", "pod-a")).history) == 2)
        again = daemon.store.get(("dsv3", "pod-a")).latest().window
        assert again.rank_tokens.tolist() == [[7, 3], [4, 6]] and again.extra["source"]["reset"] is True
        status = json.loads(urllib.request.urlopen(daemon.http_url + "/status", timeout=5).read())
        assert status["sglang"]["heatmap_windows"] == 2 and status["sglang"]["last_error"] is None
    finally:
        daemon.stop()


@pytest.mark.slow
def test_hook_windows_reach_the_agent_over_its_socket(agent_dir, monkeypatch):
    import torch
    from moewatch.runtime.engines.sglang_hooks import topk_counter

    from sglang.srt import runtime_context

    daemon = Daemon(AgentConfig.from_mapping(agent_base(agent_dir, 0.2))).start()
    monkeypatch.setenv("MOEWATCH_SOCKET", str(agent_dir / "a.sock"))
    monkeypatch.delenv("MOEWATCH_WINDOW_DIR", raising=False)
    # SGLang's published configuration of an eager server (no CUDA graphs: the forward-hook path), TP rank 0.
    with runtime_context._CONTEXT.override_server_args(disable_cuda_graph=True, tp_size=2, ep_size=2), \
            runtime_context.get_parallel().override(tp_rank=0, moe_ep_rank=0):
        counter = topk_counter({"num_layers": 2, "num_experts": 4, "num_slots": 6, "ep_size": 2, "model": "tiny",
                                "window_seconds": 3600, "physical_to_logical_map": PMAP.tolist()})
    try:
        gate = torch.nn.Module()
        for layer in (0, 1):
            gate.layer_id = layer
            ids = torch.tensor([[0, 4], [0, 5], [2, 3]])
            counter(gate, (), type("Out", (), {"topk_ids": ids})())
        window = counter.flush()
        assert wait_for(lambda: daemon.store.get(("tiny", "ep0")) is not None
                        and len(daemon.store.get(("tiny", "ep0")).history) == 1)
        got = daemon.store.get(("tiny", "ep0")).latest().window
        assert got.runtime == "sglang" and np.array_equal(got.slot_tokens, window.slot_tokens)
        assert got.slot_tokens[0].tolist() == [2, 0, 1, 1, 1, 1]
    finally:
        counter.close()
        daemon.stop()


@pytest.mark.slow
@pytest.mark.parametrize("actuate", [False, True])
def test_dump_groups_take_placements_only_when_the_sglang_actuator_writes_them(sglang_recorder, agent_dir,
                                                                                monkeypatch, actuate):
    from moewatch.agent.audit import read_audit

    dumps = agent_dir / "dumps"
    dumps.mkdir()
    flags = {"server.socket": str(agent_dir / "a.sock"), "server.listen": "127.0.0.1:0",
             "log.audit_log": str(agent_dir / "audit.jsonl"), "jobs.triage_interval_seconds": 0.05,
             "jobs.plan_interval_seconds": 3600, "jobs.export_interval_seconds": 0.2,
             "sglang.dump_dir": str(dumps), "sglang.poll_seconds": 0.1, "sglang.model": "dsv3",
             "sglang.ep_group": "pod-a", "policy.mode": "act", "policy.persist_windows": 1}
    if actuate:
        flags |= {"sglang.actuate": True, "sglang.location_file": str(agent_dir / "expert_location.json")}
    daemon = Daemon(build_config(flags=flags, environ={})).start()
    try:
        meta = sglang_recorder.metadata(PMAP, ep_size=2)
        hot = np.full(PMAP.shape, 10)
        hot[:, 0] = 400
        sglang_recorder.dump(dumps, monkeypatch, "stat", meta, 0, [(0, hot), (1, hot)], buffer_size=8)
        key = ("dsv3", "pod-a")
        assert wait_for(lambda: daemon.store.get(key) is not None and len(daemon.store.get(key).history) == 1)
        group = daemon.store.get(key)
        assert group.hello.capabilities == (("plan",) if actuate else ())
        daemon.controller.plan_tick()
        decisions = [r for r in read_audit(daemon.cfg.log.audit_log) if r["event"] == "decision"]
        assert decisions
        if actuate:
            # A placement is a lever now, so the planner is asked; a stat dump reads as one rank (it has no
            # rank-level counts), where no placement is better.
            assert all(r["result"] == "skipped" and "the planner finds no placement better" in r["reason"]
                       for r in decisions)
        else:
            assert all(r["result"] == "skipped" and "does not apply placement plans" in r["reason"] for r in decisions)
        assert not (agent_dir / "expert_location.json").exists()
    finally:
        daemon.stop()


@pytest.mark.slow
def test_two_dp_ranks_shards_reach_the_agent_as_one_window_of_the_group(agent_dir, monkeypatch):
    """Two SGLang DP ranks' hooks (one connection each, as two scheduler processes have): the agent
    merges their shards of one sequence into one window of the group, each rank's pairs in its row."""
    import torch

    from moewatch.runtime.engines.common import env_sinks
    from moewatch.runtime.engines.sglang_hooks import HookConfig, TopKCounter, _hello

    daemon = Daemon(AgentConfig.from_mapping(agent_base(agent_dir, 0.2))).start()
    monkeypatch.setenv("MOEWATCH_SOCKET", str(agent_dir / "a.sock"))
    monkeypatch.delenv("MOEWATCH_WINDOW_DIR", raising=False)
    cfg = HookConfig.from_mapping({"num_layers": 2, "num_experts": 4, "num_slots": 6, "ep_size": 2, "top_k": 2,
                                   "model": "tiny", "window_seconds": 3600,
                                   "physical_to_logical_map": PMAP.tolist()})
    counters = []
    try:
        for rank in (0, 1):
            shard = {"index": rank, "count": 2, "rank": rank}
            sinks, closers = env_sinks(lambda shard=shard: _hello(cfg, cfg.ep_group, 2, shard))
            counters.append(TopKCounter(cfg, sinks, closers=tuple(closers), shard=shard, start_thread=False))
        gate = torch.nn.Module()
        for rank, counter in enumerate(counters):
            for layer in (0, 1):
                gate.layer_id = layer
                ids = torch.tensor([[rank * 3, rank * 3 + 1]])  # rank 0 to slots 0, 1; rank 1 to slots 3, 4
                counter(gate, (), type("Out", (), {"topk_ids": ids})())
            counter.flush(sequence=5)
        key = ("tiny", "ep0")
        assert wait_for(lambda: daemon.store.get(key) is not None and len(daemon.store.get(key).history) == 1)
        got = daemon.store.get(key).latest().window
        assert got.extra["shards"]["received"] == [0, 1] and got.extra["shards"]["missing"] == []
        assert got.slot_tokens[0].tolist() == [1, 1, 0, 1, 1, 0] and got.steps == 1
        assert got.traffic[0].tolist() == [[2, 0], [0, 2]]  # slots 0-2 on rank 0, 3-5 on rank 1
    finally:
        for counter in counters:
            counter.close()
        daemon.stop()
