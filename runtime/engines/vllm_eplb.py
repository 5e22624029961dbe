"""moewatch's planner as vLLM's EPLB policy: with MOEWATCH_EPLB=1 the general plugin
(vllm_plugin.register, run in every vLLM process before the model is built) replaces the "default"
entry of vLLM's policy registry, which is what EPLBConfig.policy="default" resolves to when EPLB
starts. Unset, vLLM's policy is untouched.

vLLM calls `rebalance_experts(weight [L, E], num_replicas, num_groups, num_nodes, num_ranks,
old_global_expert_indices [L, P])` on every rank independently (on a background thread in async
mode, and once with all-zero load in the profile run) and takes an int64 CPU [L, num_replicas]
map. Ours runs moewatch.planner.rebalance.gated_rebalance: minimal movement from the map in force,
node-aware when num_nodes > 1, and a per-layer cost gate; num_groups (group-limited routing) is not
used. Any error inside returns vLLM's own policy's result, counted and logged once: an exception
would end vLLM's rebalancing thread for good.

The interface is checked when the plugin loads (the policy's signature, a "default" entry); when it
differs, vLLM's policy is left alone with one warning naming the vLLM version.
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any

import numpy as np

from moewatch.planner.rebalance import RebalanceDecision, RebalanceSettings, gated_rebalance

from .rebalance_hook import RebalanceHookState

logger = logging.getLogger("moewatch.vllm.eplb")

EXPECTED_PARAMETERS = ("weight", "num_replicas", "num_groups", "num_nodes", "num_ranks",
                       "old_global_expert_indices")

# Per process, never part of a decision (rebalance_hook.py).
_hook = RebalanceHookState("vllm", "vLLM", "vLLM's own EPLB policy", logger)


def install_from_env(environ=os.environ) -> bool:
    """Replace vLLM's default EPLB policy when MOEWATCH_EPLB is on; True when ours is in place.
    Idempotent. Never raises: a bad setting or another interface leaves vLLM's policy in place."""
    return _hook.install_from_env(environ, _import_policies, interface_problem, _attach)


def _import_policies():
    from vllm.distributed.eplb import policy as policies

    return policies


def _attach(policies, settings: RebalanceSettings) -> None:
    original = policies.EPLB_POLICIES["default"]
    policies.EPLB_POLICIES["default"] = make_policy(policies.AbstractEplbPolicy, original, settings)
    logger.info("moewatch: vLLM's EPLB policy \"default\" is moewatch's planner (settings %s)", settings.to_dict())


def interface_problem(policies) -> str | None:
    """What in vLLM's policy module differs from what this adapter was written for, or None."""
    registry = getattr(policies, "EPLB_POLICIES", None)
    if not isinstance(registry, dict) or "default" not in registry:
        return "no EPLB_POLICIES registry with a \"default\" entry"
    if not hasattr(policies, "AbstractEplbPolicy"):
        return "no AbstractEplbPolicy"
    method = getattr(registry["default"], "rebalance_experts", None)
    if method is None:
        return "the default policy has no rebalance_experts"
    names = tuple(inspect.signature(method).parameters)
    if names != EXPECTED_PARAMETERS:
        return f"rebalance_experts takes {names}, expected {EXPECTED_PARAMETERS}"
    return None


def make_policy(base: type, original: type, settings: RebalanceSettings) -> type:
    """A subclass of vLLM's AbstractEplbPolicy whose rebalance_experts is moewatch's, with
    `original` (vLLM's default policy) as the fallback."""

    class MoewatchEplbPolicy(base):
        fallback_policy = original

        @classmethod
        def rebalance_experts(cls, weight, num_replicas, num_groups, num_nodes, num_ranks,
                              old_global_expert_indices=None):
            try:
                decision = decide(weight, num_replicas, num_nodes, num_ranks, old_global_expert_indices, settings)
            except Exception as exc:  # never into vLLM's thread: its own policy's answer instead
                _hook.fell_back(exc)
                return original.rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_ranks,
                                                  old_global_expert_indices)
            _hook.decided(decision)
            import torch

            return torch.from_numpy(np.ascontiguousarray(decision.physical_to_logical_map, dtype=np.int64))

    MoewatchEplbPolicy.__qualname__ = MoewatchEplbPolicy.__name__
    return MoewatchEplbPolicy


def decide(weight, num_replicas: int, num_nodes: int, num_ranks: int, old_map,
           settings: RebalanceSettings) -> RebalanceDecision:
    """vLLM's arguments (tensors on any device) -> the decision; raises on anything unexpected."""
    load = _numpy(weight, np.float64)
    current = None if old_map is None else _numpy(old_map, np.int64)
    nodes = int(num_nodes) if int(num_nodes) > 0 and int(num_ranks) % int(num_nodes) == 0 else 1
    decision = gated_rebalance(load, int(num_replicas), int(num_ranks), nodes, current=current, settings=settings)
    check_map(decision.physical_to_logical_map, load.shape[0], load.shape[1], int(num_replicas))
    return decision


def check_map(pmap: np.ndarray, num_layers: int, num_experts: int, num_replicas: int) -> None:
    """What vLLM relies on: [L, num_replicas] int64, every logical expert at least once per layer."""
    if pmap.shape != (num_layers, num_replicas) or pmap.dtype != np.int64:
        raise ValueError(f"map {pmap.shape} {pmap.dtype}, expected ({num_layers}, {num_replicas}) int64")
    if pmap.min() < 0 or pmap.max() >= num_experts:
        raise ValueError("map names an expert out of range")
    counts = np.zeros((num_layers, num_experts), dtype=np.int64)
    np.add.at(counts, (np.arange(num_layers)[:, None], pmap), 1)
    if (counts == 0).any():
        raise ValueError("map leaves a logical expert without a slot")


def fallbacks() -> int:
    """How many calls in this process returned vLLM's own policy's result."""
    return _hook.fallbacks


def last_decision() -> RebalanceDecision | None:
    return _hook.last_decision


def take_records() -> list[dict[str, Any]]:
    return _hook.take_records()


def _numpy(tensor, dtype) -> np.ndarray:
    if hasattr(tensor, "detach"):  # a torch tensor on any device, of any dtype (bf16 has no numpy form)
        tensor = tensor.detach().cpu()
        return (tensor.double() if dtype == np.float64 else tensor.long()).numpy()
    return np.asarray(tensor, dtype=dtype)
