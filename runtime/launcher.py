"""Spawn the EP group on this machine and drive a workload: the library form of `moewatch runtime`.

`launch(config) -> RuntimeResult` spawns `config.ranks` processes with torch.multiprocessing (gloo on
the CPU, NCCL on GPUs, MASTER_PORT picked free), runs the step loop on each and returns what rank 0
measured plus every rank's pair accounting. `run_group(world_size, fn, args)` is the bare form: it
runs fn(rank, world_size, *args) in an initialised process group and returns the results by rank.

The step loop, per step: control boundary (stop and plans agreed over the group, a bounded part of a
migration) -> the workload's batch -> forward with the probe -> the probe's flush when due.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import queue as queue_module
import signal
import socket
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moewatch import wire
from moewatch.plan import Plan

from .config import RuntimeConfig, validate
from .control import PlanApplier
from .ep_rank import EPEngine
from .model import input_batch
from .netlinks import EmulatedLinks, emulated_links
from .netlinks import enter as enter_namespace
from .probe import RUNTIME_NAME, Probe, ProbeConfig
from .sender import Sender
from .slowdown import Slowdown
from .workload import Workload

log = logging.getLogger("moewatch.runtime.launcher")


class GroupError(RuntimeError):
    """A rank of a spawned group failed; the message carries its traceback."""


class PeerLost(RuntimeError):
    """A collective failed on this rank (a peer died, or hung past the group's timeout): the group
    is gone. The message names the epoch whose placement this rank kept."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def core_binding(world_size: int, threads_per_rank: int | None = None,
                 cores: list[int] | None = None) -> dict[str, Any]:
    """How the ranks of a group go on this process's cores: {"pinned", "rank_cores" ([W] lists of core
    ids, or None), "threads_per_rank", "cores", "warning"}.

    With at least one core per rank, rank r gets its own contiguous share of the cores (so the
    busiest rank, not the total work, sets the step) and one intra-op thread by default; with fewer
    cores than ranks nothing is pinned, each rank still gets one thread by default, the ranks
    time-share the cores, and the warning says the step no longer measures the busiest rank."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else sorted(cores)
    n = len(cores)
    if n >= world_size:
        share = n // world_size
        rank_cores = [cores[r * share:(r + 1) * share] for r in range(world_size)]
        return {"pinned": True, "rank_cores": rank_cores, "threads_per_rank": threads_per_rank or 1,
                "cores": n, "warning": None}
    return {"pinned": False, "rank_cores": None, "threads_per_rank": threads_per_rank or 1, "cores": n,
            "warning": f"{world_size} ranks share {n} cores: ranks time-share the cores, so the total work, "
                       "not the busiest rank, sets the step time"}


def rank_view(rank: int, world_size: int) -> dict[str, Any]:
    """What a rank of a group runs on: its allowed cores and torch's intra-op threads (a check)."""
    return {"rank": rank, "cores": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads()}


