"""moewatch's planner inside SGLang's live expert rebalancing: a `sglang.srt.plugins` entry point
(pyproject.toml), which SGLang loads in every scheduler process before the scheduler is built.
With MOEWATCH_EPLB=1 it registers an AROUND hook with SGLang's HookRegistry on
`sglang.srt.eplb.eplb_algorithms.rebalance_experts`, the function every rank calls independently
when it rebalances (`--enable-eplb`, every `--eplb-rebalance-num-iterations`) and when it builds
a placement from counts at start. Unset, nothing is registered for it. (The same entry point
registers, when MOEWATCH_SOCKET or MOEWATCH_WINDOW_DIR is set, the routed counts under DeepEP of
sglang_routed.py.)

The hook answers with moewatch.planner.rebalance.gated_rebalance: the load is SGLang's
tokens_per_expert summed over its windows [X, L, E] -> [L, E]; the current map, for minimal
movement and the per-layer gate, is the one SGLang publishes in
`get_global_expert_location_metadata()` (absent at start: placed afresh); node-aware when
num_nodes > 1; num_groups is not used. It returns SGLang's three tensors: physical_to_logical_map
[L, P] int64, logical_to_physical_map [L, E, max replicas] (slots in increasing order, -1 padded),
and the replica counts [L, E] int64. The elasticity-aware algorithms (ranks that come and go) and
any error inside go to SGLang's own function, counted and logged once.

With MOEWATCH_EPLB off and moewatch observing (MOEWATCH_SOCKET or MOEWATCH_WINDOW_DIR), an AROUND
hook on the same function records SGLang's own algorithm instead, its answer returned unchanged:
each call with load is recorded for the windows with `"policy": "engine"`, when, the layers it
changed from the published map, the slots moved (bytes with MOEWATCH_EPLB_EXPERT_BYTES), balancedness
before and after, the changed rows (moewatch.engine_rebalancing.observed_rebalance).

The interface is checked when the plugin loads (the function's parameters, the metadata getter);
when it differs, SGLang's algorithm is left alone with one warning naming the SGLang version.
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from typing import Any

import numpy as np

from moewatch.engine_rebalancing import observed_rebalance
from moewatch.planner.placement_math import replica_counts_of
from moewatch.planner.rebalance import RebalanceDecision, RebalanceSettings, gated_rebalance

from . import sglang_routed
from .rebalance_hook import RebalanceHookState, package_version, recorded_expert_bytes

logger = logging.getLogger("moewatch.sglang.eplb")

TARGET = "sglang.srt.eplb.eplb_algorithms.rebalance_experts"
EXPECTED_PARAMETERS = ("tokens_per_expert", "num_physical_experts", "num_local_physical_experts", "num_groups",
                       "num_nodes", "algorithm")

# Per process, never part of a decision (rebalance_hook.py).
_hook = RebalanceHookState("sglang", "SGLang", "SGLang's own EPLB algorithm", logger)


def register(environ=os.environ) -> bool:
    """The entry point: register the hook when MOEWATCH_EPLB is on; True when it is registered.
    Idempotent; never raises (a bad setting or another interface leaves SGLang's algorithm).
    It also registers, when moewatch observes, the routed counts under DeepEP (sglang_routed.py),
    which must be in place before SGLang captures its CUDA graphs, as only a plugin is."""
    sglang_routed.register(environ)
    installed = _hook.install_from_env(environ, _import_eplb, lambda modules: interface_problem(*modules[:2]),
                                       _attach)
    if not installed and (environ.get("MOEWATCH_SOCKET") or environ.get("MOEWATCH_WINDOW_DIR")):
        record_engine_algorithm(environ)
    return installed


_recording: dict[str, Any] = {"installed": False, "errors": 0, "expert_bytes": None}


def observed() -> bool:
    """Whether each of SGLang's rebalances in this process leaves a record: moewatch's hook answers it,
    or SGLang's own algorithm is recorded (record_engine_algorithm)."""
    return _hook.installed or _recording["installed"]


def record_engine_algorithm(environ=os.environ) -> bool:
    """Register the AROUND hook that records SGLang's own algorithm's calls, its answers unchanged; True
    when in place. Idempotent; never raises (another interface: one warning naming the version)."""
    if _hook.installed or _recording["installed"]:
        return True
    _recording["expert_bytes"] = recorded_expert_bytes(environ, "SGLang", logger)
    try:
        modules = _import_eplb()
    except ImportError as exc:
        logger.warning("moewatch: SGLang %s lacks its EPLB hook points (%s); its rebalances are not recorded",
                       package_version("sglang"), exc)
        return False
    problem = interface_problem(*modules[:2])
    if problem is not None:
        logger.warning("moewatch: SGLang %s: %s; its rebalances are not recorded", package_version("sglang"), problem)
        return False
    _, _, registry, hook_type = modules
    registry.register(TARGET, record_around, hook_type.AROUND)
    _recording["installed"] = True
    return True


def record_around(original, *args, **kwargs):
    """SGLang's AROUND hook with its own algorithm in charge: `original`'s answer, the call recorded (a
    call with no load is no rebalance: no record). Recording never fails the call."""
    answer = original(*args, **kwargs)
    try:
        values = inspect.signature(inspect.unwrap(original)).bind(*args, **kwargs).arguments
        counts = values["tokens_per_expert"]
        counts = counts.detach().cpu().double().numpy() if hasattr(counts, "detach") else np.asarray(counts, float)
        load = counts.sum(axis=0) if counts.ndim == 3 else counts
        if load.any():
            ranks = int(values["num_physical_experts"]) // int(values["num_local_physical_experts"])
            after = answer[0].detach().cpu().numpy()
            _hook.records.append({"engine": _hook.engine, "policy": "engine", "time": time.time(),
                                  **observed_rebalance(load, current_map(), after, ranks, _recording["expert_bytes"])})
    except Exception as exc:  # noqa: BLE001 - a record is never worth SGLang's rebalance
        _recording["errors"] += 1
        if _recording["errors"] == 1:
            logger.warning("moewatch: recording SGLang's rebalance failed (%s: %s); later failures are counted, "
                           "not logged", type(exc).__name__, exc)
    return answer


def _import_eplb():
    from sglang.srt.eplb import eplb_algorithms, expert_location
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    return eplb_algorithms, expert_location, HookRegistry, HookType


def _attach(modules, settings: RebalanceSettings) -> None:
    _, _, registry, hook_type = modules
    registry.register(TARGET, rebalance_around, hook_type.AROUND)
    logger.info("moewatch: SGLang's rebalance_experts answers with moewatch's planner (settings %s)",
                settings.to_dict())


def interface_problem(eplb_algorithms, expert_location) -> str | None:
    """What in SGLang's EPLB modules differs from what this hook was written for, or None."""
    function = getattr(eplb_algorithms, "rebalance_experts", None)
    if function is None:
        return "no eplb_algorithms.rebalance_experts"
    names = tuple(inspect.signature(inspect.unwrap(function)).parameters)
    if names != EXPECTED_PARAMETERS:
        return f"rebalance_experts takes {names}, expected {EXPECTED_PARAMETERS}"
    if not hasattr(expert_location, "get_global_expert_location_metadata"):
        return "no expert_location.get_global_expert_location_metadata"
    if not hasattr(eplb_algorithms, "EplbAlgorithm"):
        return "no EplbAlgorithm"
    return None


def rebalance_around(original, *args, **kwargs):
    """SGLang's AROUND hook: moewatch's answer, or `original`'s for the elastic algorithms and on error."""
    try:
        bound = inspect.signature(inspect.unwrap(original)).bind(*args, **kwargs)
        algorithm = getattr(bound.arguments["algorithm"], "name", str(bound.arguments["algorithm"]))
        if algorithm.startswith("elasticity_aware"):
            return original(*args, **kwargs)
        values = bound.arguments
        tensors, decision = decide(values["tokens_per_expert"], values["num_physical_experts"],
                                   values["num_local_physical_experts"], values["num_nodes"],
                                   current_map(), _hook.settings or RebalanceSettings())
    except Exception as exc:  # never into SGLang's rebalance: its own algorithm's answer instead
        _hook.fell_back(exc)
        return original(*args, **kwargs)
    _hook.decided(decision)
    return tensors


def current_map() -> np.ndarray | None:
    """[L, P] the map SGLang runs now, from its published expert-location metadata (None before)."""
    from sglang.srt.eplb import expert_location

    metadata = expert_location.get_global_expert_location_metadata()
    if metadata is None:
        return None
    return metadata.physical_to_logical_map_cpu.numpy()


def decide(tokens_per_expert, num_physical_experts: int, num_local_physical_experts: int, num_nodes: int,
           current: np.ndarray | None, settings: RebalanceSettings) -> tuple[tuple, RebalanceDecision]:
    """SGLang's arguments -> ((phy2log, log2phy, logcnt) CPU tensors, the decision)."""
    import torch

    counts = tokens_per_expert.detach().cpu().double() if hasattr(tokens_per_expert, "detach") \
        else torch.as_tensor(np.asarray(tokens_per_expert, dtype=np.float64))
    load = (counts.sum(dim=0) if counts.dim() == 3 else counts).numpy()
    P, S = int(num_physical_experts), int(num_local_physical_experts)
    W = P // S
    nodes = int(num_nodes) if int(num_nodes) > 0 and W % int(num_nodes) == 0 else 1
    decision = gated_rebalance(load, P, W, nodes, current=current, settings=settings)
    pmap = np.ascontiguousarray(decision.physical_to_logical_map, dtype=np.int64)
    logical_to_physical, replica_counts = logical_maps(pmap, load.shape[1])
    return (torch.from_numpy(pmap), torch.from_numpy(logical_to_physical), torch.from_numpy(replica_counts)), decision


def logical_maps(pmap: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """[L, P] placement -> ([L, E, R] slots of each expert in increasing order, -1 padded, R the most
    replicas of any expert; [L, E] replica counts), int64."""
    L, P = pmap.shape
    counts = replica_counts_of(pmap, num_experts).astype(np.int64)
    R = int(counts.max())
    order = np.argsort(pmap, axis=1, kind="stable")  # slots grouped by expert, increasing within one
    experts = np.take_along_axis(pmap, order, axis=1)
    starts = np.cumsum(counts, axis=1) - counts  # [L, E] first position of each expert in `order`
    rank = np.arange(P)[None, :] - np.take_along_axis(starts, experts, axis=1)
    out = np.full((L, num_experts, R), -1, dtype=np.int64)
    out[np.arange(L)[:, None], experts, rank] = order
    return out, counts


def fallbacks() -> int:
    """How many calls in this process returned SGLang's own algorithm's result after an error."""
    return _hook.fallbacks


def last_decision() -> RebalanceDecision | None:
    return _hook.last_decision


def take_records() -> list[dict[str, Any]]:
    return _hook.take_records()


def window_extra() -> dict[str, Any]:
    """{"engine_rebalance": records} for the forward hook's next window when any is pending, and
    {"rebalancing": SGLang's EPLB settings} when its EPLB is on (for the agent's watch on it)."""
    records = take_records()
    out: dict[str, Any] = {"engine_rebalance": records} if records else {}
    settings = rebalancing_extra()
    if settings is not None:
        out["rebalancing"] = settings
    return out


_rebalancing: list[dict[str, Any] | None] = []  # read once per process (SGLang's settings do not change)


def rebalancing_extra() -> dict[str, Any] | None:
    """SGLang's rebalancing settings as a window's extra.rebalancing (moewatch.integrations.sglang.rebalancing),
    None when its EPLB is off, before SGLang publishes its settings, or when they are not readable here
    (then said once)."""
    if not _rebalancing:
        from moewatch.integrations.sglang.rebalancing import rebalancing_settings

        try:
            from sglang.srt.runtime_context import get_context, get_exec

            if not get_context().is_config_namespace_published("exec"):
                return None  # not an SGLang server process yet: asked again at the next window
            settings = rebalancing_settings(get_exec().moe, hook_installed=observed())
        except Exception as exc:  # noqa: BLE001 - another SGLang's config: the watch is off, serving is not
            logger.warning("moewatch: SGLang's EPLB settings unreadable (%s: %s); the agent cannot watch its "
                           "rebalancing", type(exc).__name__, exc)
            settings = None
        _rebalancing.append(None if settings is None else settings.to_extra()["rebalancing"])
    return _rebalancing[0]
