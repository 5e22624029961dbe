"""The unix-socket server runtimes connect to.

One thread accepts; one thread per connection reads frames (moewatch.wire) and hands each decoded
message to the `on_message` callback, each rejected frame to `on_reject` with a reason label. A
fatal framing error (bad header, oversized frame, stream cut inside a frame) closes that connection
only; the server keeps accepting. Plans go back through `Connection.send`, which serialises writers.

Rejection reasons (frames_rejected_total{reason}): malformed (payload does not parse, or bad
header), oversized, truncated, invalid_window (a window breaking its invariants), invalid_plan, and
those the callback returns (out_of_order, stale_epoch, mismatch, unexpected, ...).
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import threading
from pathlib import Path
from typing import Callable

from moewatch import wire
from moewatch.wire import FrameError

log = logging.getLogger("moewatch.agent.receiver")


def classify(error: FrameError) -> str:
    """A FrameError's reason label."""
    text = error.reason
    if "exceeds" in text:
        return "oversized"
    if "stream ended inside a frame" in text:
        return "truncated"
    if text.startswith("window rejected"):
        return "invalid_window"
    if text.startswith("plan rejected"):
        return "invalid_plan"
    return "malformed"


class Connection:
    _ids = 0
    _ids_lock = threading.Lock()

    def __init__(self, sock: socket.socket, max_frame_bytes: int):
        with Connection._ids_lock:
            Connection._ids += 1
            self.id = Connection._ids
        self.sock = sock
        self.max_frame_bytes = max_frame_bytes
        self._send_lock = threading.Lock()
        self.closed = threading.Event()
        self.group = None  # set by the daemon after a hello
        self.hello = None

    def send(self, message: wire.Message, timeout: float = 5.0) -> None:
        """Frame and send; raises OSError when the peer is gone."""
        data = wire.encode(message, self.max_frame_bytes)
        with self._send_lock:
            if self.closed.is_set():
                raise ConnectionError(f"connection {self.id} is closed")
            self.sock.settimeout(timeout)
            try:
                self.sock.sendall(data)
            finally:
                self.sock.settimeout(None)

    def close(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


MessageHandler = Callable[[Connection, wire.Message], "str | None"]


class Receiver:
    """Serve `path` until `stop`. Callbacks run on the connection's reader thread."""

    def __init__(self, path: str, mode: int, max_frame_bytes: int,
                 on_message: MessageHandler,
                 on_reject: Callable[[Connection | None, str, str], None],
                 on_frame: Callable[[str], None] | None = None,
                 on_disconnect: Callable[[Connection], None] | None = None):
        self.path = Path(path)
        self.mode = mode
        self.max_frame_bytes = max_frame_bytes
        self.on_message = on_message
        self.on_reject = on_reject
        self.on_frame = on_frame or (lambda t: None)
        self.on_disconnect = on_disconnect or (lambda c: None)
        self._server: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._connections: dict[int, tuple[Connection, threading.Thread]] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._remove_stale_socket()
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # umask first so the socket never exists with wider permissions than asked for.
        old_umask = os.umask(0o777 & ~self.mode)
        try:
            server.bind(str(self.path))
        finally:
            os.umask(old_umask)
        os.chmod(self.path, self.mode)
        server.listen(16)
        self._server = server
        self._accept_thread = threading.Thread(target=self._accept_loop, name="moewatch-accept", daemon=True)
        self._accept_thread.start()
        log.info("listening on %s (mode %04o)", self.path, self.mode)

    def _remove_stale_socket(self) -> None:
        try:
            st = self.path.lstat()
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise FileExistsError(f"socket: {self.path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(self.path))
        except OSError:
            self.path.unlink()  # nobody listens: left over from a crash
            return
        finally:
            probe.close()
        raise FileExistsError(f"socket: another process is listening on {self.path}")

    @property
    def listening(self) -> bool:
        return self._server is not None and not self._stopping.is_set() and \
            self._accept_thread is not None and self._accept_thread.is_alive()

    def connections(self) -> list[Connection]:
        with self._lock:
            return [c for c, _ in self._connections.values()]

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        if self._server is not None:
            try:
                self._server.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._server.close()
        if self._accept_thread is not None:
            self._accept_thread.join(timeout)
        for conn in self.connections():
            conn.close()
        with self._lock:
            threads = [t for _, t in self._connections.values()]
        for t in threads:
            t.join(timeout)
        try:
            if self.path.exists() and stat.S_ISSOCK(self.path.lstat().st_mode):
                self.path.unlink()
        except OSError:
            pass

    # --- loops ----------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        assert self._server is not None
        while not self._stopping.is_set():
            try:
                sock, _ = self._server.accept()
            except OSError:
                if self._stopping.is_set():
                    return
                continue
            conn = Connection(sock, self.max_frame_bytes)
            thread = threading.Thread(target=self._serve, args=(conn,), name=f"moewatch-conn-{conn.id}",
                                      daemon=True)
            with self._lock:
                self._connections[conn.id] = (conn, thread)
            thread.start()

    def _serve(self, conn: Connection) -> None:
        decoder = wire.FrameDecoder(self.max_frame_bytes)
        try:
            while not conn.closed.is_set():
                try:
                    data = conn.sock.recv(1 << 16)
                except OSError:
                    break
                if not data:
                    tail = decoder.finish()
                    if tail is not None:
                        self.on_reject(conn, classify(tail), tail.reason)
                    break
                for item in decoder.feed(data):
                    if isinstance(item, FrameError):
                        self.on_reject(conn, classify(item), item.reason)
                        if item.fatal:
                            log.warning("connection %d: %s; closing it", conn.id, item.reason)
                            conn.close()
                            break
                        continue
                    self.on_frame(type(item).__name__.lower())
                    try:
                        reason = self.on_message(conn, item)
                    except Exception:  # a handler bug must not take the connection down
                        log.exception("connection %d: handler failed", conn.id)
                        reason = "handler_error"
                    if reason is not None:
                        self.on_reject(conn, reason, f"{type(item).__name__.lower()} rejected: {reason}")
        finally:
            conn.close()
            with self._lock:
                self._connections.pop(conn.id, None)
            self.on_disconnect(conn)
