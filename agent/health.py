"""Health: /healthz, /readyz, systemd notifications, and the agent's small HTTP server.

- /healthz (liveness): the agent's own machinery works: the scheduler runs and its socket listener
  is alive. A failure here means restart the agent.
- /readyz (readiness): liveness, plus the audit log is writable. It never depends on a runtime
  being connected: in Kubernetes a native sidecar's failing readiness takes the whole pod out of
  its Service, so an idle or restarting inference server must not make the agent unready
  ([kubernetes-sidecar], docs/sources.md).
- HTTP: optionally HTTPS (server.tls_cert_file, server.tls_key_file) and basic authentication
  (server.basic_auth_user, server.basic_auth_password_file) for /metrics and /status; /healthz and
  /readyz stay open for probes.
- systemd: with NOTIFY_SOCKET set, `READY=1` once serving, `WATCHDOG=1` every half WatchdogSec while
  /healthz passes, `STOPPING=1` on shutdown. Without NOTIFY_SOCKET these are no-ops.
"""

from __future__ import annotations

import base64
import errno
import hmac
import json
import logging
import os
import select
import selectors
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

log = logging.getLogger("moewatch.agent.health")


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str = ""


class Health:
    """Named checks, split into liveness and readiness."""

    def __init__(self) -> None:
        self.liveness: dict[str, Callable[[], Check]] = {}
        self.readiness: dict[str, Callable[[], Check]] = {}

    def _run(self, checks: dict[str, Callable[[], Check]]) -> tuple[bool, list[Check]]:
        results = []
        for name, fn in checks.items():
            try:
                results.append(fn())
            except Exception as exc:  # a check that raises is a failed check, not a crash
                results.append(Check(name, False, f"check raised {exc.__class__.__name__}: {exc}"))
        return all(c.ok for c in results), results

    def live(self) -> tuple[bool, list[Check]]:
        return self._run(self.liveness)

    def ready(self) -> tuple[bool, list[Check]]:
        ok_live, live = self._run(self.liveness)
        ok_ready, ready = self._run(self.readiness)
        return ok_live and ok_ready, live + ready


def health_body(ok: bool, checks: list[Check]) -> bytes:
    return json.dumps({"status": "ok" if ok else "fail",
                       "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in checks]}).encode()


# --- systemd ----------------------------------------------------------------------------------------

class SystemdNotifier:
    """sd_notify(3) over the datagram socket systemd names in NOTIFY_SOCKET (no libsystemd needed)."""

    def __init__(self, environ: dict[str, str] | None = None):
        env = os.environ if environ is None else environ
        self.address = env.get("NOTIFY_SOCKET") or None
        usec = env.get("WATCHDOG_USEC")
        pid = env.get("WATCHDOG_PID")
        self.watchdog_seconds: float | None = None
        if usec and (not pid or pid == str(os.getpid())):
            try:
                self.watchdog_seconds = int(usec) / 1e6
            except ValueError:
                log.warning("WATCHDOG_USEC=%r is not a number; no watchdog pings", usec)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, state: str) -> bool:
        if not self.address:
            return False
        address = self.address
        if address.startswith("@"):  # abstract namespace
            address = "\0" + address[1:]
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.connect(address)
                sock.sendall(state.encode())
            return True
        except OSError as exc:
            log.warning("sd_notify %s failed: %s", state.split("\n")[0], exc)
            return False

    def ready(self, status: str = "") -> bool:
        return self.notify("READY=1" + (f"\nSTATUS={status}" if status else ""))

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def stopping(self) -> bool:
        return self.notify("STOPPING=1")

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={text}")


# --- HTTP ---------------------------------------------------------------------------------------------

Route = Callable[[], tuple[int, str, bytes]]

# Probes stay open: a kubelet or systemd check has no credentials, and they reveal only check names.
OPEN_PATHS = frozenset({"/healthz", "/readyz"})


@dataclass(frozen=True)
class HttpSecurity:
    """TLS (an ssl.SSLContext) and basic authentication (the expected Authorization header value)."""

    tls: ssl.SSLContext | None = None
    authorization: bytes | None = None

    @classmethod
    def from_files(cls, cert_file: str = "", key_file: str = "", user: str = "", password_file: str = "") \
            -> "HttpSecurity":
        """Load once at start; ValueError names the setting whose file does not load."""
        tls = None
        if cert_file:
            tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            tls.minimum_version = ssl.TLSVersion.TLSv1_2
            try:
                tls.load_cert_chain(cert_file, key_file)
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(f"server.tls_cert_file: {cert_file} with server.tls_key_file {key_file}: "
                                 f"{getattr(exc, 'strerror', None) or exc}") from None
        authorization = None
        if user:
            try:
                lines = Path(password_file).read_text(encoding="utf-8").splitlines()
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"server.basic_auth_password_file: {password_file}: "
                                 f"{getattr(exc, 'strerror', None) or exc}") from None
            if not lines or not lines[0]:
                raise ValueError(f"server.basic_auth_password_file: {password_file}: empty")
            token = base64.b64encode(f"{user}:{lines[0]}".encode()).decode()
            authorization = f"Basic {token}".encode()
        return cls(tls, authorization)


