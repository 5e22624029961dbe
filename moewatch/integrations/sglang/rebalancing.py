"""Where SGLang keeps its rebalancing settings: its exec arguments (`--enable-eplb`,
`--eplb-rebalance-num-iterations`, forward passes between rebalances as EPLBManager counts them,
`--eplb-min-rebalancing-utilization-threshold`). SGLang's rebalance blocks the passes it runs in
(chunked over several with `--eplb-rebalance-layers-per-chunk`), so it is never asynchronous.
Duck-typed, so the core never imports SGLang."""

from __future__ import annotations

from typing import Any

from ...engine_rebalancing import RebalancingSettings


def rebalancing_settings(moe_exec: Any, hook_installed: bool) -> RebalancingSettings | None:
    """SGLang's exec settings (get_exec().moe) -> the settings its windows carry; None when EPLB is off.
    Each rebalance is observed when moewatch's hook answers or records SGLang's algorithm
    (`hook_installed`) and SGLang's
    utilisation gate cannot skip one (its threshold at 1.0, the default): a skipped rebalance never
    calls the algorithm, so it would read as one that did not happen."""
    if not getattr(moe_exec, "enable_eplb", False):
        return None
    threshold = float(getattr(moe_exec, "eplb_min_rebalancing_utilization_threshold", 1.0))
    return RebalancingSettings(interval_steps=int(moe_exec.eplb_rebalance_num_iterations), asynchronous=False,
                               observed=bool(hook_installed) and threshold >= 1.0,
                               source="sglang eplb_rebalance_num_iterations")
