"""Size and placement rules: one function each, naming the field, raising the caller's error type;
and the error hierarchy every reader's error belongs to."""

from __future__ import annotations

import numpy as np
import pytest

from moewatch import checks
from moewatch.errors import ConfigError, InputError, MoewatchError
from moewatch.plan import PlanError
from moewatch.planner.files import FileFormatError
from moewatch.planner.placement_math import PlacementShapeError
from moewatch.integrations.base import SourceError
from moewatch.telemetry import WindowError


@pytest.mark.parametrize("rule,args,field,needle", [
    (checks.check_at_least_one, ([("num_layers", 0)],), "num_layers", "at least 1"),
    (checks.check_slots_hold_experts, (6, 8), "num_slots", "6 slots cannot hold 8 experts"),
    (checks.check_slots_divide, (10, 4), "num_slots", "10 slots do not divide over 4 ranks"),
    (checks.check_ranks_per_node, (6, 4), "ranks_per_node", "6 ranks do not split into nodes of 4"),
    (checks.check_num_nodes, (8, 3), "num_nodes", "3 nodes do not divide 8 GPUs"),
    (checks.check_map_shape, (np.zeros((2, 4), int), 2, 5), "physical_to_logical_map", "does not match [2, 5]"),
    (checks.check_placement, (np.array([[0, 1, 9]]), 3), "physical_to_logical_map", "expert 9 outside [0, 3)"),
    (checks.check_placement, (np.array([[0, 0, 1]]), 3), "physical_to_logical_map", "expert 2 has no slot"),
])
def test_each_rule_names_its_field_in_the_callers_error_type(rule, args, field, needle):
    with pytest.raises(WindowError) as err:
        rule(*args, error=WindowError)
    assert err.value.field == field and needle in str(err.value)
    rule_passes = {checks.check_at_least_one: ([("num_layers", 1)],), checks.check_slots_hold_experts: (8, 8),
                   checks.check_slots_divide: (12, 4), checks.check_ranks_per_node: (8, 4),
                   checks.check_num_nodes: (8, 2), checks.check_map_shape: (np.zeros((2, 5), int), 2, 5),
                   checks.check_placement: (np.array([[0, 1, 2]]), 3)}
    rule(*rule_passes[rule], error=WindowError)


def test_valid_placement():
    assert checks.is_valid_placement(np.array([[0, 1, 1, 0]]), 2, 2)
    assert not checks.is_valid_placement(np.array([[0, 1, 2]]), 3, 2)
    assert not checks.is_valid_placement(np.array([0, 1]), 2, 1)


def test_every_input_error_is_one_kind_with_a_field():
    for kind in (WindowError, PlanError, PlacementShapeError, SourceError, ConfigError):
        assert issubclass(kind, InputError) and issubclass(kind, MoewatchError) and issubclass(kind, ValueError)
    assert FileFormatError("load.npy", "empty").field == "load.npy"
    assert ConfigError("thresholds: comm_share: must be in [0, 1]").field == "thresholds"
    two = ConfigError("ranks", "must be >= 1")
    assert (two.field, str(two)) == ("ranks", "ranks: must be >= 1")
    from moewatch.runtime.config import ConfigError as RuntimeConfigError
    from moewatch.thresholds import ConfigError as ThresholdsConfigError
    assert RuntimeConfigError is ThresholdsConfigError is ConfigError