class IdleConnections:
    """Accepted HTTP connections that have not sent a byte yet. They hold a descriptor, never a thread
    nor a serving slot, so idle peers cannot keep a scrape out: the first byte hands a connection to
    `dispatch`; one silent for `idle_seconds` is closed, and at `capacity` the oldest waiting one is
    closed to make room for the newcomer (a new scrape always gets in)."""

    def __init__(self, capacity: int, idle_seconds: float, dispatch: Callable[[socket.socket, object], None],
                 log_interval: float = 60.0):
        from .throttle import Throttle

        self.capacity = capacity
        self.idle_seconds = idle_seconds
        self.dispatch = dispatch
        self._throttle = Throttle(log_interval)
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._arrived: list[tuple[socket.socket, object, float]] = []  # handed over by the accepting thread
        self._waiting: dict[socket.socket, float] = {}  # loop thread only; insertion order is age order
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="moewatch-http-idle", daemon=True)
        self.evicted = 0  # waiting connections closed to make room
        self._pressure = False

    def start(self) -> None:
        self._thread.start()

    def add(self, request: socket.socket, client_address: object) -> None:
        with self._lock:
            self._arrived.append((request, client_address, time.monotonic()))
        self._wake()

    def add_pressure(self) -> None:
        """The process is out of descriptors: the oldest waiting connection gives its own back."""
        with self._lock:
            self._pressure = True
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass  # already woken, or stopping

    def _loop(self) -> None:
        while not self._stopping.is_set():
            for key, _ in self._selector.select(0.25):
                if key.data is None:
                    try:
                        while self._wake_r.recv(4096):
                            pass
                    except OSError:
                        pass
                    continue
                sock = key.fileobj
                self._selector.unregister(sock)
                self._waiting.pop(sock, None)
                self.dispatch(sock, key.data)
            with self._lock:
                arrived, self._arrived = self._arrived, []
                pressure, self._pressure = self._pressure, False
            if pressure:
                self.drop_oldest()
            for sock, address, since in arrived:
                if len(self._waiting) >= self.capacity:
                    self.drop_oldest()
                self._waiting[sock] = since
                self._selector.register(sock, selectors.EVENT_READ, address)
            now = time.monotonic()
            for sock, since in list(self._waiting.items()):
                if now - since <= self.idle_seconds:
                    break  # the rest are younger
                self._close(sock)

    def drop_oldest(self) -> None:
        """Close the connection waiting the longest (loop thread only)."""
        if not self._waiting:
            return
        self.evicted += 1
        if self._throttle("evicted") is not None:
            log.info("http: %d idle connections open: closing the oldest (4 x max_http_connections wait at most)",
                     len(self._waiting))
        self._close(next(iter(self._waiting)))

    def _close(self, sock: socket.socket) -> None:
        self._waiting.pop(sock, None)
        try:
            self._selector.unregister(sock)
        except (KeyError, ValueError):
            pass
        try:
            sock.close()
        except OSError:
            pass

    def stop(self) -> None:
        self._stopping.set()
        self._wake()
        if self._thread.is_alive():
            self._thread.join(5)
        for sock in list(self._waiting):
            self._close(sock)
        with self._lock:
            arrived, self._arrived = self._arrived, []
        for sock, _, _ in arrived:
            sock.close()
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()


