"""Record Windows from the reference runtime under injected faults, labelled by the injection: test
data for the triage (tests/data/fault_windows/, read by tests/core/test_fault_windows.py).

Run by hand, as root, on a machine with at least two otherwise idle cores; never in CI (it changes
cgroups and network namespaces, and its timings are only as clean as the machine is quiet):

    .venv/bin/python scripts/record_fault_windows.py                 # every case
    .venv/bin/python scripts/record_fault_windows.py --cases healthy,slow-link
    .venv/bin/python scripts/record_fault_windows.py --table         # print what the triage says of the files

Each case runs a 2-rank gloo group of `python -m moewatch.runtime` processes (the torchrun entry,
started here with torchrun's variables), rank r pinned to core r with one thread at nice NICE (ahead
of other work on a shared machine, so the injected fault is what the timings show), 4 MoE layers, 8
experts, top-2, uniform routing unless the case says otherwise. Rank 0 appends every Window to a
JSON-lines file (--windows-out); the first WARMUP windows are left out and the next ones saved as
<case>.json ({"case", "flags", "windows": [Window dicts]}). labels.json maps each case to the
verdict and cause the injection makes true, how the fault was made and when it was recorded.

Each recording is checked to be what it claims before it is saved: a quota case records SPARE
windows more and keeps the first `keep` in which the starved rank computed under SLOWER_AT_MOST of
the other rank's pairs per second of expert compute (a quota does not bind while other work already
holds the rank under it: such a window holds no fault; the ones left out are listed), and in every
other case but the slow device the ranks' speeds are within SPEED_SPREAD of each other. The speeds,
the machine's 1-minute load average before and after (other work on the machine skews timings) and
the nice level go into labels.json.

Cases and how each fault is made:
- healthy: no fault; expert compute dominates the layer.
- cpu-quota: rank 1's process (every thread) in a cgroup v1 CPU group held to 33 ms per 100 ms
  period, about a third of a core; the group is removed afterwards.
- cpu-quota-25, cpu-quota-50: the same at 25 and 50 ms per 100 ms period, with 8 MoE layers and 6
  windows each (where a starved rank's stalls land differs from layer to layer). At 75 ms the quota
  bound in 5 of 10 windows (a rank in lockstep with its peer uses about that much of its core, less
  when other work shares it): no reliable fault, so no such case.
- healthy-a2a, cpu-quota-a2a: no fault, and rank 1 at 33 ms per 100 ms, with FFN 512: the all-to-all
  a larger part of the layer (transfer about 0.4 of layer time when healthy), so that a starved
  rank's stalls inside the all-to-all can carry a layer past the communication bar.
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
SLOWER_AT_MOST = 0.9  # a quota case is saved only when its starved rank's relative speed is under this, every window
SPARE = 4  # windows recorded beyond `keep` in a quota case, for windows where the quota did not bind
NICE = -10  # ranks run ahead of other work on a shared machine, so the injected fault is what the timings show
SPEED_SPREAD = 0.15  # a case without a slowed rank is saved only when no rank is this much slower
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
    quota_us: int = QUOTA_US  # its CPU time per PERIOD_US
    keep: int = KEEP  # windows saved


CASES = {c.name: c for c in [
    Case("healthy", "healthy", None, "no fault: uniform routing, each rank on its own core"),
    Case("cpu-quota", "imbalance-bound", "straggler",
         f"rank 1's process in a cgroup v1 cpu group, cpu.cfs_quota_us={QUOTA_US} per "
         f"cpu.cfs_period_us={PERIOD_US} (a third of a core), written to cgroup.procs before exec",
         quota_rank=1),
    *[Case(f"cpu-quota-{quota}", "imbalance-bound", "straggler",
           f"rank 1's process in a cgroup v1 cpu group, cpu.cfs_quota_us={quota * 1000} per "
           f"cpu.cfs_period_us={PERIOD_US} ({quota} % of a core), written to cgroup.procs before exec; 8 layers",
           flags={"--layers": "8"}, quota_rank=1, quota_us=quota * 1000, keep=6)
      for quota in (25, 50)],
    Case("healthy-a2a", "healthy", None, "no fault: uniform routing, FFN 512 (all-to-all about 0.4 of layer time); 8 layers",
         flags={"--layers": "8", "--ffn": "512"}, keep=6),
    Case("cpu-quota-a2a", "imbalance-bound", "straggler",
         f"rank 1's process in a cgroup v1 cpu group, cpu.cfs_quota_us={QUOTA_US} per cpu.cfs_period_us={PERIOD_US} "
         "(a third of a core), written to cgroup.procs before exec; FFN 512 (all-to-all about 0.4 of layer time "
         "when healthy); 8 layers", flags={"--layers": "8", "--ffn": "512"}, quota_rank=1, keep=6),
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
def cpu_quota_group(quota_us: int):
    """A cgroup v1 cpu group held to quota_us per PERIOD_US; removed afterwards (its tasks have exited by then)."""
    CGROUP.mkdir(exist_ok=True)
    (CGROUP / "cpu.cfs_period_us").write_text(str(PERIOD_US))
    (CGROUP / "cpu.cfs_quota_us").write_text(str(quota_us))
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
    spare = SPARE if case.quota_rank is not None else 0
    flags["--steps"] = str(int(flags["--window-steps"]) * (WARMUP + case.keep + spare))
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
        os.nice(NICE)
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
            procs = stack.enter_context(cpu_quota_group(case.quota_us)) if case.quota_rank is not None else None
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
    kept = windows[WARMUP:]
    if len(kept) < min(6, case.keep):
        raise SystemExit(f"{case.name}: only {len(windows)} windows came out")
    return [w.to_dict() for w in kept]


def rank_speeds(windows: list[dict]) -> list[float]:
    """Each rank's pairs per second of expert compute over all the windows, relative to the fastest."""
    import numpy as np

    from moewatch import telemetry as tm

    parsed = [tm.Window.from_dict(d) for d in windows]
    pairs = sum(tm.rank_load(w).sum(axis=0) for w in parsed).astype(np.float64)
    seconds = sum(w.compute_seconds.sum(axis=0) for w in parsed)
    speed = pairs / seconds
    return [round(float(v), 3) for v in speed / speed.max()]


