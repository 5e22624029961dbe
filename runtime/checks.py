"""Self-checks of the EP runtime, run inside a process group (gloo in the tests, NCCL on a GPU).

Each function is a group worker `fn(rank, world_size, ...)` for `launcher.run_group`. They measure
and return raw facts (differences, counts, acks, windows, routing); the tests and gpu_check.py judge
them. Nothing here asserts, so a broken runtime shows up as wrong numbers, not as a crash.
"""

from __future__ import annotations

import queue
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from moewatch.plan import Plan

from .config import RuntimeConfig
from .control import PlanApplier
from .ep_rank import EPEngine
from .launcher import build_probe
from .model import ModelSpec, init_experts, input_batch, reference_forward
from .workload import Workload


def replicated_placement(num_layers: int, num_experts: int, num_slots: int, seed: int) -> np.ndarray:
    """[L, P] every expert once plus P - E extra replicas, shuffled: replicas land on the same rank as
    their twin or on others, and (with nodes) on the same node or not."""
    rows = []
    for layer in range(num_layers):
        rng = np.random.default_rng([seed, layer])
        extras = rng.choice(num_experts, size=num_slots - num_experts, replace=False) \
            if num_slots - num_experts <= num_experts else rng.integers(0, num_experts, num_slots - num_experts)
        rows.append(rng.permutation(np.concatenate([np.arange(num_experts), extras])))
    return np.stack(rows).astype(np.int64)


def _device(cfg: RuntimeConfig, rank: int) -> torch.device:
    return torch.device("cuda", rank % torch.cuda.device_count()) if cfg.backend == "nccl" else torch.device("cpu")


def _gather(obj: Any, world_size: int) -> list[Any]:
    if world_size == 1 and not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


def _batch(cfg: RuntimeConfig, rank: int, step: int):
    batch = Workload(cfg, rank).batch(step)
    x = input_batch(cfg.seed, step, rank, cfg.batch_tokens, cfg.hidden)
    return x, batch.valid, batch.expert_ids


def reference_modes(rank: int, world_size: int, cfg: RuntimeConfig, modes: dict[str, dict]) -> dict | None:
    """EP output against the single-process reference, per mode (a dict of config overrides).

    Returns on rank 0, per mode: the largest absolute difference over all ranks' outputs, the
    output's scale, and the pair accounting summed over ranks.
    """
    device = _device(cfg, rank)
    report = {}
    for name, changes in modes.items():
        c = cfg.replace(**changes)
        engine = EPEngine(c, rank, world_size, device=device)
        x, valid, ids = _batch(c, rank, step=1)
        out = engine.forward(x, valid, ids).float().cpu()
        pairs = engine.pair_counts()
        gathered = _gather((x, valid, ids, out, pairs), world_size)
        if rank != 0:
            continue
        spec = ModelSpec.from_config(c)
        worst, scale = 0.0, 0.0
        for xr, vr, idr, outr, _ in gathered:
            expected, _ = reference_forward(spec, xr, vr, idr, [c.capacity_factor] * c.layers, c.overflow)
            worst = max(worst, float((outr - expected).abs().max()))
            scale = max(scale, float(expected.abs().max()))
        report[name] = {
            "max_abs_diff": worst, "scale": scale,
            "routed": sum(p.routed for *_, p in gathered), "computed": sum(p.returned for *_, p in gathered),
            "dropped": sum(p.dropped for *_, p in gathered), "rerouted": sum(p.rerouted for *_, p in gathered),
        }
    return report if rank == 0 else None


def probe_counts(rank: int, world_size: int, cfg: RuntimeConfig, steps: int) -> dict | None:
    """Run `steps` steps with the probe; return the Window and every rank's raw routing (rank 0).

    routing[rank][step][layer] = (ids [N, k], valid [N], scores [N, E], assigned [N, k]) so a test
    can recount everything without the runtime's code.
    """
    device = _device(cfg, rank)
    windows: list[dict] = []
    probe = build_probe(cfg.replace(window_steps=steps + 1), rank, world_size, device,
                        sinks=[lambda w: windows.append(w.to_dict())])
    engine = EPEngine(cfg, rank, world_size, device=device, probe=probe)
    probe.set_placement(engine.epoch, engine.placement, engine.capacity)
    engine.routing_log = []
    routing = []
    for step in range(steps):
        x, valid, ids = _batch(cfg, rank, step)
        probe.begin_step(int(valid.sum()))
        engine.forward(x, valid, ids)
        probe.end_step()
        layers = []
        for layer, r, fate, _ in engine.routing_log:
            layers.append((r.ids.cpu(), valid.clone(), r.scores.cpu(), r.assigned.cpu()))
        engine.routing_log.clear()
        routing.append(layers)
    window = probe.flush()
    gathered = _gather(routing, world_size)
    if rank != 0:
        return None
    return {"window": window.to_dict() if window is not None else None, "windows_from_sinks": windows,
            "routing": gathered, "placement": engine.placement.tolist(), "invalid": probe.windows_invalid,
            "last_error": probe.last_error}