def _group_entry(rank: int, world_size: int, port: int, backend: str, fn: Callable, args: tuple,
                 results, threads: int, timeout_s: float, rank_cores: list | None = None,
                 links: EmulatedLinks | None = None) -> None:
    address = "127.0.0.1"
    if links is not None:
        # First of all, before any thread starts: the rank's own namespace; gloo on its veth.
        enter_namespace(links.namespaces[rank])
        address = links.addresses[0]
        os.environ["GLOO_SOCKET_IFNAME"] = links.interfaces[rank]
    os.environ["MASTER_ADDR"] = address
    os.environ["MASTER_PORT"] = str(port)
    if rank_cores is not None:
        os.sched_setaffinity(0, rank_cores[rank])  # before torch starts its thread pool
    torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, rank=rank, world_size=world_size, init_method=f"tcp://{address}:{port}",
                            timeout=timedelta(seconds=timeout_s))
    try:
        value = fn(rank, world_size, *args)
        # Plain pickle: torch's queue pickler would share tensors through fds that die with the rank.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:
        results.put((rank, False, pickle.dumps(traceback.format_exc())))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def terminate_ranks(processes) -> None:
    """Ask every live rank to stop (SIGTERM; the runtime's ranks finish their step first)."""
    for process in processes:
        if process.is_alive():
            try:
                os.kill(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


def run_group(world_size: int, fn: Callable, args: tuple = (), *, backend: str = "gloo",
              threads_per_rank: int | None = None, timeout_s: float = 120.0,
              on_interrupt: Callable[[list], None] | None = None, binding: dict | None = None,
              links: EmulatedLinks | None = None) -> list[Any]:
    """Run fn(rank, world_size, *args) on world_size spawned ranks; return the values by rank.

    Each rank is pinned to its own cores when there are enough (`core_binding`; pass `binding` to
    reuse one already computed); otherwise a warning is logged.

    on_interrupt(processes) is called when the launcher gets SIGINT or SIGTERM (default: forward
    SIGTERM to the ranks, which the runtime's ranks turn into a stop at the next step boundary).

    fn must be importable by name (a module-level function). A failing rank raises GroupError with
    its traceback, after the other ranks are terminated.

    links: run each rank in its namespace of these emulated links (runtime/netlinks.py), gloo bound
    to its veth and rank 0's address.
    """
    binding = core_binding(world_size, threads_per_rank) if binding is None else binding
    if binding["warning"]:
        log.warning("%s", binding["warning"])
    threads = binding["threads_per_rank"]
    on_interrupt = on_interrupt or terminate_ranks
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    context = mp.start_processes(_group_entry, args=(world_size, port, backend, fn, args, results, threads, timeout_s,
                                                     binding["rank_cores"], links),
                                 nprocs=world_size, join=False, start_method="spawn")
    values: dict[int, Any] = {}
    errors: dict[int, str] = {}

    def drain(block_s: float) -> None:
        try:
            while True:
                rank, ok, blob = results.get(timeout=block_s)
                (values if ok else errors)[rank] = pickle.loads(blob)
                block_s = 0.01
        except queue_module.Empty:
            pass

    # SIGINT / SIGTERM to the launcher: pass the request on and keep collecting, so the ranks stop
    # together at a step boundary and the result still comes back (no KeyboardInterrupt mid-drain).
    previous = {}
    if threading.current_thread() is threading.main_thread():
        def forward(signum, frame):
            if on_interrupt is not None:
                on_interrupt(context.processes)
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, forward)
    try:
        while True:
            try:
                if context.join(timeout=0.05):
                    break
            except Exception as exc:  # a rank raised or died: the others were terminated
                drain(0.5)
                detail = next(iter(errors.values()), str(exc))
                raise GroupError(f"a rank of the EP group failed:\n{detail}") from None
            drain(0.0)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for process in context.processes:
            if process.is_alive():
                process.kill()
    drain(0.5)
    if errors or len(values) != world_size:
        detail = next(iter(errors.values()), f"only ranks {sorted(values)} reported")
        raise GroupError(f"a rank of the EP group failed:\n{detail}")
    return [values[rank] for rank in range(world_size)]


# --- the runtime ----------------------------------------------------------------------------------

@dataclass
class RuntimeResult:
    steps: int
    measured_steps: int
    step_p50_s: float
    step_p99_s: float
    step_mean_s: float
    tokens_per_s: float
    tokens: int  # real tokens over all ranks and measured steps
    wall_seconds: float
    pairs_routed: int
    pairs_computed: int
    pairs_dropped: int
    pairs_rerouted: int
    pairs_lost: int  # routed - computed - dropped over all ranks and steps: 0 unless a pair went missing
    epoch: int
    placement: list  # [L][P] in force at the end
    capacity_factor: list
    plans_applied: int
    plans_refused: int
    plans_failed: int
    acks: list = field(default_factory=list)
    windows_built: int = 0
    windows_invalid: int = 0
    sender: dict | None = None
    windows: list = field(default_factory=list)  # Window dicts when config.return_windows
    step_seconds: list = field(default_factory=list)  # every step, slowest rank
    config: dict = field(default_factory=dict)
    # How ranks sat on cores: {"pinned", "rank_cores", "threads_per_rank", "cores", "warning"}
    cpu_binding: dict = field(default_factory=dict)
    # Emulated links (config.link_rate_mbit): names, rate asked, rates measured (netlinks.EmulatedLinks)
    links: dict | None = None
    # With config.a2a_log: per layer, the measured steps' mean row-exchange seconds (dispatch + combine,
    # from the last rank to arrive to the last to finish) and, with known link rates, the bound
    a2a: dict | None = None
    # With config.a2a_log: each rank's output of the last step (numpy), to compare runs (not in summary)
    outputs: list = field(default_factory=list)

    def summary(self) -> dict:
        """The JSON form printed by `moewatch runtime --json` (windows left out)."""
        out = asdict(self)
        out.pop("windows")
        out.pop("outputs")
        out.pop("step_seconds")
        out.pop("placement")
        return out


