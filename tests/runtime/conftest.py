"""Independent recounts for the runtime tests: plain Python loops over the documented rules, written
without the runtime's code (its vectorised torch versions are what the tests check against these)."""

from __future__ import annotations

import types

import pytest


def naive_capacity(ids, valid, scores, capacity, overflow):
    """The capacity rule of runtime/capacity.py, one pair at a time.

    ids [N][k], valid [N], scores [N][E] as nested lists; capacity int or None.
    Returns (assigned [N][k] with -1, routed [E], dropped [E], rerouted [E]).
    """
    num_tokens, top_k, num_experts = len(ids), len(ids[0]), len(scores[0])
    assigned = [[-1] * top_k for _ in range(num_tokens)]
    routed, dropped, rerouted, load = ([0] * num_experts for _ in range(4))
    waiting = {}
    for j in range(top_k):  # first choices before second choices, then token order
        for t in range(num_tokens):
            if not valid[t]:
                continue
            e = ids[t][j]
            routed[e] += 1
            if capacity is None or load[e] < capacity:
                load[e] += 1
                assigned[t][j] = e
            else:
                waiting.setdefault(t, []).append(j)
    if overflow == "reroute" and capacity is not None:
        candidates = {t: [e for e in sorted(range(num_experts), key=lambda e: -scores[t][e]) if e not in ids[t]]
                      for t in waiting}
        pointer = {t: 0 for t in waiting}
        while True:
            proposals = [t for t in sorted(waiting) if waiting[t] and pointer[t] < len(candidates[t])]
            if not proposals:
                break
            for t in proposals:  # one proposal per token per round, in token order
                e = candidates[t][pointer[t]]
                pointer[t] += 1
                if load[e] < capacity:
                    load[e] += 1
                    j = waiting[t].pop(0)
                    assigned[t][j] = e
                    rerouted[ids[t][j]] += 1
    for t, js in waiting.items():
        for j in js:
            dropped[ids[t][j]] += 1
    return assigned, routed, dropped, rerouted


def naive_slot(pmap_row, world_size, ranks_per_node, rank, expert, ordinal):
    """Own rank, then own node, then any replica; the ordinal-th pair takes candidate (ordinal + rank) % n."""
    per_rank = len(pmap_row) // world_size
    holders = [s for s, e in enumerate(pmap_row) if e == expert]
    own = [s for s in holders if s // per_rank == rank]
    near = [s for s in holders if s // per_rank // ranks_per_node == rank // ranks_per_node]
    tier = own or near or holders
    return tier[(ordinal + rank) % len(tier)]


def naive_dispatch_counts(assigned, pmap_row, world_size, ranks_per_node, rank):
    """Slot of every computed pair (pairs in token-major order) -> (slot counts [P], per-rank counts [W])."""
    per_rank = len(pmap_row) // world_size
    seen = {}
    slots = [0] * len(pmap_row)
    ranks = [0] * world_size
    for row in assigned:
        for e in row:
            if e < 0:
                continue
            s = naive_slot(pmap_row, world_size, ranks_per_node, rank, e, seen.get(e, 0))
            seen[e] = seen.get(e, 0) + 1
            slots[s] += 1
            ranks[s // per_rank] += 1
    return slots, ranks


@pytest.fixture(scope="session")
def naive():
    return types.SimpleNamespace(capacity=naive_capacity, slot=naive_slot, dispatch_counts=naive_dispatch_counts)


def _sender_hello():
    from moewatch import wire

    return wire.Hello(runtime="moewatch-runtime", model="m", ep_group="g", world_size=1, num_layers=1,
                      num_experts=2, num_slots=2, capabilities=("plan", "capacity"))


def _wait(predicate, seconds=10.0):
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


@pytest.fixture(scope="session")
def sender_kit():
    """What the sender tests share: a one-layer runtime's hello, and a polling wait."""
    return types.SimpleNamespace(hello=_sender_hello, wait=_wait)


class FakeAgent:
    """A unix-socket (or, with tcp, a loopback TCP) server speaking moewatch.wire, standing in for the
    agent; `path` is then what the runtime's --socket takes (`tcp://127.0.0.1:PORT` for TCP).

    Records every message with the index of its connection; `react(message, agent)` may answer.
    """

    def __init__(self, path, react=None, tcp=False):
        import socket
        import threading

        self.react = react
        self.messages = []  # (connection index, message)
        self.errors = []
        self.connections = 0
        self._conn = None
        if tcp:
            self._server = socket.create_server(("127.0.0.1", 0))
            self.path = f"tcp://127.0.0.1:{self._server.getsockname()[1]}"
        else:
            self.path = str(path)
            self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._server.bind(self.path)
        self._server.listen(4)
        self._server.settimeout(0.1)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        import socket

        from moewatch import wire

        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except (socket.timeout, OSError):
                continue
            index = self.connections
            self.connections += 1
            self._conn = conn
            conn.settimeout(0.1)
            decoder = wire.FrameDecoder()
            while not self._stop.is_set():
                try:
                    data = conn.recv(1 << 16)
                except socket.timeout:
                    continue
                except OSError:
                    break
                if not data:
                    break
                for item in decoder.feed(data):
                    if isinstance(item, wire.FrameError):
                        self.errors.append(item)
                        continue
                    with self._lock:
                        self.messages.append((index, item))
                    if self.react is not None:
                        self.react(item, self)
            conn.close()

    def send(self, message):
        from moewatch import wire

        self._conn.sendall(wire.encode(message))

    def of_type(self, cls):
        with self._lock:
            return [m for _, m in self.messages if isinstance(m, cls)]

    def drop_connection(self):
        """Close the current connection (the runtime should reconnect)."""
        import socket

        if self._conn is not None:
            try:
                self._conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self):
        self._stop.set()
        self._thread.join(2)
        self._server.close()


@pytest.fixture
def fake_agent(tmp_path):
    agents = []

    def start(react=None, name="agent.sock", tcp=False):
        agent = FakeAgent(tmp_path / name, react, tcp=tcp)
        agents.append(agent)
        return agent

    yield start
    for agent in agents:
        agent.close()
