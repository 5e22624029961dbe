"""Shared pieces for the agent's tests: windows built from a load and a placement, a fake runtime that
speaks moewatch.wire, and a running agent on temporary paths."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from moewatch import wire
from moewatch.telemetry import Window
from moewatch.agent.config import AgentConfig
from moewatch.agent.daemon import Daemon


def make_window(load: np.ndarray, pmap: np.ndarray, world_size: int, *, epoch: int = 0, start_time: float = 1000.0,
                steps: int = 4, model: str = "m", ep_group: str = "g", capacity_factor: float = 0.0,
                seconds_per_pair: float = 2e-6, transfer_seconds: float = 5e-5, top_k: int = 2,
                rank_slowdown=None) -> Window:
    """A valid window for `load` [L, E] pairs per step on placement `pmap` [L, P]: tokens start evenly
    over the ranks and take a replica on their own rank, else one spread evenly (the runtime's rule).
    Every rank waits for the busiest one inside the combine all-to-all. rank_slowdown: [W] factors on
    each rank's time per pair (a slow device at 2.0)."""
    load = np.asarray(load, dtype=np.int64)
    pmap = np.asarray(pmap, dtype=np.int64)
    L, E = load.shape
    P = pmap.shape[1]
    W = world_size
    S = P // W
    slot_rank = np.arange(P) // S
    traffic = np.zeros((L, W, W), dtype=np.int64)
    slot_tokens = np.zeros((L, P), dtype=np.int64)
    for layer in range(L):
        for e in range(E):
            pairs = int(load[layer, e]) * steps
            from_rank = np.full(W, pairs // W)
            from_rank[: pairs % W] += 1
            slots = np.flatnonzero(pmap[layer] == e)
            for r in range(W):
                n = int(from_rank[r])
                if n == 0:
                    continue
                local = slots[slot_rank[slots] == r]
                targets = local if len(local) else slots
                share = np.full(len(targets), n // len(targets))
                share[: n % len(targets)] += 1
                np.add.at(slot_tokens[layer], targets, share)
                np.add.at(traffic[layer, r], slot_rank[targets], share)
    local = np.diagonal(traffic, axis1=1, axis2=2).copy()
    sent = traffic.sum(axis=2) - local
    received = traffic.sum(axis=1) - local
    rank_load = local + received
    compute = rank_load * seconds_per_pair * (1.0 if rank_slowdown is None else np.asarray(rank_slowdown)[None, :])
    finish = compute.max(axis=1, keepdims=True) + transfer_seconds * steps
    dispatch = np.full((L, W), transfer_seconds * steps)
    combine = finish - compute
    layer_seconds = dispatch + compute + combine
    step = float(layer_seconds.max(axis=1).sum()) / steps
    return Window(
        runtime="fake", model=model, ep_group=ep_group, world_size=W, ranks_per_node=W, num_layers=L,
        num_experts=E, num_slots=P, top_k=top_k, epoch=epoch, steps=steps, start_time=start_time,
        end_time=start_time + step * steps, hidden_bytes=4096,
        physical_to_logical_map=pmap, expert_tokens=load * steps, slot_tokens=slot_tokens,
        dropped_tokens=np.zeros((L, E), np.int64), rerouted_tokens=np.zeros((L, E), np.int64),
        capacity_factor=np.full(L, capacity_factor), local_tokens=local, sent_tokens=sent,
        received_tokens=received, traffic=traffic, dispatch_seconds=dispatch, combine_seconds=combine,
        compute_seconds=compute, layer_seconds=layer_seconds, step_seconds=np.full(steps, step),
        step_tokens=np.full(steps, int(load[0].sum()) // top_k))


def hot_load(num_layers: int = 2, num_experts: int = 8, hot: int = 0, hot_pairs: int = 800,
             cold_pairs: int = 100) -> np.ndarray:
    load = np.full((num_layers, num_experts), cold_pairs, dtype=np.int64)
    load[:, hot] = hot_pairs
    return load


def contiguous(num_layers: int, num_experts: int, num_slots: int) -> np.ndarray:
    return np.tile(np.arange(num_slots) % num_experts, (num_layers, 1))


class FakeRuntime:
    """A runtime client for tests: hello, windows, acks, heartbeats over the agent's socket."""

    def __init__(self, path: str, *, world_size: int = 4, num_layers: int = 2, num_experts: int = 8,
                 num_slots: int = 12, model: str = "m", ep_group: str = "g", epoch: int = 0,
                 capabilities=("plan", "capacity")):
        self.path = path
        self.hello = wire.Hello(runtime="fake", model=model, ep_group=ep_group, world_size=world_size,
                                num_layers=num_layers, num_experts=num_experts, num_slots=num_slots, epoch=epoch,
                                ranks_per_node=world_size, capabilities=tuple(capabilities))
        self.sock: socket.socket | None = None
        self.decoder = wire.FrameDecoder()
        self.received: list = []

    def connect(self, hello: bool = True) -> "FakeRuntime":
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.path)
        self.decoder = wire.FrameDecoder()
        if hello:
            self.send(self.hello)
        return self

    def send(self, message) -> None:
        self.sock.sendall(wire.encode(message))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self, timeout: float = 5.0) -> list:
        """Messages that arrive within `timeout` (stops at the first batch)."""
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(1 << 20)
        except socket.timeout:
            return []
        if not data:
            return []
        items = self.decoder.feed(data)
        self.received.extend(items)
        return items

    def wait_plan(self, timeout: float = 10.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for item in self.recv(max(0.05, deadline - time.monotonic())):
                if hasattr(item, "physical_to_logical_map"):
                    return item
        return None

    def closed_by_peer(self, timeout: float = 3.0) -> bool:
        self.sock.settimeout(timeout)
        try:
            return self.sock.recv(1) == b""
        except (socket.timeout, BlockingIOError):
            return False
        except OSError:
            return True

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def wait_group(daemon, key=("m", "g"), timeout: float = 10.0):
    """The daemon's store for a group, once its hello has been handled. The store holds the group a
    moment before the daemon has registered the connection; the group's connection id is set last."""
    def handled():
        group = daemon.store.get(key)
        return group is not None and group.connection_id is not None

    assert wait_for(handled, timeout), f"no hello from {key}"
    return daemon.store.get(key)


def sglang_settings(**fields):
    """The SGLang settings section from the agent's config, with `fields` (its names, no prefix) set."""
    from moewatch.integrations.sglang.settings import SGLangSettings

    return SGLangSettings(**fields)


def scrape(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        return resp.read().decode()


def sample_value(exposition: str, name: str, **labels: str) -> float | None:
    """The value of the first sample of `name` whose labels include `labels`."""
    for line in exposition.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            return float(value)
    return None


def start_runtime(socket_path: str, *args: str) -> subprocess.Popen:
    """The reference runtime launcher in its own session, sending to the agent at socket_path."""
    return subprocess.Popen([sys.executable, "-m", "moewatch.cli", "runtime", "--socket", socket_path, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def stop_runtime(runtime: subprocess.Popen) -> dict:
    """Stop a runtime from start_runtime (SIGINT to its session: the launcher stops its ranks and
    prints its result) -> that result, the last line of its output."""
    if runtime.poll() is None:
        os.killpg(runtime.pid, signal.SIGINT)
    out, _ = runtime.communicate(timeout=60)
    return json.loads(out.strip().splitlines()[-1])


def audit_trail(audit_log: str) -> str:
    """An audit log as lines, one per record (time, event, epoch, reason or result, relative speed):
    for an assertion's message, which pytest prints whole as a str and cuts as a list."""
    from moewatch.agent.audit import read_audit

    return "\n".join(f"{r['time']:.2f} {r['event']} epoch={r.get('epoch')} {r.get('reason') or r.get('result') or ''} "
                     f"{r.get('relative_speed', '')}" for r in read_audit(audit_log))


@pytest.fixture
def helpers():
    """The module-level helpers (importlib mode keeps test modules from importing conftest)."""
    import types

    return types.SimpleNamespace(make_window=make_window, hot_load=hot_load, contiguous=contiguous,
                                 FakeRuntime=FakeRuntime, wait_for=wait_for, wait_group=wait_group, scrape=scrape,
                                 sample_value=sample_value, sglang_settings=sglang_settings,
                                 start_runtime=start_runtime, stop_runtime=stop_runtime, audit_trail=audit_trail)


@pytest.fixture
def short_tmp():
    """A short folder for unix sockets (their paths are limited to about 100 bytes)."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="mwt-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def start_agent(short_tmp):
    """start_agent(**sections) -> a started Daemon on temporary paths with fast jobs; stopped after.
    Each keyword is a section and its settings, over the test defaults: start_agent(policy={"mode": "act"})."""
    daemons: list[Daemon] = []

    def start(otel_readers=(), **sections) -> Daemon:
        defaults = {"server": {"socket": str(short_tmp / "agent.sock"), "listen": "127.0.0.1:0"},
                    "log": {"audit_log": str(short_tmp / "audit.jsonl")},
                    "jobs": {"triage_interval_seconds": 0.05, "plan_interval_seconds": 3600,
                             "export_interval_seconds": 0.2},
                    "policy": {"persist_windows": 2}}
        daemon = Daemon(AgentConfig.from_mapping(defaults, **sections), otel_readers=otel_readers).start()
        daemons.append(daemon)
        return daemon

    yield start
    for daemon in daemons:
        daemon.stop()
