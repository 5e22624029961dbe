"""Live plans: agreed at a step boundary, weights moved by batched P2P, committed only if all ranks succeed.

Rank 0 holds the inbox (Plan frames from the agent, or scripted ones). At every step boundary it
broadcasts one small flag tensor; a plan it accepts follows as a second broadcast, so all ranks start
on it at the same step. Rank 0 alone refuses what it must (a plan whose epoch is not newer than the one
in force, or that does not fit the runtime's sizes) and answers with a failed Ack at once; nothing
reaches the other ranks.

An accepted plan that keeps the placement (capacity only, or the all-to-all's order) takes effect at
that boundary; a plan's `a2a_schedule` switches every rank's exchange at the boundary its placement
commits, the same step on every rank (a rank on rounds and one on the collective would wait on
each other for ever). One that
moves experts migrates first: at each boundary at most `layers_per_step` changed layers have their new
slots filled, locally when the rank already holds the expert, otherwise by torch.distributed P2P
(batch_isend_irecv, one message per rank pair), into staging buffers; the model keeps running on
the old placement meanwhile. Each migration step ends with an all_reduce of every rank's success, so
a failure on any rank aborts on all ranks and leaves the old placement in force (the Ack reports the
failure and the epoch kept). A collective that fails outright (a peer node died or hung past the
group's timeout) is the caller's to catch: `peer_lost` then drops the staged weights, answers the
plan with a failed Ack and leaves the old placement in force. After the last changed layer, the
window in progress is flushed and every changed layer swaps its state at once: the new epoch starts
with a fresh window, so no window mixes two placements, and the Ack reports the epoch now in force
and the stall the migration added.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from moewatch import wire
from moewatch.plan import A2A_SCHEDULES, Plan, PlanError

from .ep_rank import EPEngine, LayerState
from .placement import Transfer, changed_layers, plan_migration, slot_ranks
from .probe import Probe


class MigrationError(RuntimeError):
    pass


def refusal(plan: Plan, epoch_in_force: int, num_layers: int, num_experts: int, num_slots: int,
            world_size: int) -> str | None:
    """Why a plan cannot be applied, or None when it can."""
    if plan.epoch <= epoch_in_force:
        return f"stale plan: epoch {plan.epoch} is not newer than the epoch in force ({epoch_in_force})"
    try:
        plan.check_against(num_layers, num_experts, num_slots, world_size)
    except PlanError as exc:
        return f"plan does not fit this runtime: {exc}"
    return None


@dataclass
class Migration:
    epoch: int
    new_map: np.ndarray  # [L, P]
    capacity: np.ndarray  # [L]
    layers: list[int]  # changed layers still to move, in order
    transfers: dict[int, list[Transfer]]  # per changed layer
    staged: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    stall_seconds: float = 0.0
    steps: int = 0
    layers_changed: int = 0
    a2a_schedule: str | None = None  # the order from this epoch on (None: keep)


class PlanApplier:
    """Plan intake and application for one rank; every rank calls `boundary` at every step boundary."""

    def __init__(self, engine: EPEngine, *, group=None, probe: Probe | None = None,
                 inbox: "queue.Queue[Plan] | None" = None, ack=None, layers_per_step: int = 1,
                 inject_failure: dict | None = None):
        self.engine = engine
        self.group = group
        self.probe = probe
        self.rank, self.world_size = engine.rank, engine.world_size
        self.device = engine.device
        self.inbox = inbox if inbox is not None else queue.Queue()
        self._ack = ack
        self.layers_per_step = layers_per_step
        self.inject_failure = inject_failure
        self.migration: Migration | None = None
        self.acks: list[wire.Ack] = []  # what rank 0 answered, in order
        self.applied = self.refused = self.failed = 0
        self.step = 0
        self._last_stall = 0.0

    @property
    def distributed(self) -> bool:
        return self.group is not None or dist.is_initialized()

    # --- the boundary ------------------------------------------------------------------------------
    def boundary(self, step: int, stop: bool = False) -> bool:
        """Agree on stop and on a new plan, advance a migration. Returns the agreed stop flag."""
        self.step = step
        plan = None
        if self.rank == 0 and self.migration is None:
            plan = self._next_acceptable_plan()
        flags = torch.tensor([int(plan is not None), int(stop)], dtype=torch.long, device=self.device)
        self._broadcast(flags)
        has_plan, stop = bool(flags[0]), bool(flags[1])
        if stop:
            if self.migration is not None:
                self._abort("the runtime is stopping", failed_ranks=[])
            return True
        if has_plan:
            self._start(self._share_plan(plan))
        if self.migration is not None:
            self._migrate_some()
        return False

    def _next_acceptable_plan(self) -> Plan | None:
        engine = self.engine
        while True:
            try:
                plan = self.inbox.get_nowait()
            except queue.Empty:
                return None
            why = refusal(plan, engine.epoch, engine.spec.num_layers, engine.spec.num_experts,
                          engine.num_slots, self.world_size)
            if why is None:
                return plan
            self.refused += 1
            self._answer(wire.Ack(plan_epoch=plan.epoch, epoch_in_force=engine.epoch, ok=False, error=why,
                                  step=self.step))

    def _share_plan(self, plan: Plan | None) -> tuple[int, np.ndarray, np.ndarray]:
        L, P = self.engine.spec.num_layers, self.engine.num_slots
        payload = torch.zeros(2 + L + L * P, dtype=torch.float64, device=self.device)
        if self.rank == 0:
            schedule = -1.0 if plan.a2a_schedule is None else float(A2A_SCHEDULES.index(plan.a2a_schedule))
            payload.copy_(torch.from_numpy(np.concatenate([
                [float(plan.epoch), schedule], plan.capacity_factor, plan.physical_to_logical_map.reshape(-1)])))
        self._broadcast(payload)
        values = payload.cpu().numpy()
        schedule = None if values[1] < 0 else A2A_SCHEDULES[int(values[1])]
        return (int(values[0]), np.rint(values[2 + L:]).astype(np.int64).reshape(L, P), values[2:2 + L].copy(),
                schedule)

    def _start(self, shared: tuple[int, np.ndarray, np.ndarray, str | None]) -> None:
        epoch, new_map, capacity, schedule = shared
        old_map = self.engine.placement
        layers = changed_layers(old_map, new_map)
        if not layers:
            self._commit(Migration(epoch, new_map, capacity, [], {}, a2a_schedule=schedule))
            return
        transfers = plan_migration(old_map, new_map, self.world_size)
        by_layer: dict[int, list[Transfer]] = {layer: [] for layer in layers}
        for t in transfers:
            by_layer[t.layer].append(t)
        self.migration = Migration(epoch, new_map, capacity, list(layers), by_layer, layers_changed=len(layers),
                                   a2a_schedule=schedule)

    # --- migration ---------------------------------------------------------------------------------
    def _migrate_some(self) -> None:
        m = self.migration
        started = time.perf_counter()
        batch, m.layers = m.layers[:self.layers_per_step], m.layers[self.layers_per_step:]
        m.steps += 1
        error = ""
        sends: dict[int, torch.Tensor] = {}
        receives: dict[int, torch.Tensor] = {}
        try:
            self._maybe_fail(m, "prepare")
            sends, receives = self._prepare(m, batch)
        except Exception as exc:  # any local failure must reach the other ranks, not hang them
            error = f"rank {self.rank} preparing: {exc}"
        failed = self._agree(error, 0.0)
        if failed:
            self._abort(error or f"rank {failed[0]} failed preparing the migration", failed)
            return
        try:
            self._maybe_fail(m, "stall")
            self._exchange(sends, receives)
            self._unpack(m, batch, receives)
            self._maybe_fail(m, "transfer")
            for layer in batch:
                for tensor in m.staged[layer]:
                    if not bool(torch.isfinite(tensor).all()):
                        raise MigrationError(f"layer {layer}: received weights are not finite")
        except Exception as exc:
            error = f"rank {self.rank} moving weights: {exc}"
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - started
        failed = self._agree(error, elapsed)
        if failed:
            self._abort(error or f"rank {failed[0]} failed moving the weights", failed)
            return
        m.stall_seconds += self._last_stall
        if not m.layers:
            self._commit(m)

    def _maybe_fail(self, m: Migration, stage: str) -> None:
        spec = self.inject_failure
        if (spec and int(spec["rank"]) == self.rank and int(spec["epoch"]) == m.epoch
                and spec.get("stage", "transfer") == stage):
            if stage == "stall":  # a rank that hangs mid-migration (tests kill its node meanwhile)
                if spec.get("marker"):
                    with open(spec["marker"], "w", encoding="utf-8") as out:
                        out.write(f"rank {self.rank} stalled migrating to epoch {m.epoch}\n")
                time.sleep(float(spec.get("seconds", 3600.0)))
                return
            raise MigrationError(f"injected failure ({stage})")

    def peer_lost(self, why: str) -> None:
        """A collective failed (a peer died or hung past the timeout): abandon a migration in progress
        on this rank, old placement kept, and answer its plan with a failed Ack (rank 0)."""
        if self.migration is not None:
            self._abort(f"the EP group lost a peer mid-migration ({why})", failed_ranks=[])

    def _local_index(self, slot: int) -> int:
        return slot - self.engine.local_slots.start

    def _prepare(self, m: Migration, batch: list[int]):
        """Stage the batch's layers: copies of the current local weights with local moves applied;
        pack what this rank sends to each peer (ordered by layer, then destination slot)."""
        engine = self.engine
        owner = slot_ranks(engine.num_slots, self.world_size)
        outgoing: dict[int, list[torch.Tensor]] = {}
        incoming: dict[int, int] = {}
        for layer in batch:
            state = engine.layers[layer]
            w13, w2 = state.w13.clone(), state.w2.clone()
            for t in m.transfers[layer]:
                dst_rank = int(owner[t.dst_slot])
                if dst_rank == self.rank and t.src_rank == self.rank:
                    src = self._local_index(t.src_slot)
                    w13[self._local_index(t.dst_slot)] = state.w13[src]
                    w2[self._local_index(t.dst_slot)] = state.w2[src]
                elif t.src_rank == self.rank:
                    src = self._local_index(t.src_slot)
                    outgoing.setdefault(dst_rank, []).extend([state.w13[src].reshape(-1), state.w2[src].reshape(-1)])
                elif dst_rank == self.rank:
                    incoming[t.src_rank] = incoming.get(t.src_rank, 0) + 1
            m.staged[layer] = (w13, w2)
        sends = {peer: torch.cat(parts) for peer, parts in outgoing.items()}
        spec = engine.spec
        numel = spec.hidden * 2 * spec.ffn + spec.ffn * spec.hidden
        receives = {peer: torch.empty(count * numel, dtype=engine.dtype, device=self.device)
                    for peer, count in incoming.items()}
        return sends, receives

    def _exchange(self, sends: dict[int, torch.Tensor], receives: dict[int, torch.Tensor]) -> None:
        ops = [dist.P2POp(dist.isend, tensor, peer, group=self.group) for peer, tensor in sorted(sends.items())]
        ops += [dist.P2POp(dist.irecv, tensor, peer, group=self.group) for peer, tensor in sorted(receives.items())]
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()

    def _unpack(self, m: Migration, batch: list[int], receives: dict[int, torch.Tensor]) -> None:
        engine = self.engine
        spec = engine.spec
        owner = slot_ranks(engine.num_slots, self.world_size)
        size13, size2 = spec.hidden * 2 * spec.ffn, spec.ffn * spec.hidden
        offsets = {peer: 0 for peer in receives}
        for layer in batch:
            w13, w2 = m.staged[layer]
            for t in m.transfers[layer]:
                if int(owner[t.dst_slot]) != self.rank or t.src_rank == self.rank:
                    continue
                buf, at = receives[t.src_rank], offsets[t.src_rank]
                dst = self._local_index(t.dst_slot)
                w13[dst] = buf[at:at + size13].view_as(w13[dst])
                w2[dst] = buf[at + size13:at + size13 + size2].view_as(w2[dst])
                offsets[t.src_rank] = at + size13 + size2

    def _agree(self, error: str, elapsed: float) -> list[int]:
        """All-reduce of (failed, seconds) per rank; returns the failed ranks (same list everywhere)."""
        status = torch.zeros(2, self.world_size, dtype=torch.float64, device=self.device)
        status[0, self.rank] = float(bool(error))
        status[1, self.rank] = elapsed
        if self.distributed:
            dist.all_reduce(status, group=self.group)
        status = status.cpu()
        self._last_stall = float(status[1].max())
        return [int(r) for r in torch.nonzero(status[0]).flatten()]

    def _abort(self, error: str, failed_ranks: list[int]) -> None:
        m = self.migration
        self.migration = None
        self.failed += 1
        where = f" (failed ranks: {failed_ranks})" if failed_ranks else ""
        self._answer(wire.Ack(plan_epoch=m.epoch, epoch_in_force=self.engine.epoch, ok=False,
                              error=f"{error}{where}; placement of epoch {self.engine.epoch} kept",
                              step=self.step, stall_seconds=m.stall_seconds, layers_changed=0))

    def _commit(self, m: Migration) -> None:
        engine = self.engine
        states: dict[int, LayerState] = {}
        for layer, (w13, w2) in m.staged.items():
            states[layer] = engine.build_layer(layer, m.new_map[layer], w13, w2)
        if self.probe is not None:
            self.probe.set_placement(m.epoch, m.new_map, m.capacity)  # flushes the old epoch's window
        engine.install(states, m.epoch, m.capacity)
        if m.a2a_schedule is not None:
            engine.exchange.schedule = m.a2a_schedule  # every rank at this same boundary
        self.migration = None
        self.applied += 1
        self._answer(wire.Ack(plan_epoch=m.epoch, epoch_in_force=m.epoch, ok=True, step=self.step,
                              stall_seconds=m.stall_seconds, layers_changed=m.layers_changed))

    # --- plumbing ----------------------------------------------------------------------------------
    def _broadcast(self, tensor: torch.Tensor) -> None:
        if self.distributed:
            dist.broadcast(tensor, src=0, group=self.group)

    def _answer(self, ack: wire.Ack) -> None:
        if self.rank != 0:
            return
        self.acks.append(ack)
        if self._ack is not None:
            self._ack(ack)
