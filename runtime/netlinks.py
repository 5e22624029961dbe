"""Emulated links: each rank of a group in its own network namespace, on a shaped link to a bridge.

Loopback has no contention: two senders to one receiver both go at memory speed. Here every rank gets
a namespace with one veth whose other end sits on a bridge (in a namespace of its own, so nothing on
the host's network is touched); both ends of that veth are shaped with tbf at the given rate, so a
rank's link carries `rate` out (its end) and `rate` in (the bridge's end, egress towards the rank), and
two senders to one receiver share the receiver's rate. netem is not needed and tbf is all it uses.

Names start with `mwl<pid><letter>` (pid of the process that made them): a later run, or
`python -m moewatch.runtime.netlinks cleanup`, removes what a killed owner left, and never what a live
process still uses. Traffic only flows between addresses made here, inside those namespaces.

Entry points: `check_can_emulate` (one-line LinkError without root or iproute2), `create(W, rate)`,
`measure(links)` (the achieved rate of every rank's link, out and in), `destroy(links)`,
`enter(namespace)` (the calling thread joins a namespace: a rank before it starts gloo).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

PREFIX = "mwl"
NETNS_DIR = "/var/run/netns"
CLONE_NEWNET = 0x40000000
_SUBNET = "10.213"
_LEFTOVER = re.compile(rf"^{PREFIX}(\d+)[a-z]")
_counter = itertools.count()


class LinkError(RuntimeError):
    """Emulated links cannot be made or used here; the message is one line for the operator."""


@dataclass
class EmulatedLinks:
    tag: str
    world_size: int
    rate_mbit: float
    bridge_namespace: str
    namespaces: list[str]  # [W] the namespace of each rank
    interfaces: list[str]  # [W] each rank's end of its veth (GLOO_SOCKET_IFNAME)
    addresses: list[str]  # [W] each rank's address
    # Measured by `measure` (bytes per second): [W] out of each rank, [W] into each rank, [W] the lesser.
    egress_bytes_per_second: list[float] = field(default_factory=list)
    ingress_bytes_per_second: list[float] = field(default_factory=list)
    link_bytes_per_second: list[float] = field(default_factory=list)
    measure_bytes: int = 0

    def summary(self) -> dict:
        out = asdict(self)
        out["rate_bytes_per_second"] = self.rate_mbit * 1e6 / 8
        if self.link_bytes_per_second:
            out["achieved_over_rate"] = [v / out["rate_bytes_per_second"] for v in self.link_bytes_per_second]
        return out


def check_can_emulate() -> None:
    """Raise LinkError (one line) unless this process can make namespaces and shape links."""
    if os.geteuid() != 0:
        raise LinkError("emulated links need root (network namespaces, veth and tc); run as root or leave "
                        "out --link-rate")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise LinkError(f"emulated links need {' and '.join(f'`{t}`' for t in missing)} (iproute2) on PATH")


def _run(*args: str) -> None:
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode:
        raise LinkError(f"`{' '.join(args)}` failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")


def _burst_bytes(rate_mbit: float) -> int:
    # One millisecond of the rate (32 KB at least): what passes unshaped at once. Transfers much larger
    # than this see the rate; smaller ones go out faster than it (benchmarks move megabytes).
    return max(32768, int(rate_mbit * 1e6 / 8 / 1000))


def _shape(namespace: str, interface: str, rate_mbit: float) -> None:
    _run("tc", "-n", namespace, "qdisc", "replace", "dev", interface, "root", "tbf", "rate", f"{rate_mbit}mbit",
         "burst", str(_burst_bytes(rate_mbit)), "latency", "50ms")


# Per namespace (these settings are the namespace's own): an exchange every layer after a pause of
# compute must not restart TCP from slow start each time, or every transfer pays a ramp-up that no
# schedule can remove.
TCP_SETTINGS = {"net.ipv4.tcp_slow_start_after_idle": "0"}


def _tune_tcp(namespace: str) -> None:
    for key, value in TCP_SETTINGS.items():
        path = "/proc/sys/" + key.replace(".", "/")
        _run("ip", "netns", "exec", namespace, "sh", "-c", f"echo {value} > {path}")


def create(world_size: int, rate_mbit: float) -> EmulatedLinks:
    """Make the namespaces, the bridge and the shaped veths of a group of world_size ranks. On any
    failure everything made so far is removed before LinkError is raised."""
    check_can_emulate()
    if world_size < 1 or world_size > 250:
        raise LinkError(f"emulated links: {world_size} ranks is outside 1..250")
    if not rate_mbit > 0:
        raise LinkError(f"emulated links: rate {rate_mbit} Mbit/s must be positive")
    cleanup_leftovers()
    tag = f"{PREFIX}{os.getpid()}{chr(97 + next(_counter) % 26)}"
    links = EmulatedLinks(tag, world_size, float(rate_mbit), f"{tag}b", [f"{tag}r{i}" for i in range(world_size)],
                          [f"{tag}v{i}" for i in range(world_size)],
                          [f"{_SUBNET}.{i // 250}.{i % 250 + 1}" for i in range(world_size)])
    try:
        bridge_ns = links.bridge_namespace
        _run("ip", "netns", "add", bridge_ns)
        _run("ip", "-n", bridge_ns, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", bridge_ns, "link", "set", "br0", "up")
        for i in range(world_size):
            ns, inner, outer = links.namespaces[i], links.interfaces[i], f"{tag}p{i}"
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", inner, "type", "veth", "peer", "name", outer)
            _run("ip", "link", "set", inner, "netns", ns)
            _run("ip", "link", "set", outer, "netns", bridge_ns)
            _run("ip", "-n", bridge_ns, "link", "set", outer, "master", "br0")
            _run("ip", "-n", bridge_ns, "link", "set", outer, "up")
            _run("ip", "-n", ns, "addr", "add", f"{links.addresses[i]}/16", "dev", inner)
            _run("ip", "-n", ns, "link", "set", inner, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _tune_tcp(ns)
            _shape(ns, inner, rate_mbit)  # what the rank sends
            _shape(bridge_ns, outer, rate_mbit)  # what the rank receives
    except BaseException:
        destroy(links)
        raise
    return links


def destroy(links: EmulatedLinks) -> None:
    """Remove the group's namespaces (their veths go with them) and any veth still outside one."""
    for ns in [*links.namespaces, links.bridge_namespace]:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    for i in range(links.world_size):
        for name in (links.interfaces[i], f"{links.tag}p{i}"):
            if os.path.exists(f"/sys/class/net/{name}"):
                subprocess.run(["ip", "link", "del", name], capture_output=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_leftovers(include_live: bool = False) -> list[str]:
    """Remove namespaces and root-namespace veths named by a dead owner (or by anyone, with
    include_live: an operator's last resort). Returns what was removed."""
    if shutil.which("ip") is None:
        return []
    removed = []
    names = os.listdir(NETNS_DIR) if os.path.isdir(NETNS_DIR) else []
    links = os.listdir("/sys/class/net") if os.path.isdir("/sys/class/net") else []
    for kind, name in [("netns", n) for n in names] + [("link", n) for n in links]:
        match = _LEFTOVER.match(name)
        if not match or (not include_live and _alive(int(match.group(1)))):
            continue
        args = ["ip", "netns", "del", name] if kind == "netns" else ["ip", "link", "del", name]
        if subprocess.run(args, capture_output=True).returncode == 0:
            removed.append(name)
    return removed


def enter(namespace: str) -> None:
    """Move the calling thread into a namespace made here (threads it starts afterwards follow it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(os.path.join(NETNS_DIR, namespace), os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise LinkError(f"cannot enter network namespace {namespace}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _transfer(links: EmulatedLinks, src: int, dst: int, nbytes: int, port: int = 29400) -> float:
    """Seconds the receiver took to get nbytes from src over their links (first byte to last)."""
    ready, result, errors = threading.Event(), {}, []

    def receive() -> None:
        try:
            enter(links.namespaces[dst])
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
                server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                server.bind((links.addresses[dst], port))
                server.listen(1)
                ready.set()
                server.settimeout(30)
                conn, _ = server.accept()
                with conn:
                    conn.settimeout(30)
                    got, first = 0, None
                    while got < nbytes:
                        chunk = conn.recv(1 << 20)
                        if not chunk:
                            break
                        if first is None:
                            first = time.monotonic()
                        got += len(chunk)
                    result["seconds"] = time.monotonic() - first if first is not None else float("nan")
                    result["bytes"] = got
        except BaseException as exc:  # reported below, in the caller's thread
            errors.append(exc)
            ready.set()

    def send() -> None:
        try:
            enter(links.namespaces[src])
            with socket.create_connection((links.addresses[dst], port), timeout=30) as conn:
                block = b"\0" * (1 << 20)
                left = nbytes
                while left > 0:
                    conn.sendall(block[:min(left, len(block))])
                    left -= min(left, len(block))
        except BaseException as exc:
            errors.append(exc)

    receiver = threading.Thread(target=receive, daemon=True)
    receiver.start()
    ready.wait(30)
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    sender.join(60)
    receiver.join(60)
    if errors or result.get("bytes") != nbytes:
        raise LinkError(f"measuring the link {src} -> {dst} failed: {errors[0] if errors else 'short transfer'}")
    return result["seconds"]


def measure(links: EmulatedLinks, seconds: float = 0.3) -> EmulatedLinks:
    """Measure each rank's achieved rate out (to the next rank) and in (from the one before), one
    transfer at a time so no two share a link; fills the *_bytes_per_second lists and returns links."""
    rate = links.rate_mbit * 1e6 / 8
    nbytes = int(min(max(rate * seconds, 1 << 18), 64 << 20))
    W = links.world_size
    out, into = [float("nan")] * W, [float("nan")] * W
    if W > 1:
        for src in range(W):
            dst = (src + 1) % W
            achieved = nbytes / _transfer(links, src, dst, nbytes)
            out[src] = achieved
            into[dst] = achieved
    links.egress_bytes_per_second = out
    links.ingress_bytes_per_second = into
    links.link_bytes_per_second = [min(a, b) for a, b in zip(out, into)]
    links.measure_bytes = nbytes
    return links


@contextlib.contextmanager
def emulated_links(world_size: int, rate_mbit: float):
    """Create and measure the links, yield them, and remove them however the block ends: an exception,
    SIGTERM or SIGHUP (turned into SystemExit while the links exist, so the cleanup runs), or the
    interpreter exiting (atexit). A SIGKILL leaves them to the next run's `cleanup_leftovers`."""
    previous = {}
    if threading.current_thread() is threading.main_thread():
        def leave(signum, frame):
            raise SystemExit(128 + signum)
        for signum in (signal.SIGTERM, signal.SIGHUP):
            previous[signum] = signal.signal(signum, leave)
    links = None
    try:
        links = create(world_size, rate_mbit)
        atexit.register(destroy, links)
        measure(links)
        yield links
    finally:
        if links is not None:
            destroy(links)
            atexit.unregister(destroy)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def main(argv: list[str]) -> int:
    """`python -m moewatch.runtime.netlinks cleanup [--all]`: remove leftovers (of dead owners; --all: every one)."""
    if not argv or argv[0] != "cleanup" or argv[1:] not in ([], ["--all"]):
        print("usage: python -m moewatch.runtime.netlinks cleanup [--all]", file=sys.stderr)
        return 2
    try:
        check_can_emulate()
    except LinkError as exc:
        print(f"netlinks: {exc}", file=sys.stderr)
        return 2
    for name in cleanup_leftovers(include_live=argv[1:] == ["--all"]):
        print(f"removed {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