def check(case: Case, windows: list[dict]) -> tuple[list[dict], list[float]]:
    """The windows to save, and the starved rank's speed in each window left out. Refuses a recording
    that is not what its case claims (timings on a shared machine can lie): a window where the quota
    did not bind (other work already held both ranks under it) holds no fault, so a quota case keeps
    the first `keep` windows in which the starved rank computed under SLOWER_AT_MOST of the other's
    pairs per second, and says which it left out."""
    if case.quota_rank is not None:
        each = [rank_speeds([d])[case.quota_rank] for d in windows]
        bound = [d for d, speed in zip(windows, each) if speed < SLOWER_AT_MOST][:case.keep]
        if len(bound) < case.keep:
            raise SystemExit(f"{case.name}: the starved rank {case.quota_rank} computed at {each} of the fastest rank's "
                             f"pairs per second, window by window: under {SLOWER_AT_MOST} in {len(bound)}, "
                             f"{case.keep} needed; not saved")
        last = windows.index(bound[-1])
        return bound, [speed for speed in each[:last] if speed >= SLOWER_AT_MOST]
    windows = windows[:case.keep]
    speeds = rank_speeds(windows)
    if "--slow-rank" not in case.flags and min(speeds) < 1.0 - SPEED_SPREAD:
        raise SystemExit(f"{case.name}: rank speeds {speeds} (relative to the fastest) differ by more than "
                         f"{SPEED_SPREAD:.0%} without a slowed rank: the machine was busy; not saved")
    return windows, []


def save(case: Case, windows: list[dict], out: Path, load_before: float, load_after: float,
         speeds: list[float], left_out: list[float]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{case.name}.json").write_text(json.dumps({"case": case.name, "flags": case_flags(case), "windows": windows},
                                                      allow_nan=False) + "\n")
    labels_path = out / "labels.json"
    labels = json.loads(labels_path.read_text()) if labels_path.exists() else {}
    labels[case.name] = {"verdict": case.verdict, "cause": case.cause, "injection": case.injection,
                         "recorded": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                         # Other work on the machine skews timings: the 1-minute load average before the case
                         "load_before": round(load_before, 2), "load_after": round(load_after, 2), "nice": NICE,
                         # Pairs per second of expert compute over the saved windows, over the fastest rank's
                         "rank_speed": speeds}
    if case.quota_rank is not None:
        # Windows among the first saved ones' span where the quota did not bind: the starved rank's speed in each
        labels[case.name]["windows_left_out"] = left_out
    labels_path.write_text(json.dumps(dict(sorted(labels.items())), indent=2) + "\n")


def table(out: Path) -> str:
    """Per case and layer: the all-to-all shares, compute max/mean and today's verdict (window means)."""
    import numpy as np

    from moewatch import telemetry as tm
    from moewatch.triage import diagnose

    labels = json.loads((out / "labels.json").read_text())
    rows = ["| case | label | a2a_share | a2a_transfer_share | a2a_wait_share | compute max/mean | verdict today |",
            "|---|---|---|---|---|---|---|"]
    right = total = 0
    for name, label in labels.items():
        windows = [tm.Window.from_dict(d) for d in json.loads((out / f"{name}.json").read_text())["windows"]]

        def per_layer(fn) -> str:
            return " ".join(f"{v:.2f}" for v in np.mean([fn(w) for w in windows], axis=0))

        verdicts: dict[str, int] = {}
        for w in windows:
            for d in diagnose(w).layers:
                key = f"{d.verdict}/{d.cause}"
                verdicts[key] = verdicts.get(key, 0) + 1
                right += (d.verdict, d.cause) == (label["verdict"], label["cause"])
                total += 1
        today = ", ".join(f"{k} x{n}" for k, n in sorted(verdicts.items(), key=lambda kv: -kv[1]))
        rows.append(f"| {name} | {label['verdict']}/{label['cause']} | {per_layer(tm.a2a_share)} | "
                    f"{per_layer(tm.a2a_transfer_share)} | {per_layer(tm.a2a_wait_share)} | "
                    f"{per_layer(tm.compute_max_mean)} | {today} |")
    rows.append(f"\nlayers with their label: {right} of {total}")
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
        windows, left_out = check(CASES[name], windows)
        speeds = rank_speeds(windows)
        save(CASES[name], windows, args.out, load, os.getloadavg()[0], speeds, left_out)
        print(f"{name}: {len(windows)} windows in {time.monotonic() - started:.0f} s", flush=True)
    print(table(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
