"""Record Windows from the reference runtime under injected faults, labelled by the injection: test
data for the triage (tests/data/fault_windows/, read by tests/core/test_fault_windows.py).

Run by hand, as root, on a machine with at least two otherwise idle cores; never in CI (it changes
cgroups and network namespaces, and its timings are only as clean as the machine is quiet):

    .venv/bin/python scripts/record_fault_windows.py                 # every case
    .venv/bin/python scripts/record_fault_windows.py --cases healthy,slow-link
    .venv/bin/python scripts/record_fault_windows.py --table         # print what the triage says of the files

Each case runs a 2-rank gloo group of `python -m moewatch.runtime` processes (the torchrun entry,
started here with torchrun's variables), rank r pinned to core r with one thread, 4 MoE layers, 8
experts, top-2, uniform routing unless the case says otherwise. Rank 0 appends every Window to a
JSON-lines file (--windows-out); the first WARMUP windows are left out and the next ones saved as
<case>.json ({"case", "flags", "windows": [Window dicts]}). labels.json maps each case to the
verdict and cause the injection makes true, how the fault was made and when it was recorded.

Cases and how each fault is made:
- healthy: no fault; expert compute dominates the layer.
- cpu-quota: rank 1's process (every thread) in a cgroup v1 CPU group held to 33 ms per 100 ms
  period, about a third of a core; the group is removed afterwards.
- slow-device: rank 1 runs at --slow-factor 3 (the runtime's emulated slow device).
- slow-link: each rank in its own network namespace, joined by a veth pair whose two ends are both
  held to LINK_RATE by a tbf qdisc; gloo and the store use the veth (GLOO_SOCKET_IFNAME, MASTER_ADDR).
  Large hidden size, small FFN: the all-to-all moves MB per message and dominates the layer.
- hot-experts: two hot experts carry about 70 % of pairs and start on rank 0 (--hot-on-rank 0).
- small-batch: 8 tokens per rank per step: messages of a few KB, fixed per-collective cost dominates.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "fault_windows"
WARMUP = 2  # windows left out at the start (first-touch allocations, thread pools, the throttle settling)
KEEP = 8
WORLD = 2
CGROUP = Path("/sys/fs/cgroup/cpu/moewatch-fault-quota")
QUOTA_US, PERIOD_US = 33000, 100000
NAMESPACES = ("moewatch-fault-ns0", "moewatch-fault-ns1")
VETH = ("mwfault0", "mwfault1")
ADDRESSES = ("10.213.0.1", "10.213.0.2")
LINK_RATE = "400mbit"

# Common sizes: compute-heavy enough that a healthy layer is mostly expert compute.
BASE = {"--layers": "4", "--experts": "8", "--top-k": "2", "--hidden": "256", "--ffn": "1024",
        "--batch-tokens": "1024", "--zipf": "0", "--window-steps": "10", "--threads-per-rank": "1",
        "--warmup-steps": "0", "--collective-timeout": "60"}


@dataclass
class Case:
    name: str
    verdict: str
    cause: str | None
    injection: str
    flags: dict[str, str] = field(default_factory=dict)  # on top of BASE
    namespaces: bool = False  # each rank in its own network namespace over the shaped veth
    quota_rank: int | None = None  # this rank's process goes into the CPU-quota cgroup


CASES = {c.name: c for c in [
    Case("healthy", "healthy", None, "no fault: uniform routing, each rank on its own core"),
    Case("cpu-quota", "imbalance-bound", "straggler",
         f"rank 1's process in a cgroup v1 cpu group, cpu.cfs_quota_us={QUOTA_US} per "
         f"cpu.cfs_period_us={PERIOD_US} (a third of a core), written to cgroup.procs before exec",
         quota_rank=1),
    Case("slow-device", "imbalance-bound", "straggler",
         "rank 1 at --slow-rank 1 --slow-factor 3: its expert kernel runs three times (emulated slow device)",
         flags={"--slow-rank": "1", "--slow-factor": "3"}),
    Case("slow-link", "comm-bound", "volume",
         f"each rank in its own network namespace, joined by a veth pair, both ends shaped to {LINK_RATE} "
         "(tc tbf); gloo bound to the veth; hidden 2048 (8 KB per pair), FFN 64",
         flags={"--hidden": "2048", "--ffn": "64", "--batch-tokens": "256"}, namespaces=True),
    Case("hot-experts", "imbalance-bound", "hot-experts",
         "two hot experts carrying 70 % of pairs (--hot-experts 2 --hot-share 0.7), both starting on rank 0",
         flags={"--hot-experts": "2", "--hot-share": "0.7", "--hot-on-rank": "0"}),
    Case("small-batch", "comm-bound", "small-batch",
         "8 tokens per rank per step, hidden 256, FFN 128: a few KB per rank-to-rank message",
         flags={"--batch-tokens": "8", "--ffn": "128", "--window-steps": "40"}),
]}


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(argv), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()}")
    return done


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def cpu_quota_group():
    """A cgroup v1 cpu group at a third of a core; removed afterwards (its tasks have exited by then)."""
    CGROUP.mkdir(exist_ok=True)
    (CGROUP / "cpu.cfs_period_us").write_text(str(PERIOD_US))
    (CGROUP / "cpu.cfs_quota_us").write_text(str(QUOTA_US))
    try:
        yield CGROUP / "cgroup.procs"
    finally:
        for _ in range(50):  # rmdir fails while an exiting task is still listed
            try:
                CGROUP.rmdir()
                break
            except OSError:
                time.sleep(0.1)


@contextlib.contextmanager
def shaped_link():
    """Two network namespaces joined by a veth pair, each end's egress held to LINK_RATE."""
    teardown_link()
    try:
        for ns in NAMESPACES:
            run("ip", "netns", "add", ns)
            run("ip", "-n", ns, "link", "set", "lo", "up")
        run("ip", "link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1])
        for ns, dev, addr in zip(NAMESPACES, VETH, ADDRESSES):
            run("ip", "link", "set", dev, "netns", ns)
            run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            run("ip", "-n", ns, "link", "set", dev, "up")
            # burst above one 64 KB GSO segment so tbf never has to drop a whole one
            run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", LINK_RATE,
                "burst", "128kb", "latency", "400ms")
        yield
    finally:
        teardown_link()


