"""The server runtimes connect to: a unix socket, and optionally a TCP port, speaking moewatch.wire.

One thread runs a selector loop over every listener and connection: no thread per client, so a
thousand idle peers cost a thousand sockets, not a thousand threads. Each decoded message goes to the
`on_message` callback, each rejected frame to `on_reject` with a reason label; both run on the loop
thread and must stay short (they queue work, the jobs do it). A fatal framing error (bad header,
oversized frame, stream cut inside a frame) closes that connection only.

What a peer cannot do to the agent (Limits):
- open more than `max_connections` at once: at the limit a new connection first takes the place of
  the oldest one that has not said hello (closed, counted as
  moewatch_connections_closed_total{reason="hello_evicted"}); only a limit made of connections that
  did say hello refuses the new one (accepted and closed at once, counted as
  moewatch_connections_refused_total{reason="max_connections"}); the limit is also kept under the
  process's descriptor limit so the HTTP server always has descriptors left for /healthz;
- hold a connection without a hello for more than `hello_deadline` seconds (closed, counted as
  moewatch_connections_closed_total{reason="hello_deadline"}): a silent peer keeps no slot;
- take more than `frame_deadline` seconds over a frame once its first byte arrived (closed, counted
  as frames_rejected_total{reason="frame_deadline"});
- make the agent hold more than `buffer_budget` bytes of partial frames across all connections: the
  connection that would go over is closed (reason "buffer_budget");
- stall the agent by not reading: `Connection.send` only queues; a connection whose outbox exceeds
  `max_outbox_bytes`, or whose outbox has not moved for `frame_deadline` seconds, is closed
  (moewatch_connections_closed_total{reason="slow_reader"}).

Running out of descriptors (EMFILE on accept) is logged at most once per `log_interval`, the pending
client is refused with a spare descriptor kept for that purpose, and the listeners pause briefly: the
loop never spins.

Rejection reasons (frames_rejected_total{reason}): malformed (payload does not parse, or bad
header), oversized, truncated, invalid_window (a window breaking its invariants), invalid_plan,
frame_deadline, buffer_budget, and those the callback returns (out_of_order, stale_epoch, mismatch,
invalid_hello, unexpected, ...).
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import resource
import selectors
import socket
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from moewatch import wire
from moewatch.wire import FrameError

from .throttle import Throttle

log = logging.getLogger("moewatch.agent.receiver")

# Why the agent closes a peer's connection (moewatch_connections_closed_total{reason}).
CLOSED_REASONS = ("slow_reader", "frame_deadline", "buffer_budget", "hello_deadline", "hello_evicted")

# Descriptors kept free for everything but peers (HTTP scrapes and probes, the audit log, imports).
FD_RESERVE = 32
_FD_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def classify(error: FrameError) -> str:
    """A FrameError's reason label."""
    text = error.reason
    if text.startswith("window rejected"):
        return "invalid_window"  # before "exceeds": a window's own invariant ("top_k 9 exceeds 8 experts")
    if text.startswith("plan rejected"):
        return "invalid_plan"
    if error.fatal and "exceeds the maximum" in text:
        return "oversized"
    if "stream ended inside a frame" in text:
        return "truncated"
    return "malformed"


class TcpListenError(OSError):
    """The TCP listener could not be set up (the unix socket could)."""


@dataclass(frozen=True)
class Limits:
    max_connections: int = 256
    frame_deadline: float = 10.0
    buffer_budget: int = 256 * 1024 * 1024
    max_outbox_bytes: int = 16 * 1024 * 1024
    log_interval: float = 60.0
    hello_deadline: float = 10.0


