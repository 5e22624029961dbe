"""The probe's non-blocking link to the agent: bounded queues and one background thread.

The runtime is the client of the agent's stream socket: a unix path, or `tcp://HOST:PORT` when the
agent runs on another node (the agent's TCP listener speaks the same frames). The thread connects (retrying with
exponential backoff while the agent is absent), sends a wire.Hello first on every connection, then
writes queued frames (windows, acks, heartbeats) and reads what the agent sends back: Plan frames go
to `on_plan` (rank 0's control inbox). Enqueueing never blocks: when a queue is full the oldest
frame of that queue is dropped and counted, so a slow or absent agent costs the forward step nothing.
"""

from __future__ import annotations

import collections
import random
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from moewatch import wire
from moewatch.plan import Plan
from moewatch.telemetry import Window

TCP_SCHEME = "tcp://"


def agent_address(text: str) -> tuple[str, object]:
    """`/run/moewatch/moewatch.sock` -> ("unix", path); `tcp://HOST:PORT` (`tcp://[::1]:PORT` for
    IPv6) -> ("tcp", (host, port)). Raises ValueError saying what is wrong."""
    if not isinstance(text, str) or not text:
        raise ValueError("expected a unix socket path or tcp://HOST:PORT")
    if not text.startswith(TCP_SCHEME):
        if len(text.encode()) > 107:  # sun_path holds 108 bytes with its terminator
            raise ValueError("a unix socket path must be 1 to 107 bytes long")
        return "unix", text
    rest = text[len(TCP_SCHEME):]
    host, sep, port = rest.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected tcp://HOST:PORT with a port in 1..65535, got {text!r}")
    return "tcp", (host, int(port))


@dataclass
class SenderStats:
    frames_sent: int = 0
    frames_dropped: int = 0  # dropped because a queue was full (agent absent or slow)
    windows_dropped: int = 0
    connects: int = 0
    connect_failures: int = 0
    disconnects: int = 0
    plans_received: int = 0
    frames_rejected: int = 0  # frames from the agent that did not decode
    encode_errors: int = 0
    # windows lost, by reason (wire.WINDOW_LOSS_REASONS): queue_full, send_failed, encode_error, unsent_at_close
    window_drops: dict[str, int] = field(default_factory=dict)

    def drop_window(self, reason: str, count: int = 1) -> None:
        if count:
            self.window_drops[reason] = self.window_drops.get(reason, 0) + count


