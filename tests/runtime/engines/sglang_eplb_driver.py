"""Runs in the project venv, which holds SGLang 0.5.23 (the tests start it in a subprocess: SGLang's
plugin loader and hook registry patch process-wide): loads SGLang's general plugins, then calls
`eplb_algorithms.rebalance_experts` as SGLang's rebalance does, and prints one JSON line.
moewatch's hook is registered when the caller's environment sets MOEWATCH_EPLB=1.

usage: sglang_eplb_driver.py CASE     (CASE: all, off, mismatch)
"""

from __future__ import annotations

import json
import logging
import sys

import numpy as np

L, E, P, W, N = 4, 16, 24, 4, 2


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def tokens(seed: int):
    """[X, L, E] SGLang's tokens_per_expert: X windows of counts."""
    import torch

    rng = np.random.default_rng(seed)
    return torch.from_numpy((rng.zipf(1.6, (3, L, E)).clip(max=5000) * 100).astype(np.int64))


def call(tokens_per_expert):
    """The call SGLang's rebalance makes (ExpertLocationMetadata.init_by_eplb)."""
    from sglang.srt.eplb import eplb_algorithms

    return eplb_algorithms.rebalance_experts(
        tokens_per_expert=tokens_per_expert, num_physical_experts=P, num_local_physical_experts=P // W,
        num_groups=None, num_nodes=N,
        algorithm=eplb_algorithms.compute_algorithm(raw_algorithm="auto", num_groups=None, num_nodes=N))


def sglang_checks(result) -> dict:
    """SGLang's own inverse map for our phy2log against the log2phy and counts we returned."""
    import torch
    from sglang.srt.eplb.expert_location import _compute_logical_to_all_physical_map

    phy2log, log2phy, logcnt = result
    assert all(isinstance(t, torch.Tensor) and t.dtype == torch.int64 for t in result), [t.dtype for t in result]
    theirs = _compute_logical_to_all_physical_map(phy2log, E, W, None)
    padded = torch.nn.functional.pad(theirs, (0, log2phy.shape[-1] - theirs.shape[-1]), value=-1)
    return {"shapes": [list(t.shape) for t in result], "log2phy_equal": bool((padded == log2phy).all()),
            "logcnt_equal": bool((torch.count_nonzero(log2phy != -1, dim=-1) == logcnt).all()),
            "every_expert": bool((logcnt >= 1).all()), "slots": int(logcnt.sum())}


def publish(phy2log) -> None:
    """Publish a map as SGLang's expert-location metadata, built as its _init_raw builds it (less the
    static dispatch map, which needs a server's settings)."""
    import torch
    from sglang.srt.eplb import expert_location as el

    all_physical = el._compute_logical_to_all_physical_map(phy2log, E, W, None)
    all_physical = torch.nn.functional.pad(all_physical, (0, P - all_physical.shape[-1]), value=-1)
    meta = el.ExpertLocationMetadata(
        physical_to_logical_map=phy2log, physical_to_logical_map_cpu=phy2log.cpu(),
        logical_to_all_physical_map=all_physical, logical_to_all_physical_map_cpu=all_physical,
        logical_to_all_physical_map_num_valid=torch.count_nonzero(all_physical != -1, dim=-1), ep_size=W,
        logical_to_rank_dispatch_physical_map=None)
    el.set_global_expert_location_metadata(meta, allow_overwrite=True)


def main() -> None:
    case = sys.argv[1]
    records = Records()
    logging.getLogger().addHandler(records)
    from sglang.srt.eplb import eplb_algorithms

    if case == "mismatch":  # an SGLang whose rebalance interface moved on
        eplb_algorithms.rebalance_experts = lambda tokens_per_expert, num_physical_experts, algorithm: None
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    load_plugins()
    target = "sglang.srt.eplb.eplb_algorithms.rebalance_experts"
    out: dict = {"hooked": target in HookRegistry._patched,
                 "wrapped": hasattr(eplb_algorithms.rebalance_experts, "__wrapped__"), "warnings": records.messages,
                 "gatherer_hooks": sorted(t.rsplit(".", 2)[-2] + "." + t.rsplit(".", 1)[-1]
                                          for t in HookRegistry._patched if "SinglePassGatherer" in t)}
    if case == "all":
        import torch

        from moewatch.planner.placement_math import placement_balancedness
        from moewatch.runtime.engines import sglang_eplb

        first = call(tokens(0))  # no map published yet: placed afresh
        out["fresh"] = sglang_checks(first)
        contiguous = torch.arange(P).remainder(E).repeat(L, 1)
        publish(contiguous)
        load = tokens(1)
        moved = call(load)
        out["from_current"] = sglang_checks(moved)
        out["balancedness"] = [placement_balancedness(load.sum(0).numpy(), m.numpy(), W).tolist()
                               for m in (contiguous, moved[0])]
        publish(moved[0])
        out["again_moved"] = int((call(load)[0] != moved[0]).sum())  # same load, its own map in force
        out["decision"] = sglang_eplb.last_decision().record()

        from sglang.srt.eplb.eplb_algorithms import deepseek

        def broken(*args, **kwargs):
            raise RuntimeError("injected")

        sglang_eplb.gated_rebalance = broken
        got = [call(load) for _ in range(2)]
        expected = deepseek.rebalance_experts(weight=load.sum(dim=0), num_replicas=P, num_groups=None,
                                              num_nodes=N, num_gpus=W, enable_hierarchical=False)
        out["fallback"] = {"equal": all(bool((a == b).all()) for g in got for a, b in zip(g, expected)),
                           "fallbacks": sglang_eplb.fallbacks(),
                           "warnings": [m for m in records.messages if "EPLB hook failed" in m],
                           "records": ["fallback" if r.get("fallback") else "decision"
                                       for r in sglang_eplb.take_records()]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
