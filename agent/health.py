"""Health: /healthz, /readyz, systemd notifications, and the agent's small HTTP server.

- /healthz (liveness): the agent's own machinery works: the scheduler runs and its socket listener
  is alive. A failure here means restart the agent.
- /readyz (readiness): liveness, plus the audit log is writable. It never depends on a runtime
  being connected: in Kubernetes a native sidecar's failing readiness takes the whole pod out of
  its Service, so an idle or restarting inference server must not make the agent unready
  (REFERENCE.md).
- systemd: with NOTIFY_SOCKET set, `READY=1` once serving, `WATCHDOG=1` every half WatchdogSec while
  /healthz passes, `STOPPING=1` on shutdown. Without NOTIFY_SOCKET these are no-ops.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from dataclasses import dataclass
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


class WebServer:
    """A threaded HTTP server for a fixed set of GET routes (path -> handler)."""

    def __init__(self, host: str, port: int, routes: dict[str, Route]):
        routes = dict(routes)

        class Handler(BaseHTTPRequestHandler):
            server_version = "moewatch-agent"

            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                path = self.path.split("?", 1)[0]
                route = routes.get(path)
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
                self.wfile.write(body)

            def log_message(self, format: str, *args) -> None:  # scrapes every few seconds: keep quiet
                log.debug("%s %s", self.address_string(), format % args)

        family = socket.AF_INET6 if ":" in host else socket.AF_INET

        class Server(ThreadingHTTPServer):
            address_family = family
            daemon_threads = True

        self.server = Server((host, port), Handler)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def start(self) -> None:
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.25},
                                        name="moewatch-http", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        if self._thread is not None:
            self._thread.join(5)