def launch(config: RuntimeConfig, on_interrupt: Callable | None = None,
           links: EmulatedLinks | None = None) -> RuntimeResult:
    """Validate, spawn the EP group, run the workload, return the measurements. links: emulated links
    already made and measured (a benchmark running several groups on one set); by default they are
    made for this run when config.link_rate_mbit is set, and removed after it."""
    validate(config)
    config = with_start_placement(config)
    if config.workload == "trace":
        from .workload import TraceRouting
        TraceRouting(config.trace, config.layers, config.experts, config.top_k, config.ranks)  # fail early
    binding = core_binding(config.ranks, config.threads_per_rank)
    if links is not None:
        if config.link_bytes_per_second is None:
            config = config.replace(link_bytes_per_second=list(links.link_bytes_per_second))
        per_rank = run_group(config.ranks, run_rank, (config,), backend=config.backend,
                             threads_per_rank=config.threads_per_rank, timeout_s=config.collective_timeout_s,
                             on_interrupt=on_interrupt, binding=binding, links=links)
        links_summary = links.summary()
    elif config.link_rate_mbit is None:
        per_rank = run_group(config.ranks, run_rank, (config,), backend=config.backend,
                             threads_per_rank=config.threads_per_rank,
                             timeout_s=config.collective_timeout_s, on_interrupt=on_interrupt, binding=binding)
        links_summary = None
    else:
        with emulated_links(config.ranks, config.link_rate_mbit) as links:
            if config.link_bytes_per_second is None:  # the bound at the rates measured, not the rate asked
                config = config.replace(link_bytes_per_second=list(links.link_bytes_per_second))
            per_rank = run_group(config.ranks, run_rank, (config,), backend=config.backend,
                                 threads_per_rank=config.threads_per_rank, timeout_s=config.collective_timeout_s,
                                 on_interrupt=on_interrupt, binding=binding, links=links)
            links_summary = links.summary()
    result = _merge(config, per_rank)
    result.cpu_binding = binding
    result.links = links_summary
    if config.a2a_log:
        result.outputs = [r["final_output"] for r in per_rank]
    return result


def with_start_placement(config: RuntimeConfig) -> RuntimeConfig:
    """The config with `hot_on_rank`'s skewed start written out as its placement (every rank must
    start from the same map, so it is worked out before the ranks start)."""
    if config.hot_on_rank is not None and config.placement is None:
        from .workload import hot_start_placement
        return config.replace(placement=hot_start_placement(config).tolist())
    return config


def _merge(cfg: RuntimeConfig, per_rank: list[dict]) -> RuntimeResult:
    head = per_rank[0]
    steps = len(head["step_seconds"])
    step_seconds = np.max(np.array([r["step_seconds"] for r in per_rank], dtype=np.float64).reshape(len(per_rank), steps),
                          axis=0) if steps else np.zeros(0)
    measured = step_seconds[cfg.warmup_steps:] if steps > cfg.warmup_steps else step_seconds
    tokens = sum(sum(r["step_tokens"][cfg.warmup_steps:] if steps > cfg.warmup_steps else r["step_tokens"])
                 for r in per_rank)
    wall = head["measured_wall_s"]
    pairs = {key: sum(r["pairs"][key] for r in per_rank) for key in ("routed", "returned", "dropped", "rerouted")}
    return RuntimeResult(
        steps=steps, measured_steps=len(measured),
        step_p50_s=float(np.percentile(measured, 50)) if len(measured) else 0.0,
        step_p99_s=float(np.percentile(measured, 99)) if len(measured) else 0.0,
        step_mean_s=float(measured.mean()) if len(measured) else 0.0,
        tokens_per_s=tokens / wall if wall > 0 else 0.0, tokens=int(tokens), wall_seconds=wall,
        pairs_routed=pairs["routed"], pairs_computed=pairs["returned"], pairs_dropped=pairs["dropped"],
        pairs_rerouted=pairs["rerouted"], pairs_lost=pairs["routed"] - pairs["returned"] - pairs["dropped"],
        epoch=head["epoch"], placement=head["placement"], capacity_factor=head["capacity_factor"],
        plans_applied=head["plans_applied"], plans_refused=head["plans_refused"], plans_failed=head["plans_failed"],
        acks=head["acks"], windows_built=head["windows_built"], windows_invalid=head["windows_invalid"],
        sender=head["sender"], windows=head["windows"], step_seconds=step_seconds.tolist(),
        config=cfg.to_dict(), a2a=_a2a_summary(cfg, per_rank, steps))