def teardown_link() -> None:
    for ns in NAMESPACES:  # deleting a namespace deletes the veth end inside it, and so the pair
        run("ip", "netns", "del", ns, check=False)


def case_flags(case: Case) -> dict[str, str]:
    flags = {**BASE, **case.flags}
    # The run ends on a window boundary: no partial last window.
    flags["--steps"] = str(int(flags["--window-steps"]) * (WARMUP + KEEP))
    return flags


def rank_command(case: Case, rank: int, windows_out: Path, port: int) -> tuple[list[str], dict[str, str]]:
    flags = [part for item in case_flags(case).items() for part in item]
    if rank == 0:
        flags += ["--windows-out", str(windows_out), "--json"]
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
    command = [sys.executable, "-m", "moewatch.runtime", *flags]
    if case.namespaces:
        # Two hosts over one link: each namespace is a node of one rank.
        env.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR=ADDRESSES[0], GLOO_SOCKET_IFNAME=VETH[rank])
        command = ["ip", "netns", "exec", NAMESPACES[rank], *command]
    else:
        env.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1")
    return command, env


def start_rank(command: list[str], env: dict, core: int, cgroup_procs: Path | None, log) -> subprocess.Popen:
    def enter() -> None:  # in the child, before exec: what it and its threads inherit
        os.sched_setaffinity(0, {core})
        if cgroup_procs is not None:
            cgroup_procs.write_text(str(os.getpid()))
    return subprocess.Popen(command, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, preexec_fn=enter)