class WebServer:
    """A threaded HTTP server for a fixed set of GET routes (path -> handler); HEAD answers as GET does,
    without the body.

    Threads, bounded: a connection gets a thread and a serving slot only once its request starts to
    arrive (until then it waits in IdleConnections, at most 4 x `max_connections` of them, the oldest
    closed first); at most `max_connections` are served at once (the rest are closed at once and
    counted), and a connection silent for `idle_seconds` is closed. Scrapes are a few per minute; a
    selector-based HTTP parser is not worth its code here. TLS handshakes run on the connection's
    thread, never on the accepting one."""

    def __init__(self, host: str, port: int, routes: dict[str, Route], *, security: HttpSecurity | None = None,
                 max_connections: int = 32, idle_seconds: float = 10.0,
                 on_refused: Callable[[], None] | None = None, log_interval: float = 60.0):
        routes = dict(routes)
        security = security or HttpSecurity()
        slots = threading.BoundedSemaphore(max_connections)
        refused = on_refused or (lambda: None)
        from .throttle import Throttle

        throttle = Throttle(log_interval)

        class Handler(BaseHTTPRequestHandler):
            server_version = "moewatch-agent"
            timeout = idle_seconds

            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                self._serve(body_too=True)

            def do_HEAD(self) -> None:  # noqa: N802 (the stdlib's name)
                # Load balancers probe with HEAD: the GET's status and headers, without the body.
                self._serve(body_too=False)

            def _serve(self, body_too: bool) -> None:
                path = self.path.split("?", 1)[0]
                route = routes.get(path)
                if security.authorization is not None and path not in OPEN_PATHS and not hmac.compare_digest(
                        (self.headers.get("Authorization") or "").encode(), security.authorization):
                    body = b"authentication required\n"
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", 'Basic realm="moewatch", charset="UTF-8"')
                    self.send_header("Content-Type", "text/plain; charset=utf-8")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    if body_too:
                        self.wfile.write(body)
                    return
                if route is None:
                    status, ctype, body = 404, "text/plain; charset=utf-8", b"not found\n"
                else:
                    try:
                        status, ctype, body = route()
                    except Exception as exc:
                        log.exception("%s failed", path)
                        status, ctype, body = 500, "text/plain; charset=utf-8", f"error: {exc}\n".encode()
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if body_too:
                    self.wfile.write(body)

            def log_message(self, format: str, *args) -> None:  # scrapes every few seconds: keep quiet
                log.debug("%s %s", self.address_string(), format % args)

        family = socket.AF_INET6 if ":" in host else socket.AF_INET

        class Server(ThreadingHTTPServer):
            address_family = family
            daemon_threads = True
            block_on_close = False
            idle: IdleConnections

            def get_request(self):
                try:
                    return super().get_request()
                except OSError as exc:
                    if exc.errno in (errno.EMFILE, errno.ENFILE):
                        # Out of descriptors: say so (throttled), make an idle peer give its descriptor
                        # back, and back off instead of spinning.
                        self.idle.add_pressure()
                        if throttle("emfile") is not None:
                            log.error("http: out of file descriptors: %s", exc.strerror)
                        time.sleep(0.1)
                    raise

            def process_request(self, request, client_address):
                # A thread only once the request arrives: a scrape whose request is already here goes
                # straight to a slot (no hand-over through the idle pool); one still silent waits there.
                try:
                    ready = bool(select.select([request], [], [], 0)[0])
                except (OSError, ValueError):
                    ready = False
                if ready:
                    self.dispatch(request, client_address)
                else:
                    self.idle.add(request, client_address)

            def dispatch(self, request, client_address):
                if not slots.acquire(blocking=False):
                    refused()
                    if throttle("refused") is not None:
                        log.warning("http: %d connections open: refusing more (server.max_http_connections)",
                                    max_connections)
                    self.shutdown_request(request)
                    return
                try:
                    super().process_request(request, client_address)
                except BaseException:
                    slots.release()
                    raise

            def process_request_thread(self, request, client_address):
                try:
                    if security.tls is not None:
                        request.settimeout(idle_seconds)
                        try:
                            request = security.tls.wrap_socket(request, server_side=True)
                        except (OSError, ssl.SSLError) as exc:
                            log.debug("http: TLS handshake with %s failed: %s", client_address, exc)
                            self.shutdown_request(request)
                            return
                    super().process_request_thread(request, client_address)
                finally:
                    slots.release()

        self.server = Server((host, port), Handler)
        self.server.idle = IdleConnections(4 * max_connections, idle_seconds, self.server.dispatch, log_interval)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def start(self) -> None:
        self.server.idle.start()
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.25},
                                        name="moewatch-http", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.idle.stop()
        self.server.server_close()
        if self._thread is not None:
            self._thread.join(5)