def _weights_match(engine: EPEngine) -> bool:
    """Every local slot holds bit for bit the weights of the expert the placement says it holds."""
    for layer, state in enumerate(engine.layers):
        experts = state.pmap_row[engine.local_slots.start:engine.local_slots.stop]
        w13, w2 = init_experts(engine.spec, layer, experts, engine.device, engine.dtype)
        if not (torch.equal(w13, state.w13) and torch.equal(w2, state.w2)):
            return False
    return True


def live_plans(rank: int, world_size: int, cfg: RuntimeConfig, new_map: list, fail_map: list) -> dict:
    """Apply a live placement change, a stale plan and a plan whose migration fails on the last rank.

    Returns per rank: outputs of one fixed batch before and after the change, whether weights match
    the placement after each phase, the epochs and placements, and (rank 0) the acks.
    """
    device = _device(cfg, rank)
    engine = EPEngine(cfg, rank, world_size, device=device)
    inbox: queue.Queue = queue.Queue()
    controller = PlanApplier(engine, inbox=inbox, layers_per_step=cfg.migrate_layers_per_step,
                            inject_failure={"rank": world_size - 1, "epoch": 3, "stage": "transfer"})
    x, valid, ids = _batch(cfg, rank, step=7)
    before = engine.forward(x, valid, ids).float().cpu()
    capacity = [0.0] * cfg.layers
    step = 0

    def settle(plan: Plan | None) -> int:
        nonlocal step
        if rank == 0 and plan is not None:
            inbox.put(plan)
        boundaries = 0
        while True:  # boundaries until nothing is in flight on any rank
            controller.boundary(step)
            step += 1
            boundaries += 1
            busy = torch.tensor([int(controller.migration is not None or not inbox.empty())], device=device)
            if dist.is_initialized():
                dist.all_reduce(busy)
            if not int(busy):
                return boundaries

    old_map = engine.placement.tolist()
    boundaries = settle(Plan(1, new_map, capacity, reason="move"))
    after = engine.forward(x, valid, ids).float().cpu()
    moved = {"epoch": engine.epoch, "placement": engine.placement.tolist(), "weights_match": _weights_match(engine),
             "boundaries": boundaries}
    settle(Plan(1, old_map, capacity, reason="stale"))
    stale = {"epoch": engine.epoch, "placement": engine.placement.tolist()}
    settle(Plan(3, fail_map, capacity, reason="will fail"))
    failed = {"epoch": engine.epoch, "placement": engine.placement.tolist(), "weights_match": _weights_match(engine)}
    still = engine.forward(x, valid, ids).float().cpu()
    return {"rank": rank, "old_map": old_map, "before": before, "after": after, "after_failure": still,
            "moved": moved, "stale": stale, "failed": failed,
            "acks": [a.__dict__ for a in controller.acks]}


def suite(rank: int, world_size: int, cfg: RuntimeConfig, modes: dict[str, dict], probe_cfg: RuntimeConfig,
          probe_steps: int, new_map: list, fail_map: list) -> dict | None:
    """All three checks in one spawned group (process start-up is the expensive part)."""
    out = {"reference": reference_modes(rank, world_size, cfg, modes),
           "probe": probe_counts(rank, world_size, probe_cfg, probe_steps)}
    live = live_plans(rank, world_size, cfg, new_map, fail_map)
    out["live"] = _gather(live, world_size)
    return out if rank == 0 else None


def window_facts(window_dict: dict, steps: int, top_k: int) -> dict:
    """Facts about a probe window that hold for any routing: the contract (validation), every phase
    timed, phases inside their layer, every real token's pairs counted once."""
    from moewatch.telemetry import Window

    w = Window.from_dict(window_dict)
    phases = w.dispatch_seconds + w.compute_seconds + w.combine_seconds
    facts = {
        "steps": w.steps,
        "timed": bool(all(np.all(getattr(w, n) > 0) for n in
                          ("dispatch_seconds", "compute_seconds", "combine_seconds", "layer_seconds"))),
        "phases_inside_layer": bool(np.all(phases <= w.layer_seconds * (1 + 1e-6) + 1e-9)),
        "pairs_counted": int(w.expert_tokens.sum()) == int(w.step_tokens.sum()) * top_k * w.num_layers,
        "layer_seconds": w.layer_seconds.sum(axis=1).tolist(),
    }
    facts["ok"] = w.steps == steps and facts["timed"] and facts["phases_inside_layer"] and facts["pairs_counted"]
    return facts


def exchange_outputs(rank: int, world_size: int, cfg: RuntimeConfig, schedules: tuple[str, ...], steps: int) -> dict:
    """Each schedule's outputs on the same batches (steps x every layer), with a fresh engine each.

    Returns, per schedule: every rank's outputs of every step (gathered on rank 0, None elsewhere),
    how many dispatches ran as planned rounds, and the largest number of rounds one exchange took.
    """
    device = _device(cfg, rank)
    report = {}
    for schedule in schedules:
        engine = EPEngine(cfg.replace(a2a_schedule=schedule), rank, world_size, device=device)
        outputs = []
        for step in range(steps):
            x, valid, ids = _batch(cfg, rank, step)
            outputs.append(engine.forward(x, valid, ids).cpu())
        gathered = _gather(outputs, world_size)
        report[schedule] = {"outputs": gathered if rank == 0 else None, "planned": engine.exchange.planned,
                            "most_rounds": engine.exchange.most_rounds}
    return report if rank == 0 else None
