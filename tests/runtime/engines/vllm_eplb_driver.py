"""Runs inside .venv-vllm (the tests start it there): loads vLLM's general plugins the way each vLLM
process does, then exercises vLLM's EPLB policy registry and its own map checks, and prints one JSON
line. moewatch's policy is in place when the caller's environment sets MOEWATCH_EPLB=1.

usage: vllm_eplb_driver.py CASE     (CASE: resolve, all, mismatch, records; all runs checks, idle, digest
                                    and fallback in one process: each vLLM start is a minute on a busy CPU)
       vllm_eplb_driver.py digest   (the digest inputs through the policy's decision alone, no vLLM)
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys

import numpy as np


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def skewed(layers: int, experts: int, seed: int):
    import torch

    rng = np.random.default_rng(seed)
    return torch.from_numpy((rng.zipf(1.6, (layers, experts)).clip(max=5000) * 100).astype(np.int64))


def contiguous(layers: int, slots: int, experts: int):
    import torch

    return torch.arange(slots).remainder(experts).repeat(layers, 1)


def policy():
    from vllm.config.parallel import EPLBConfig
    from vllm.distributed.eplb import eplb_state

    return eplb_state.EPLB_POLICIES[EPLBConfig().policy]  # what EplbState resolves at start


def check(out, layers: int, experts: int, slots: int, old) -> dict:
    """vLLM's own functions on the policy's output: the inverse maps and the migration schedule."""
    import torch
    from vllm.distributed.eplb.eplb_state import compute_logical_maps
    from vllm.distributed.eplb.migration_scheduler import schedule_migration_batches_for_layers

    assert isinstance(out, torch.Tensor) and out.device.type == "cpu" and out.dtype == torch.int64, out
    logical_to_physical, counts = compute_logical_maps(out, experts)
    batches = None
    if old is not None and old.shape == out.shape:
        batches = schedule_migration_batches_for_layers(slots // 4, old.numpy(), out.numpy())
    slots_of = [[sorted(int(s) for s in row if s >= 0) for row in layer] for layer in logical_to_physical.tolist()]
    return {"shape": list(out.shape), "counts": counts.tolist(), "slots_of": slots_of,
            "batches": None if batches is None else len(batches)}


def checks(chosen, L, E, P, W) -> dict:
    from moewatch.planner.placement_math import placement_balancedness

    out = {}
    load, old = skewed(L, E, 0), contiguous(L, P, E)
    new = chosen.rebalance_experts(load, P, 1, 2, W, old)
    out["same_slots"] = check(new, L, E, P, old)
    out["balancedness"] = [placement_balancedness(load.numpy(), m.numpy(), W).tolist() for m in (old, new)]
    more = chosen.rebalance_experts(load, 32, 1, 2, W, old)  # the engine scaled: another slot count
    out["more_slots"] = check(more, L, E, 32, None)
    holes = old.clone()
    holes[:, -2:] = -1  # vLLM marks slots of new ranks -1
    out["holes"] = check(chosen.rebalance_experts(load, P, 1, 2, W, holes), L, E, P, None)
    return out


def idle(chosen, L, E, P, W) -> dict:
    import torch

    old = skewed(L, P, 2).remainder(E)
    old[:, :E] = torch.arange(E)  # every expert present, the rest an arbitrary current map
    new = chosen.rebalance_experts(torch.zeros(L, E, dtype=torch.int64), P, 1, 1, W, old)
    return {"same": bool((new == old).all()), "dtype": str(new.dtype)}


def digest(rebalance) -> str:
    """Two production-shaped calls (61 x 256, 320 slots, 64 ranks, 8 nodes), the second from the first's map."""
    first = rebalance(skewed(61, 256, 7), 320, 8, 8, 64, contiguous(61, 320, 256))
    second = rebalance(skewed(61, 256, 8), 320, 8, 8, 64, first)
    return hashlib.sha256(first.numpy().tobytes() + second.numpy().tobytes()).hexdigest()


def fallback(chosen, L, E, P, W, records) -> dict:
    from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

    from moewatch.runtime.engines import vllm_eplb

    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    vllm_eplb.gated_rebalance = broken
    load, old = skewed(L, E, 1), contiguous(L, P, E)
    got = [chosen.rebalance_experts(load, P, 1, 1, W, old) for _ in range(2)]
    expected = DefaultEplbPolicy.rebalance_experts(load, P, 1, 1, W, old)
    return {"equal": all(bool((g == expected).all()) for g in got), "fallbacks": vllm_eplb.fallbacks(),
            "warnings": [m for m in records.messages if "EPLB policy failed" in m],
            "records": ["fallback" if r.get("fallback") else "decision" for r in vllm_eplb.take_records()]}


def records_of_calls(chosen) -> dict:
    """The profile run's call (vLLM's EplbState.rearrange(is_profile=True) hands the policy the load
    window before any step: all zeros), then the two production-shaped calls of `digest`; what the
    process recorded for its windows, and whether the mending ran compiled (numba) or in numpy."""
    import torch

    from moewatch.planner import mending_compiled
    from moewatch.runtime.engines import vllm_eplb

    old = contiguous(61, 320, 256)
    kept = chosen.rebalance_experts(torch.zeros(61, 256, dtype=torch.int32), 320, 8, 8, 64, old)
    maps = digest(chosen.rebalance_experts)
    return {"profile_call_kept_map": bool((kept == old).all()), "maps": maps,
            "compiled": mending_compiled.kernel() is not None, "fallbacks": vllm_eplb.fallbacks(),
            "records": [{key: r.get(key) for key in ("call", "digest", "fallback")} for r in vllm_eplb.take_records()]}


def main() -> None:
    case = sys.argv[1]
    records = Records()
    logging.getLogger().addHandler(records)
    if case == "digest":
        import os

        from moewatch.planner.rebalance import RebalanceSettings
        from moewatch.runtime.engines import vllm_eplb

        settings = RebalanceSettings.from_env(os.environ)

        def decide_only(weight, num_replicas, num_groups, num_nodes, num_ranks, old):
            import torch

            decision = vllm_eplb.decide(weight, num_replicas, num_nodes, num_ranks, old, settings)
            return torch.from_numpy(decision.physical_to_logical_map)

        print(json.dumps({"digest": digest(decide_only)}))
        return
    if case == "mismatch":  # a vLLM whose policy interface moved on
        from vllm.distributed.eplb.policy import DefaultEplbPolicy

        DefaultEplbPolicy.rebalance_experts = classmethod(lambda cls, weight, num_replicas, num_ranks: None)
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    chosen = policy()
    if case == "records":
        print(json.dumps(records_of_calls(chosen)))
        return
    out: dict = {"policy": chosen.__name__, "warnings": records.messages}
    L, E, P, W = 4, 16, 24, 4
    if case == "all":
        out["checks"] = checks(chosen, L, E, P, W)
        out["idle"] = idle(chosen, L, E, P, W)
        out["digest"] = digest(chosen.rebalance_experts)
        out["fallback"] = fallback(chosen, L, E, P, W, records)  # last: it breaks the planner
    print(json.dumps(out))


if __name__ == "__main__":
    main()
