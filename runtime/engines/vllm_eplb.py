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

Ranks agree or the operator knows: every rank runs the policy on the same all-reduced load and the
same map, and the answer depends on nothing rank-local (numba or its numpy twin give the same map,
bit for bit; thread counts do not enter). Each reported call's record carries `call`, the ordinal of
the policy's reported calls in this process (the same on every rank for the same rebalance, as every
rank calls the policy in the same order), and `digest`, a hex digest over the call's inputs, the
settings and the map returned (`call_digest`); the agent compares one call's digests across ranks.
A rank that fell back to vLLM's policy returns another map, so its digest differs. A call with an
all-zero load (the profile run's, which vLLM makes once at start to size its buffers, or a window
with no tokens) keeps the map in force and is not reported: no record, no ordinal.

A static placement: with MOEWATCH_EPLB_PLACEMENT=FILE as well (a plan `moewatch plan` wrote for
vLLM's slot count, moewatch.planner.static_placement), every call returns FILE's map instead of a
planned one, the profile run's included, so vLLM moves to it at its first rebalance and keeps it.
FILE is read once, here, when the plugin installs the policy (a bad file: one warning naming the
variable, vLLM's policy stays); its shape is checked on every call against vLLM's sizes: when they
differ, vLLM's own policy answers, with one warning naming what differs, and the call is recorded
as a fallback. Its decided records carry `static_placement` (the file, its layers and slots).

With moewatch's policy off and the plugin observing (MOEWATCH_SOCKET or MOEWATCH_WINDOW_DIR),
`record_engine_policy` wraps vLLM's own "default" policy instead, without changing its answer (the
same tensor is returned): each rebalance it answers is recorded for the windows with `"policy":
"engine"`, its call and digest, when, the layers it changed, the slots moved (and bytes, when
MOEWATCH_EPLB_EXPERT_BYTES is set), balancedness before and after under the load it was given and
the changed rows before and after (moewatch.engine_rebalancing.observed_rebalance).

The interface is checked when the plugin loads (the policy's signature, a "default" entry); when it
differs, vLLM's policy is left alone with one warning naming the vLLM version.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import os
import threading
import time
from typing import Any

import numpy as np

from moewatch.engine_rebalancing import observed_rebalance
from moewatch.planner.rebalance import RebalanceDecision, RebalanceSettings, gated_rebalance, switched_on
from moewatch.planner.static_placement import PLACEMENT_VARIABLE, StaticPlacement, static_decision
from moewatch.shards import policy_digest

from .rebalance_hook import RebalanceHookState, package_version as _package_version, recorded_expert_bytes

logger = logging.getLogger("moewatch.vllm.eplb")

EXPECTED_PARAMETERS = ("weight", "num_replicas", "num_groups", "num_nodes", "num_ranks",
                       "old_global_expert_indices")

# Per process, never part of a decision (rebalance_hook.py).
_hook = RebalanceHookState("vllm", "vLLM", "vLLM's own EPLB policy", logger)
_warned: set[str] = set()  # what this process has warned of once


def install_from_env(environ=os.environ) -> bool:
    """Replace vLLM's default EPLB policy when MOEWATCH_EPLB is on; True when ours is in place.
    Idempotent. Never raises: a bad setting or another interface leaves vLLM's policy in place."""
    if _hook.installed:
        return True
    if not switched_on(environ):
        if environ.get(PLACEMENT_VARIABLE, "").strip() and PLACEMENT_VARIABLE not in _warned:
            _warned.add(PLACEMENT_VARIABLE)  # vLLM may load its plugins more than once per process
            logger.warning("moewatch: %s is set but MOEWATCH_EPLB is not 1: the placement is not served",
                           PLACEMENT_VARIABLE)
        return False
    try:
        placement = StaticPlacement.from_env(environ)
    except ValueError as exc:
        logger.warning("moewatch: %s; %s stays", exc, _hook.own_algorithm)
        return False
    return _hook.install_from_env(environ, _import_policies, interface_problem,
                                  lambda policies, settings: _attach(policies, settings, placement))


def _import_policies():
    from vllm.distributed.eplb import policy as policies

    return policies


def _attach(policies, settings: RebalanceSettings, placement: StaticPlacement | None = None) -> None:
    original = policies.EPLB_POLICIES["default"]
    policies.EPLB_POLICIES["default"] = make_policy(policies.AbstractEplbPolicy, original, settings, placement)
    if placement is not None:
        logger.info("moewatch: vLLM's EPLB policy \"default\" serves the static placement %s (%d layers, %d slots)",
                    placement.path, *placement.shape)
    else:
        logger.info("moewatch: vLLM's EPLB policy \"default\" is moewatch's planner (settings %s)",
                    settings.to_dict())


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


def make_policy(base: type, original: type, settings: RebalanceSettings,
                placement: StaticPlacement | None = None) -> type:
    """A subclass of vLLM's AbstractEplbPolicy whose rebalance_experts is moewatch's, with
    `original` (vLLM's default policy) as the fallback; with `placement`, it serves that placement."""
    mismatch_warned = threading.Event()

    class MoewatchEplbPolicy(base):
        fallback_policy = original

        @classmethod
        def rebalance_experts(cls, weight, num_replicas, num_groups, num_nodes, num_ranks,
                              old_global_expert_indices=None):
            sizes = (num_replicas, num_groups, num_nodes, num_ranks)
            problem = None if placement is None else placement.mismatch(
                int(weight.shape[0]), int(weight.shape[1]), int(num_replicas), int(num_ranks))
            if problem is not None:  # the file does not fit this engine: vLLM's own answer, warned once
                answer = original.rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_ranks,
                                                    old_global_expert_indices)
                if not mismatch_warned.is_set():
                    mismatch_warned.set()
                    logger.warning("moewatch: %s; %s answers every call", problem, _hook.own_algorithm)
                identity = _reported_call(weight, sizes, old_global_expert_indices, settings, answer)
                if identity is not None:
                    _hook.declined(problem, **identity)
                return answer
            try:
                decision = decide(weight, num_replicas, num_nodes, num_ranks, old_global_expert_indices, settings,
                                  placement)
            except Exception as exc:  # never into vLLM's thread: its own policy's answer instead
                answer = original.rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_ranks,
                                                    old_global_expert_indices)
                identity = _reported_call(weight, sizes, old_global_expert_indices, settings, answer)
                if identity is not None:
                    _hook.fell_back(exc, **identity)
                return answer
            import torch

            answer = torch.from_numpy(np.ascontiguousarray(decision.physical_to_logical_map, dtype=np.int64))
            identity = _reported_call(weight, sizes, old_global_expert_indices, settings, answer)
            if identity is not None:
                _hook.decided(decision, **identity, **({} if placement is None else placement.record()))
            return answer

    MoewatchEplbPolicy.__qualname__ = MoewatchEplbPolicy.__name__
    return MoewatchEplbPolicy


