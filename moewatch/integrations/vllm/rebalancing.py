"""Where vLLM keeps its rebalancing settings: `ParallelConfig.enable_eplb` and its `eplb_config`
(EPLBConfig: `step_interval`, forward steps between rebalances, dummy steps included, as
EplbState.step counts them; `use_async`, weights moved by a background thread beside the steps).
Read by the vLLM plugin from the config in scope; duck-typed, so the core never imports vLLM."""

from __future__ import annotations

from typing import Any

from ...engine_rebalancing import RebalancingSettings


def rebalancing_settings(parallel_config: Any, observed: bool) -> RebalancingSettings | None:
    """vLLM's ParallelConfig -> the settings its windows carry; None when EPLB is off. `observed`: each
    rebalance leaves a record in this process (moewatch's policy answers it, or vLLM's own is recorded)."""
    if not getattr(parallel_config, "enable_eplb", False):
        return None
    eplb = parallel_config.eplb_config
    return RebalancingSettings(interval_steps=int(eplb.step_interval), asynchronous=bool(eplb.use_async),
                               observed=bool(observed), source="vllm eplb_config")