def _a2a_summary(cfg: RuntimeConfig, per_rank: list[dict], steps: int) -> dict | None:
    """Per layer over the measured steps: the row exchanges' seconds (each exchange from the last rank
    to start it to the last to finish it: ranks that arrive early wait, which is not the exchange's
    time) and the bound; None without cfg.a2a_log."""
    if not cfg.a2a_log or not steps:
        return None
    L = cfg.layers
    # [W, steps, L, phase, (start, end)]: every rank logs every layer's two exchanges every step.
    spans = np.array([[span[2:] for span in r["a2a_spans"]] for r in per_rank], dtype=np.float64)
    spans = spans.reshape(len(per_rank), steps, L, 2, 2)
    seconds = (spans[..., 1].max(axis=0) - spans[..., 0].max(axis=0)).sum(axis=2)  # [steps, L]
    first = cfg.warmup_steps if steps > cfg.warmup_steps else 0
    out = {"schedule": cfg.a2a_schedule, "schedule_at_end": per_rank[0]["a2a_schedule"],
           "measured_steps": steps - first,
           "output_digests": [r["output_digest"] for r in per_rank],
           "seconds_per_layer": seconds[first:].mean(axis=0).tolist(),
           "bound_seconds_per_layer": None, "over_bound_per_layer": None}
    bounds = per_rank[0]["a2a_bounds"]
    if bounds:
        bound = 2.0 * np.array([b[1] for b in bounds], dtype=np.float64).reshape(steps, L)[first:].mean(axis=0)
        out["bound_seconds_per_layer"] = bound.tolist()
        ratio = np.divide(seconds[first:].mean(axis=0), bound, out=np.zeros(L), where=bound > 0)
        out["over_bound_per_layer"] = ratio.tolist()
    return out


class _StopFlag:
    def __init__(self):
        self.requested = False

    def __call__(self, signum, frame) -> None:
        self.requested = True


def _device_for(cfg: RuntimeConfig, rank: int) -> torch.device:
    if cfg.backend == "nccl":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def build_probe(cfg: RuntimeConfig, rank: int, world_size: int, device: torch.device, sinks) -> Probe:
    element_bytes = torch.empty((), dtype=getattr(torch, cfg.dtype)).element_size()
    return Probe(ProbeConfig(
        num_layers=cfg.layers, num_experts=cfg.experts, num_slots=cfg.num_slots, top_k=cfg.top_k,
        hidden_bytes=cfg.hidden * element_bytes, ranks_per_node=cfg.node_size, model=cfg.model_name,
        ep_group=cfg.ep_group, runtime=RUNTIME_NAME, window_steps=cfg.effective_window_steps,
        window_seconds=cfg.window_seconds, traffic_max_ranks=cfg.traffic_max_ranks),
        rank=rank, world_size=world_size, device=device, sinks=sinks)


def run_rank(rank: int, world_size: int, cfg: RuntimeConfig, local_rank: int | None = None) -> dict:
    """The step loop of one rank (called inside an initialised process group). local_rank picks the
    GPU under torchrun (default: rank modulo the GPUs visible). Raises PeerLost when a collective
    fails, after answering a plan in flight with a failed Ack."""
    live: dict[str, Any] = {}
    try:
        return _run_rank(rank, world_size, cfg, rank if local_rank is None else local_rank, live)
    except (RuntimeError, OSError) as exc:
        if "controller" not in live or not (dist.is_initialized() and world_size > 1):
            raise
        # A peer is gone (gloo: connection closed, or the collective timed out): nothing more can be
        # agreed. Keep the placement in force, tell the agent, and leave without waiting on anyone.
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        live["controller"].peer_lost(why)
        if live.get("sender") is not None:
            live["sender"].close()
        raise PeerLost(f"rank {rank}: the EP group lost a peer ({why}); "
                       f"placement of epoch {live['controller'].engine.epoch} kept") from None