class Connection:
    _ids = 0
    _ids_lock = threading.Lock()

    def __init__(self, sock: socket.socket, max_frame_bytes: int, max_outbox_bytes: int = 16 << 20,
                 wake: Callable[[], None] = lambda: None, transport: str = "unix"):
        with Connection._ids_lock:
            Connection._ids += 1
            self.id = Connection._ids
        self.sock = sock
        self.transport = transport
        self.max_frame_bytes = max_frame_bytes
        self.max_outbox_bytes = max_outbox_bytes
        self._wake = wake
        self._lock = threading.Lock()
        self._outbox: collections.deque = collections.deque()
        self.outbox_bytes = 0
        self.outbox_since: float | None = None  # when the oldest unsent byte was queued or last moved
        self.closed = threading.Event()
        self.close_reason: str | None = None
        self.decoder = wire.FrameDecoder(max_frame_bytes)
        self.frame_started: float | None = None
        self.pending_seen = 0  # this connection's share of the receiver's buffered bytes
        self.group = None  # set by the daemon after a hello
        self.hello = None  # set by the daemon once the peer said hello; until then the peer is on probation
        self.opened_at = time.monotonic()

    def send(self, message: wire.Message, timeout: float | None = None) -> None:
        """Frame and queue; never blocks. Raises ConnectionError when the connection is closed or its
        outbox is full (the peer does not read: the connection is then closed)."""
        data = wire.encode(message, self.max_frame_bytes)
        with self._lock:
            if self.closed.is_set():
                raise ConnectionError(f"connection {self.id} is closed")
            if self.outbox_bytes + len(data) > self.max_outbox_bytes:
                full = True
            else:
                full = False
                if not self._outbox:
                    self.outbox_since = time.monotonic()
                self._outbox.append(memoryview(data))
                self.outbox_bytes += len(data)
        if full:
            self.close("slow_reader")
            raise ConnectionError(f"connection {self.id}: the peer does not read (outbox full)")
        self._wake()

    def wants_write(self) -> bool:
        with self._lock:
            return bool(self._outbox)

    def flush(self) -> None:
        """Write what the socket takes now (loop thread only). Raises OSError when the peer is gone."""
        while True:
            with self._lock:
                if not self._outbox:
                    self.outbox_since = None
                    return
                head = self._outbox[0]
            try:
                n = self.sock.send(head)
            except (BlockingIOError, InterruptedError):
                return
            with self._lock:
                self.outbox_bytes -= n
                self.outbox_since = time.monotonic()
                if n == len(head):
                    self._outbox.popleft()
                else:
                    self._outbox[0] = head[n:]
                    return

    def close(self, reason: str | None = None) -> None:
        """Mark closed; the loop thread releases the socket (any thread may call this)."""
        if self.closed.is_set():
            return
        self.close_reason = self.close_reason or reason
        self.closed.set()
        self._wake()


MessageHandler = Callable[[Connection, wire.Message], "str | None"]