def record(case: Case, timeout_s: float) -> list[dict]:
    from moewatch.telemetry import Window

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < WORLD:
        raise SystemExit(f"needs {WORLD} cores, this process may use {cores}")
    with tempfile.TemporaryDirectory(prefix=f"fault-{case.name}-") as tmp:
        windows_out = Path(tmp) / "windows.jsonl"
        with contextlib.ExitStack() as stack:
            procs = stack.enter_context(cpu_quota_group()) if case.quota_rank is not None else None
            if case.namespaces:
                stack.enter_context(shaped_link())
            port = free_port()
            ranks = []
            for rank in range(WORLD):
                command, env = rank_command(case, rank, windows_out, port)
                log = stack.enter_context(open(Path(tmp) / f"rank{rank}.log", "w"))
                ranks.append(start_rank(command, env, cores[rank], procs if rank == case.quota_rank else None, log))
            deadline = time.monotonic() + timeout_s
            for proc in ranks:
                try:
                    proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    for p in ranks:
                        p.kill()
                    proc.wait()
            logs = {r: (Path(tmp) / f"rank{r}.log").read_text() for r in range(WORLD)}
            if any(p.returncode != 0 for p in ranks):
                detail = "\n".join(f"--- rank {r} (exit {p.returncode}) ---\n{logs[r][-3000:]}"
                                   for r, p in enumerate(ranks))
                raise SystemExit(f"{case.name}: a rank failed\n{detail}")
        lines = windows_out.read_text().splitlines() if windows_out.exists() else []
    windows = [Window.from_json(line) for line in lines]  # validated: a bad window fails the recording
    kept = windows[WARMUP:WARMUP + KEEP]
    if len(kept) < 6:
        raise SystemExit(f"{case.name}: only {len(windows)} windows came out")
    return [w.to_dict() for w in kept]


def save(case: Case, windows: list[dict], out: Path, load_before: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{case.name}.json").write_text(json.dumps({"case": case.name, "flags": case_flags(case), "windows": windows},
                                                      allow_nan=False) + "\n")
    labels_path = out / "labels.json"
    labels = json.loads(labels_path.read_text()) if labels_path.exists() else {}
    labels[case.name] = {"verdict": case.verdict, "cause": case.cause, "injection": case.injection,
                         "recorded": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                         # Other work on the machine skews timings: the 1-minute load average before the case
                         "load_before": round(load_before, 2)}
    labels_path.write_text(json.dumps(dict(sorted(labels.items())), indent=2) + "\n")


def table(out: Path) -> str:
    """Per case and layer: the all-to-all shares, compute max/mean and today's verdict (window means)."""
    import numpy as np

    from moewatch import telemetry as tm
    from moewatch.triage import diagnose

    labels = json.loads((out / "labels.json").read_text())
    rows = ["| case | label | a2a_share | a2a_transfer_share | a2a_wait_share | compute max/mean | verdict today |",
            "|---|---|---|---|---|---|---|"]
    for name, label in labels.items():
        windows = [tm.Window.from_dict(d) for d in json.loads((out / f"{name}.json").read_text())["windows"]]

        def per_layer(fn) -> str:
            return " ".join(f"{v:.2f}" for v in np.mean([fn(w) for w in windows], axis=0))

        verdicts: dict[str, int] = {}
        for w in windows:
            for d in diagnose(w).layers:
                key = f"{d.verdict}/{d.cause}"
                verdicts[key] = verdicts.get(key, 0) + 1
        today = ", ".join(f"{k} x{n}" for k, n in sorted(verdicts.items(), key=lambda kv: -kv[1]))
        rows.append(f"| {name} | {label['verdict']}/{label['cause']} | {per_layer(tm.a2a_share)} | "
                    f"{per_layer(tm.a2a_transfer_share)} | {per_layer(tm.a2a_wait_share)} | "
                    f"{per_layer(tm.compute_max_mean)} | {today} |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated, from: " + ", ".join(CASES))
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per case before its ranks are killed")
    parser.add_argument("--table", action="store_true", help="only print the triage table of the recorded files")
    args = parser.parse_args()
    if args.table:
        print(table(args.out))
        return 0
    if os.geteuid() != 0:
        raise SystemExit("run as root: the cases change cgroups and network namespaces")
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    for name in names:
        started, load = time.monotonic(), os.getloadavg()[0]
        windows = record(CASES[name], args.timeout)
        save(CASES[name], windows, args.out, load)
        print(f"{name}: {len(windows)} windows in {time.monotonic() - started:.0f} s", flush=True)
    print(table(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