class Sender:
    def __init__(self, path: str, hello: Callable[[], wire.Hello], *, on_plan: Callable[[Plan], None] | None = None,
                 queue_size: int = 64, heartbeat_seconds: float = 1.0, heartbeat: Callable[[], wire.Heartbeat] | None = None,
                 backoff_initial: float = 0.05, backoff_max: float = 2.0, poll_seconds: float = 0.02,
                 send_timeout: float = 2.0):
        self.path = path
        self.address = agent_address(path)
        self._hello = hello
        self._on_plan = on_plan
        self._heartbeat = heartbeat
        self.heartbeat_seconds = heartbeat_seconds
        self.backoff_initial, self.backoff_max = backoff_initial, backoff_max
        self.poll_seconds, self.send_timeout = poll_seconds, send_timeout
        self._windows: collections.deque = collections.deque()
        self._control: collections.deque = collections.deque()
        self._window_limit = queue_size
        self._control_limit = max(queue_size, 256)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._drain_until = 0.0
        self.stats = SenderStats()
        self._sock: socket.socket | None = None
        self._decoder = wire.FrameDecoder()
        self._thread = threading.Thread(target=self._run, name="moewatch-sender", daemon=True)

    # --- producer side (the runtime's thread): never blocks ----------------------------------------
    def start(self) -> "Sender":
        self._thread.start()
        return self

    def send_window(self, window: Window) -> bool:
        """Queue a window; False when an older one had to be dropped to make room."""
        return self._put(self._windows, self._window_limit, window, is_window=True)

    def send_control(self, message: wire.Ack | wire.Heartbeat) -> bool:
        return self._put(self._control, self._control_limit, message, is_window=False)

    def _put(self, queue: collections.deque, limit: int, item, is_window: bool) -> bool:
        with self._lock:
            kept = True
            if len(queue) >= limit:
                queue.popleft()
                self.stats.frames_dropped += 1
                self.stats.windows_dropped += int(is_window)
                if is_window:
                    self.stats.drop_window("queue_full")
                kept = False
            queue.append(item)
        return kept

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def close(self, drain_seconds: float = 2.0) -> SenderStats:
        """Stop the thread, first trying for up to drain_seconds to deliver what is queued."""
        self._drain_until = time.monotonic() + drain_seconds
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(drain_seconds + 2 * self.send_timeout + 1.0)
        self._disconnect(count=False)
        with self._lock:
            left = len(self._windows) + len(self._control)
            self.stats.frames_dropped += left
            self.stats.windows_dropped += len(self._windows)
            self.stats.drop_window("unsent_at_close", len(self._windows))
            self._windows.clear()
            self._control.clear()
        return self.stats

    # --- the thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        backoff = self.backoff_initial
        next_attempt = 0.0
        next_heartbeat = time.monotonic() + self.heartbeat_seconds
        while True:
            now = time.monotonic()
            if self._stop.is_set() and (now >= self._drain_until or not self._pending() or self._sock is None):
                return
            if self._sock is None:
                if now < next_attempt:
                    self._stop.wait(min(self.poll_seconds * 5, next_attempt - now))
                    continue
                if self._connect():
                    backoff = self.backoff_initial
                else:
                    # Jittered: the runtimes of a node that lost their agent together do not all
                    # reconnect in the same instant when it comes back.
                    next_attempt = now + backoff * random.uniform(0.75, 1.25)
                    backoff = min(backoff * 2, self.backoff_max)
                continue
            self._read_incoming()
            if self._sock is None:
                continue
            if self._heartbeat is not None and now >= next_heartbeat:
                next_heartbeat = now + self.heartbeat_seconds
                self.send_control(self._heartbeat())
            self._write_pending()

    def _pending(self) -> bool:
        return bool(self._windows or self._control)

    def _open(self) -> socket.socket:
        kind, where = self.address
        if kind == "tcp":
            sock = socket.create_connection(where, timeout=self.send_timeout)
            # Small control frames (acks, heartbeats) must not wait for Nagle's timer.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.send_timeout)
            sock.connect(where)
        except OSError:
            sock.close()
            raise
        return sock

    def _connect(self) -> bool:
        try:
            sock = self._open()
        except OSError:
            self.stats.connect_failures += 1
            return False
        try:
            sock.sendall(wire.encode(self._hello()))
        except (wire.FrameError, ValueError, TypeError):  # a hello that cannot be built: retried later, never the thread's end
            sock.close()
            self.stats.connect_failures += 1
            return False
        except OSError:
            sock.close()
            self.stats.connect_failures += 1
            return False
        self._sock = sock
        self._decoder = wire.FrameDecoder()
        self.stats.connects += 1
        return True

    def _disconnect(self, count: bool = True) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None
            if count:
                self.stats.disconnects += 1

    def _read_incoming(self) -> None:
        try:
            readable, _, _ = select.select([self._sock], [], [], self.poll_seconds)
            if not readable:
                return
            data = self._sock.recv(1 << 16)
        except OSError:
            self._disconnect()
            return
        if not data:  # the agent closed the connection
            self._disconnect()
            return
        for item in self._decoder.feed(data):
            if isinstance(item, wire.FrameError):
                self.stats.frames_rejected += 1
                if item.fatal:
                    self._disconnect()
                    return
            elif isinstance(item, Plan):
                self.stats.plans_received += 1
                if self._on_plan is not None:
                    self._on_plan(item)

    def _write_pending(self) -> None:
        while self._sock is not None:
            with self._lock:
                queue = self._control if self._control else self._windows
                if not queue:
                    return
                item = queue.popleft()
            try:
                frame = wire.encode(item)
            except (wire.FrameError, ValueError, TypeError):
                self.stats.encode_errors += 1
                if isinstance(item, Window):
                    self.stats.drop_window("encode_error")
                continue
            try:
                self._sock.sendall(frame)
            except OSError:
                # A frame cut short cannot be resumed on a new connection: it is lost, and counted.
                with self._lock:
                    self.stats.frames_dropped += 1
                    self.stats.windows_dropped += int(isinstance(item, Window))
                    if isinstance(item, Window):
                        self.stats.drop_window("send_failed")
                self._disconnect()
                return
            self.stats.frames_sent += 1