class Receiver:
    """Serve `path` (and `tcp`, a (host, port), when given) until `stop`."""

    def __init__(self, path: str, mode: int, max_frame_bytes: int,
                 on_message: MessageHandler,
                 on_reject: Callable[[Connection | None, str, str], None],
                 on_frame: Callable[[str], None] | None = None,
                 on_disconnect: Callable[[Connection], None] | None = None,
                 *, tcp: tuple[str, int] | None = None, limits: Limits = Limits(),
                 on_refused: Callable[[str], None] | None = None,
                 on_closed: Callable[[str], None] | None = None):
        self.path = Path(path)
        self.mode = mode
        self.tcp = tcp
        self.max_frame_bytes = max_frame_bytes
        self.limits = limits
        self.on_message = on_message
        self.on_reject = on_reject
        self.on_frame = on_frame or (lambda t: None)
        self.on_disconnect = on_disconnect or (lambda c: None)
        self.on_refused = on_refused or (lambda reason: None)
        self.on_closed = on_closed or (lambda reason: None)
        self.max_connections = limits.max_connections
        self._selector = selectors.DefaultSelector()
        self._listeners: list[tuple[socket.socket, str]] = []
        self._owned_inode: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket file we bound
        self._connections: dict[int, Connection] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._spare_fd: int | None = None
        self._paused_until = 0.0
        self._throttle = Throttle(limits.log_interval)
        self.tcp_port: int | None = None
        self.accept_failures = 0  # accepts that failed for lack of descriptors
        self._buffered = 0  # partial-frame bytes across connections (loop thread only)

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._remove_stale_socket()
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # umask first so the socket never exists with wider permissions than asked for.
        old_umask = os.umask(0o777 & ~self.mode)
        try:
            server.bind(str(self.path))
        except OSError:
            server.close()
            raise
        finally:
            os.umask(old_umask)
        st = self.path.lstat()
        self._owned_inode = (st.st_dev, st.st_ino)
        os.chmod(self.path, self.mode)
        server.listen(128)
        self._listeners.append((server, "unix"))
        if self.tcp is not None:
            host, port = self.tcp
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            tcp = socket.socket(family, socket.SOCK_STREAM)
            try:
                tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                tcp.bind((host, port))
                tcp.listen(128)
            except OSError as exc:
                tcp.close()
                self._close_listeners()
                raise TcpListenError(exc.errno, exc.strerror) from None
            self.tcp_port = int(tcp.getsockname()[1])
            self._listeners.append((tcp, "tcp"))
        # Peers never take the descriptors the HTTP server and the audit log need.
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and self.max_connections > soft - FD_RESERVE:
            self.max_connections = max(1, soft - FD_RESERVE)
            log.warning("limits.max_connections lowered to %d: the descriptor limit is %d (raise LimitNOFILE)",
                        self.max_connections, soft)
        self._spare_fd = os.open(os.devnull, os.O_RDONLY)
        for sock, kind in self._listeners:
            sock.setblocking(False)
            self._selector.register(sock, selectors.EVENT_READ, ("listen", kind))
        self._selector.register(self._wake_r, selectors.EVENT_READ, ("wake", None))
        self._thread = threading.Thread(target=self._loop, name="moewatch-receiver", daemon=True)
        self._thread.start()

    def _remove_stale_socket(self) -> None:
        try:
            st = self.path.lstat()
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise FileExistsError(f"server.socket: {self.path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(self.path))
        except OSError:
            self.path.unlink()  # nobody listens: left over from a crash
            return
        finally:
            probe.close()
        raise FileExistsError(f"server.socket: another process is listening on {self.path}")

    @property
    def listening(self) -> bool:
        return bool(self._listeners) and not self._stopping.is_set() and \
            self._thread is not None and self._thread.is_alive()

    def connections(self) -> list[Connection]:
        with self._lock:
            return list(self._connections.values())

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # already woken (the pair's buffer is full) or shutting down

    def _close_listeners(self) -> None:
        for sock, _ in self._listeners:
            try:
                self._selector.unregister(sock)
            except (KeyError, ValueError):
                pass
            sock.close()
        self._listeners = []

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout)
        self._close_listeners()
        for conn in self.connections():
            self._release(conn)
        self._remove_own_socket()
        for s in (self._wake_r, self._wake_w):
            s.close()
        if self._spare_fd is not None:
            os.close(self._spare_fd)
            self._spare_fd = None
        self._selector.close()

    def _remove_own_socket(self) -> None:
        """Unlink the socket file only if it is still the one this receiver bound (never another
        agent's live socket, nor a file someone put there since)."""
        if self._owned_inode is None:
            return
        try:
            st = self.path.lstat()
            if stat.S_ISSOCK(st.st_mode) and (st.st_dev, st.st_ino) == self._owned_inode:
                self.path.unlink()
        except OSError:
            pass
        self._owned_inode = None

    # --- the loop -------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping.is_set():
            now = time.monotonic()
            if self._paused_until and now >= self._paused_until:
                self._paused_until = 0.0
                for sock, kind in self._listeners:
                    self._selector.register(sock, selectors.EVENT_READ, ("listen", kind))
            try:
                events = self._selector.select(self._next_timeout(now))
            except OSError as exc:  # pragma: no cover - the selector itself failing is not recoverable
                log.error("receiver: select failed: %s", exc)
                time.sleep(0.1)
                continue
            for key, mask in events:
                what, extra = key.data
                if what == "wake":
                    try:
                        while self._wake_r.recv(4096):
                            pass
                    except (BlockingIOError, OSError):
                        pass
                elif what == "listen":
                    self._accept(key.fileobj, extra)
                else:
                    conn = extra
                    if mask & selectors.EVENT_READ and not conn.closed.is_set():
                        self._read(conn)
                    if mask & selectors.EVENT_WRITE and not conn.closed.is_set():
                        self._write(conn)
            self._housekeeping(time.monotonic())

    def _next_timeout(self, now: float) -> float:
        timeout = 0.25
        if self._paused_until:
            timeout = min(timeout, max(0.0, self._paused_until - now))
        return timeout

    def _accept(self, listener: socket.socket, kind: str) -> None:
        for _ in range(64):  # a burst, then let the connections have the loop
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _FD_ERRORS:
                    self._out_of_descriptors(listener, exc)
                elif not self._stopping.is_set():
                    self._log_throttled("accept", logging.WARNING, "accept failed: %s", exc)
                return
            if len(self._connections) >= self.max_connections and not self._evict_one_without_hello():
                sock.close()
                self.on_refused("max_connections")
                self._log_throttled("refused:max_connections", logging.WARNING,
                                    "refusing connections: %d open (max_connections)", len(self._connections))
                continue
            sock.setblocking(False)
            conn = Connection(sock, self.max_frame_bytes, self.limits.max_outbox_bytes, self._wake, kind)
            with self._lock:
                self._connections[conn.id] = conn
            self._selector.register(sock, selectors.EVENT_READ, ("conn", conn))

    def _evict_one_without_hello(self) -> bool:
        """Make room at max_connections: release the oldest connection that has not said hello (loop
        thread only). False when every connection did say hello."""
        waiting = [c for c in self.connections() if c.hello is None]
        if not waiting:
            return False
        oldest = min(waiting, key=lambda c: c.opened_at)
        oldest.close("hello_evicted")
        self._release(oldest)
        return True

    def _out_of_descriptors(self, listener: socket.socket, exc: OSError) -> None:
        """EMFILE: refuse the pending peer with the spare descriptor, then pause accepting a moment."""
        self.accept_failures += 1
        self.on_refused("out_of_descriptors")
        self._log_throttled("emfile", logging.ERROR,
                            "out of file descriptors (%s) with %d connections open: refusing new ones; "
                            "raise LimitNOFILE or lower limits.max_connections", exc.strerror, len(self._connections))
        if self._spare_fd is not None:
            os.close(self._spare_fd)
            self._spare_fd = None
            try:
                sock, _ = listener.accept()
                sock.close()
            except OSError:
                pass
            try:
                self._spare_fd = os.open(os.devnull, os.O_RDONLY)
            except OSError:
                self._spare_fd = None
        # Back off: without it a listener with a peer waiting stays readable and the loop spins.
        for sock, _ in self._listeners:
            try:
                self._selector.unregister(sock)
            except (KeyError, ValueError):
                pass
        self._paused_until = time.monotonic() + 0.5

    def _read(self, conn: Connection) -> None:
        try:
            data = conn.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            conn.close("reset")
            return
        if not data:
            tail = conn.decoder.finish()
            if tail is not None:
                self.on_reject(conn, classify(tail), tail.reason)
            conn.close("eof")
            return
        items = conn.decoder.feed(data)
        pending = conn.decoder.pending_bytes
        # The deadline runs from the first byte of the frame now in progress (a steady stream of
        # frames whose reads end mid-frame keeps moving it on).
        if not pending:
            conn.frame_started = None
        elif items or conn.frame_started is None:
            conn.frame_started = time.monotonic()
        self._buffered += pending - conn.pending_seen
        conn.pending_seen = pending
        for item in items:
            if isinstance(item, FrameError):
                self.on_reject(conn, classify(item), item.reason)
                if item.fatal:
                    self._log_throttled(f"fatal:{classify(item)}", logging.WARNING,
                                        "connection %d: %s; closing it", conn.id, item.reason)
                    conn.close(classify(item))
                    return
                continue
            self.on_frame(type(item).__name__.lower())
            try:
                reason = self.on_message(conn, item)
            except Exception:  # a handler bug must not take the connection (or the loop) down
                log.exception("connection %d: handler failed", conn.id)
                reason = "handler_error"
            if reason is not None:
                self.on_reject(conn, reason, f"{type(item).__name__.lower()} rejected: {reason}")
        if pending and self._buffered > self.limits.buffer_budget:
            # Its partial frame goes with it: the bytes are given back before the rejection is counted,
            # so whoever reads the counter sees the budget kept.
            self._buffered -= conn.pending_seen
            conn.pending_seen = 0
            conn.close("buffer_budget")
            self.on_reject(conn, "buffer_budget", f"partial frames across connections exceed "
                                                  f"{self.limits.buffer_budget} bytes")

    def _buffered_bytes(self) -> int:
        """Bytes of partial frames held across all connections (kept as a running total)."""
        return self._buffered

    def _write(self, conn: Connection) -> None:
        try:
            conn.flush()
        except OSError:
            conn.close("reset")

    def _housekeeping(self, now: float) -> None:
        for conn in self.connections():
            if not conn.closed.is_set():
                if conn.frame_started is not None and now - conn.frame_started > self.limits.frame_deadline:
                    self.on_reject(conn, "frame_deadline", f"a frame took over {self.limits.frame_deadline:g} s")
                    conn.close("frame_deadline")
                elif conn.outbox_since is not None and now - conn.outbox_since > self.limits.frame_deadline:
                    conn.close("slow_reader")
                elif conn.hello is None and now - conn.opened_at > self.limits.hello_deadline:
                    conn.close("hello_deadline")
                elif conn.wants_write():
                    self._write(conn)
            if conn.closed.is_set():
                self._release(conn)
                continue
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.wants_write() else 0)
            try:
                if self._selector.get_key(conn.sock).events != events:
                    self._selector.modify(conn.sock, events, ("conn", conn))
            except (KeyError, ValueError):
                pass

    def _release(self, conn: Connection) -> None:
        with self._lock:
            known = self._connections.pop(conn.id, None)
        if known is None:
            return
        conn.closed.set()
        self._buffered -= conn.pending_seen
        conn.pending_seen = 0
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        try:
            conn.sock.close()
        except OSError:
            pass
        reason = conn.close_reason or "closed"
        if reason in CLOSED_REASONS:
            self.on_closed(reason)
            self._log_throttled(f"closed:{reason}", logging.WARNING, "connection %d closed: %s", conn.id, reason)
        try:
            self.on_disconnect(conn)
        except Exception:
            log.exception("connection %d: disconnect handler failed", conn.id)

    def _log_throttled(self, key: str, level: int, message: str, *args) -> None:
        self._throttle.log(log, level, key, message, *args)