def _run_rank(rank: int, world_size: int, cfg: RuntimeConfig, local_rank: int, live: dict) -> dict:
    stop_flag = _StopFlag()
    signal.signal(signal.SIGTERM, stop_flag)
    signal.signal(signal.SIGINT, stop_flag)
    device = _device_for(cfg, local_rank)
    inbox: queue_module.Queue = queue_module.Queue()
    windows: list[dict] = []
    sinks: list = []
    sender = None
    engine_ref: list[EPEngine] = []
    step_ref = [0]
    if rank == 0:
        if cfg.socket:
            sender = Sender(
                cfg.socket, hello=lambda: _hello(cfg, engine_ref[0].epoch if engine_ref else 0),
                on_plan=inbox.put, queue_size=cfg.queue_size, heartbeat_seconds=cfg.heartbeat_seconds,
                heartbeat=lambda: wire.Heartbeat(time=time.time(), epoch=engine_ref[0].epoch if engine_ref else 0,
                                                 step=step_ref[0], frames_dropped=sender.stats.frames_dropped))
            sinks.append(sender.send_window)
        if cfg.windows_out:
            sinks.append(lambda w: _append_line(cfg.windows_out, w.to_json()))
        if cfg.return_windows:
            sinks.append(lambda w: windows.append(w.to_dict()))
    probe = build_probe(cfg, rank, world_size, device, sinks) if cfg.probe else None
    engine = EPEngine(cfg, rank, world_size, device=device, probe=probe)
    engine_ref.append(engine)
    if probe is not None:
        probe.set_placement(engine.epoch, engine.placement, engine.capacity)
    controller = PlanApplier(engine, probe=probe, inbox=inbox, ack=sender.send_control if sender else None,
                            layers_per_step=cfg.migrate_layers_per_step, inject_failure=cfg.inject_migration_failure)
    live.update(controller=controller, sender=sender)
    workload = Workload(cfg, rank)
    slowdown = Slowdown(rank, cfg.slow_rank, cfg.slow_factor, cfg.slowdown_file)
    scripted = sorted((int(step), plan) for step, plan in cfg.scripted_plans) if rank == 0 else []
    if sender is not None:
        sender.start()

    step_seconds: list[float] = []
    step_tokens: list[int] = []
    output = None
    digest = hashlib.sha256()
    started = time.perf_counter()
    measured_from = None
    step = 0
    while True:
        step_ref[0] = step
        while scripted and scripted[0][0] <= step:
            inbox.put(Plan.from_dict(scripted.pop(0)[1]))
        stop = bool(cfg.steps and step >= cfg.steps) or stop_flag.requested or (
            cfg.seconds is not None and time.perf_counter() - started >= cfg.seconds)
        if controller.boundary(step, stop):
            break
        if step == cfg.warmup_steps:
            measured_from = time.perf_counter()
        engine.slow_factor = slowdown.refresh()  # one stat per step, never per layer
        batch = workload.batch(step)
        x = input_batch(cfg.seed, step, rank, cfg.batch_tokens, cfg.hidden)
        t0 = time.perf_counter()
        if probe is not None:
            probe.begin_step(batch.num_tokens)
        output = engine.forward(x, batch.valid, batch.expert_ids)
        if probe is not None:
            probe.end_step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_seconds.append(time.perf_counter() - t0)
        step_tokens.append(batch.num_tokens)
        if cfg.a2a_log:  # outside the step's time: every step's output, to compare runs bit for bit
            digest.update(output.detach().cpu().numpy().tobytes())
        step += 1
    ended = time.perf_counter()
    if probe is not None:
        probe.flush()
    sender_stats = asdict(sender.close()) if sender is not None else None
    pairs = engine.pair_counts()
    return {
        "step_seconds": step_seconds, "step_tokens": step_tokens,
        "measured_wall_s": ended - (measured_from if measured_from is not None else started),
        "pairs": asdict(pairs), "epoch": engine.epoch, "placement": engine.placement.tolist(),
        "capacity_factor": engine.capacity.tolist(),
        "plans_applied": controller.applied, "plans_refused": controller.refused, "plans_failed": controller.failed,
        "acks": [asdict(a) for a in controller.acks],
        "windows_built": probe.windows_built if probe else 0,
        "windows_invalid": probe.windows_invalid if probe else 0,
        "sender": sender_stats, "windows": windows,
        "a2a_spans": engine.exchange.log.spans if engine.exchange.log is not None else [],
        "a2a_bounds": engine.bound_log,
        "a2a_schedule": engine.exchange.schedule,
        "output_digest": digest.hexdigest() if cfg.a2a_log else None,
        "final_output": output.detach().cpu().numpy() if cfg.a2a_log and output is not None else None,
    }


def _hello(cfg: RuntimeConfig, epoch: int) -> wire.Hello:
    return wire.Hello(runtime=RUNTIME_NAME, model=cfg.model_name, ep_group=cfg.ep_group, world_size=cfg.ranks,
                      num_layers=cfg.layers, num_experts=cfg.experts, num_slots=cfg.num_slots, epoch=epoch,
                      ranks_per_node=cfg.node_size, pid=os.getpid(), capabilities=("plan", "capacity", "schedule"))


def _append_line(path: str, line: str) -> None:
    with open(path, "a", encoding="utf-8") as out:
        out.write(line + "\n")


def result_json(result: RuntimeResult) -> str:
    return json.dumps(result.summary(), allow_nan=False)