_call_ordinals = itertools.count()
_call_lock = threading.Lock()


def _reported_call(weight, sizes, old_map, settings: RebalanceSettings, answer) -> dict[str, Any] | None:
    """{"call", "digest"} of a call to report, or None for an all-zero load (not a rebalance: the
    profile run's call, or a window without tokens), which takes no ordinal."""
    load = _numpy(weight, np.float64)
    if not load.any():
        return None
    digest = call_digest(load, sizes, None if old_map is None else _numpy(old_map, np.int64), settings,
                         _numpy(answer, np.int64))
    with _call_lock:  # vLLM's async mode calls from its own thread
        return {"call": next(_call_ordinals), "digest": digest}


def call_digest(load: np.ndarray, sizes, old_map: np.ndarray | None, settings: RebalanceSettings,
                answer: np.ndarray) -> str:
    """The record's `digest` of one policy call (moewatch.shards.policy_digest, which the agent
    compares across shards): over the load [L, E], the sizes (num_replicas, num_groups, num_nodes,
    num_ranks), the map in force [L, P] or none, the settings and the map returned [L, P']. Equal on
    two ranks exactly when they were asked the same and answered the same."""
    return policy_digest(load, [int(s) for s in sizes], None if old_map is None else old_map,
                         settings.to_dict(), answer)


