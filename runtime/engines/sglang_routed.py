"""What each rank's tokens routed, under SGLang's DeepEP dispatch-count gatherers.

With DeepEP (low-latency, or normal under `stat_approx`) SGLang's expert-distribution recorder counts
what each rank's slots RECEIVED from every rank (eplb/expert_distribution.py,
`_DeepepLowLatencySinglePassGatherer`, `_DeepepNormalSinglePassGatherer`): summed over ranks that is
the group's load, but the agent cannot tell which rank sent what, so a merged window's rank-to-rank
traffic would be wrong. Their `on_select_experts`, which SGLang's `select_experts` calls with this
rank's own top-k ids, does nothing. This module gives those two gatherers, through SGLang's plugin
HookRegistry (AFTER hooks, applied when SGLang loads its plugins, before any model runner exists and
so before any CUDA graph is captured), a [L, P] device buffer of the pairs this rank's tokens routed:
filled in `on_select_experts` (inside the captured graphs, as the gatherers' own work is), zeroed in
`reset`, handed on by `collect` under ROUTED_KEY next to SGLang's own counts, which stay as they are.
The forward hook's recorder tap (sglang_hooks.py) counts ROUTED_KEY where it is present.

Registered only when moewatch observes (MOEWATCH_SOCKET or MOEWATCH_WINDOW_DIR set), from the
`sglang.srt.plugins` entry point (sglang_eplb.register). Sizes: L layers, P physical slots.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping

log = logging.getLogger("moewatch.runtime.engines.sglang")

MODULE = "sglang.srt.eplb.expert_distribution"
GATHERERS = ("_DeepepLowLatencySinglePassGatherer", "_DeepepNormalSinglePassGatherer")
ROUTED_KEY = "moewatch_routed_count"
BUFFER = "_moewatch_routed"  # the gatherer attribute holding the [L, P] buffer


def register(environ: Mapping[str, str] = os.environ) -> bool:
    """Register the hooks; True when registered. Never raises (SGLang loads plugins unguarded)."""
    if not (environ.get("MOEWATCH_SOCKET") or environ.get("MOEWATCH_WINDOW_DIR")):
        return False
    try:
        import importlib

        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        module = importlib.import_module(MODULE)
        missing = [name for name in GATHERERS if not hasattr(module, name)]
        if missing:
            log.warning("moewatch: SGLang's recorder has no %s: DeepEP counts stay what each rank received",
                        ", ".join(missing))
        for name in GATHERERS:
            if name in missing:
                continue
            target = f"{MODULE}.{name}"
            HookRegistry.register(f"{target}.__init__", _after_init, HookType.AFTER)
            HookRegistry.register(f"{target}.on_select_experts", _after_select_experts, HookType.AFTER)
            HookRegistry.register(f"{target}.reset", _after_reset, HookType.AFTER)
            HookRegistry.register(f"{target}.collect", _after_collect, HookType.AFTER)
        return len(missing) < len(GATHERERS)
    except Exception as exc:  # an SGLang this was not written for: its counts stay as they are
        log.warning("moewatch: routed counts under DeepEP not registered (%s: %s)", type(exc).__name__, exc)
        return False


def _after_init(result: Any, gatherer: Any, expert_location_metadata: Any, *args: Any, **kwargs: Any) -> None:
    import torch
    from sglang.srt.eplb import expert_distribution

    data = getattr(gatherer, "_data", None)
    device = data.device if data is not None else expert_distribution.get_device()
    shape = (expert_location_metadata.num_layers, expert_location_metadata.num_physical_experts)
    setattr(gatherer, BUFFER, torch.zeros(shape, dtype=torch.int, device=device))
    return None


def _after_select_experts(result: Any, gatherer: Any, *args: Any, layer_idx: int, topk_ids: Any, **kwargs: Any) -> None:
    """This rank's top-k ids [N, k] of one layer into the buffer; ids outside [0, P) (padding) left out."""
    buffer = getattr(gatherer, BUFFER, None)
    if buffer is not None:
        ids = topk_ids.flatten()
        inside = (ids >= 0) & (ids < buffer.shape[1])
        buffer[layer_idx].scatter_add_(0, ids.masked_fill(~inside, 0).long(), inside.int())
    return None


def _after_reset(result: Any, gatherer: Any, *args: Any, **kwargs: Any) -> None:
    buffer = getattr(gatherer, BUFFER, None)
    if buffer is not None:
        buffer.zero_()
    return None


def _after_collect(result: Any, gatherer: Any, *args: Any, **kwargs: Any) -> Any:
    buffer = getattr(gatherer, BUFFER, None)
    if buffer is None or not isinstance(result, dict):
        return None
    return {**result, ROUTED_KEY: buffer}
