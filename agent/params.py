"""The one place the validated configuration becomes the decision modules' parameters: the policy and
verification never read the configuration itself, only these small frozen objects."""

from __future__ import annotations

from dataclasses import dataclass

from .config import AgentConfig
from .policy import CostParams, PolicyParams
from .rank_speed import RankSpeedParams
from .verification import VerifyParams


@dataclass(frozen=True)
class ControlParams:
    policy: PolicyParams
    verify: VerifyParams
    rank_speed: RankSpeedParams


def cost_params(cfg: AgentConfig) -> CostParams:
    # An actuator's own apply cost comes with its declared properties (GroupView.actuator), not from here.
    return CostParams(expert_bytes=cfg.cost.expert_bytes,
                      migration_bandwidth_bytes_per_second=cfg.cost.migration_bandwidth_bytes_per_second,
                      inter_node_bandwidth_bytes_per_second=cfg.cost.inter_node_bandwidth_bytes_per_second)


def policy_params(cfg: AgentConfig) -> PolicyParams:
    p = cfg.policy
    return PolicyParams(mode=p.mode, persist_windows=p.persist_windows, horizon_seconds=p.horizon_seconds,
                        gain_margin=p.gain_margin, min_balancedness_gain=p.min_balancedness_gain,
                        cooldown_seconds=p.cooldown_seconds, max_plans_per_hour=p.max_plans_per_hour,
                        max_replicas_per_expert=p.max_replicas_per_expert, capacity_factor_min=p.capacity_factor_min,
                        capacity_factor_max=p.capacity_factor_max, allow_lossy_capacity=p.allow_lossy_capacity,
                        cost=cost_params(cfg), overflow_target=cfg.thresholds.overflow_target,
                        max_capacity_factor=cfg.thresholds.max_capacity_factor)


def verify_params(cfg: AgentConfig) -> VerifyParams:
    v = cfg.verify
    return VerifyParams(windows=v.windows, rollback_balancedness_drop=v.rollback_balancedness_drop,
                        rollback_time_rise=v.rollback_time_rise)


def rank_speed_params(cfg: AgentConfig) -> RankSpeedParams:
    p = cfg.policy
    return RankSpeedParams(windows=p.slow_rank_windows, min_seconds=p.slow_rank_min_seconds,
                           min_pairs=p.slow_rank_min_pairs,
                           slow_below=p.slow_rank_below, recover_above=p.slow_rank_recover_above,
                           replan_change=p.slow_rank_replan_change)


def from_config(cfg: AgentConfig) -> ControlParams:
    """Every decision module's parameters, from one validated config (the controller keeps the result)."""
    return ControlParams(policy=policy_params(cfg), verify=verify_params(cfg), rank_speed=rank_speed_params(cfg))