def decide(weight, num_replicas: int, num_nodes: int, num_ranks: int, old_map,
           settings: RebalanceSettings, placement: StaticPlacement | None = None) -> RebalanceDecision:
    """vLLM's arguments (tensors on any device) -> the decision (the static placement's, when one is
    given and fits: the caller checked); raises on anything unexpected."""
    load = _numpy(weight, np.float64)
    current = None if old_map is None else _numpy(old_map, np.int64)
    nodes = int(num_nodes) if int(num_nodes) > 0 and int(num_ranks) % int(num_nodes) == 0 else 1
    if placement is not None:
        decision = static_decision(placement, load, current, int(num_ranks), nodes, settings)
    else:
        decision = gated_rebalance(load, int(num_replicas), int(num_ranks), nodes, current=current,
                                   settings=settings)
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


def installed() -> bool:
    """Whether moewatch's policy is vLLM's "default" EPLB policy in this process (each call recorded)."""
    return _hook.installed


_recording: dict[str, Any] = {"installed": False, "errors": 0}


def observed() -> bool:
    """Whether each of vLLM's rebalances in this process leaves a record: moewatch's policy answers it,
    or vLLM's own policy is wrapped by record_engine_policy."""
    return _hook.installed or _recording["installed"]


def record_engine_policy(environ=os.environ) -> bool:
    """With moewatch's policy off: wrap vLLM's "default" EPLB policy so that each rebalance it answers is
    recorded for the windows, its answer unchanged. True when in place. Idempotent. Never raises:
    another interface leaves vLLM's policy alone, with one warning naming the version."""
    if _hook.installed or _recording["installed"]:
        return True
    expert_bytes = recorded_expert_bytes(environ, "vLLM", logger)
    try:
        policies = _import_policies()
    except ImportError as exc:
        logger.warning("moewatch: vLLM %s has no EPLB policy registry (%s); its rebalances are not recorded",
                       _package_version("vllm"), exc)
        return False
    problem = interface_problem(policies)
    if problem is not None:
        logger.warning("moewatch: vLLM %s: %s; its rebalances are not recorded", _package_version("vllm"), problem)
        return False
    original = policies.EPLB_POLICIES["default"]
    policies.EPLB_POLICIES["default"] = make_recording_policy(policies.AbstractEplbPolicy, original, expert_bytes)
    _recording["installed"] = True
    return True


def make_recording_policy(base: type, original: type, expert_bytes: float | None = None) -> type:
    """A subclass of vLLM's AbstractEplbPolicy that returns `original`'s answer, the same tensor, and
    records the call (an all-zero load, the profile run's, is no rebalance: no record). Recording never
    fails the call: an error is counted and logged once."""
    settings = RebalanceSettings()  # in the digest only: the same on every rank

    class RecordedEplbPolicy(base):
        recorded_policy = original

        @classmethod
        def rebalance_experts(cls, weight, num_replicas, num_groups, num_nodes, num_ranks,
                              old_global_expert_indices=None):
            answer = original.rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_ranks,
                                                old_global_expert_indices)
            try:
                sizes = (num_replicas, num_groups, num_nodes, num_ranks)
                identity = _reported_call(weight, sizes, old_global_expert_indices, settings, answer)
                if identity is not None:
                    old = None if old_global_expert_indices is None else _numpy(old_global_expert_indices, np.int64)
                    _hook.records.append({
                        "engine": _hook.engine, "policy": "engine", **identity, "time": time.time(),
                        **observed_rebalance(_numpy(weight, np.float64), old, _numpy(answer, np.int64),
                                             int(num_ranks), expert_bytes)})
            except Exception as exc:  # noqa: BLE001 - a record is never worth vLLM's rebalancing thread
                _recording["errors"] += 1
                if _recording["errors"] == 1:
                    logger.warning("moewatch: recording vLLM's rebalance failed (%s: %s); later failures are "
                                   "counted, not logged", type(exc).__name__, exc)
            return answer

    RecordedEplbPolicy.__qualname__ = RecordedEplbPolicy.__name__
    return RecordedEplbPolicy


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
