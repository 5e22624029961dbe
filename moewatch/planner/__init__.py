"""The planner: replicas, placement (balanced, topology-aware, affinity-aware, minimal movement),
capacity factor and a cost model. numpy and scipy only; pure functions of arrays.

The stable API (docs/planner.md):
    solve_placement(load [L, E], num_gpus, num_slots=None, num_nodes=1, current=None,
                    affinity=None, balancedness_floor=0.95, expert_bytes=None,
                    tolerance=0.005, max_replicas=None, rank_speed=None) -> PlacementResult
    capacity_for_target(step_loads [S, L, E], top_k=1, target=0.01, hidden_bytes=None)
        -> CapacityResult
"""

from .affinity import load_from_trace, transitions_from_trace
from ..capacity import CapacityResult, capacity_for_target, step_overflow_rate
from .cost import CostModel, fit as fit_cost_model, layer_seconds, migration_stall, plan_gain_seconds
from .placement_math import (PlacementShapeError, dispatch_cross_shares, placement_balancedness,
                             placement_time_balancedness, transition_cross_shares)
from .solve import PlacementResult, solve_placement

__all__ = [
    "CapacityResult",
    "CostModel",
    "PlacementResult",
    "PlacementShapeError",
    "capacity_for_target",
    "dispatch_cross_shares",
    "fit_cost_model",
    "layer_seconds",
    "load_from_trace",
    "migration_stall",
    "plan_gain_seconds",
    "placement_balancedness",
    "placement_time_balancedness",
    "solve_placement",
    "step_overflow_rate",
    "transition_cross_shares",
    "transitions_from_trace",
]
