"""Core pinning of the reference runtime's ranks, and the skewed start the closed-loop bench uses."""

from __future__ import annotations

import os

import numpy as np
import pytest

from moewatch.runtime.config import ConfigError, RuntimeConfig, validate
from moewatch.runtime.launcher import core_binding, rank_view, run_group
from moewatch.runtime.workload import SyntheticRouting, hot_start_placement


def test_enough_cores_gives_each_rank_its_own_share_and_one_thread():
    b = core_binding(2, cores=list(range(8)))
    assert b["pinned"] and b["rank_cores"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert b["threads_per_rank"] == 1 and b["warning"] is None
    assert core_binding(3, threads_per_rank=2, cores=[5, 1, 3, 7])["rank_cores"] == [[1], [3], [5]]
    assert core_binding(3, threads_per_rank=2, cores=[5, 1, 3, 7])["threads_per_rank"] == 2


def test_fewer_cores_than_ranks_is_not_pinned_and_says_why():
    b = core_binding(4, cores=[0, 1])
    assert not b["pinned"] and b["rank_cores"] is None
    assert "4 ranks share 2 cores" in b["warning"] and "busiest rank" in b["warning"]


@pytest.mark.slow
def test_spawned_ranks_run_on_their_own_cores():
    cores = sorted(os.sched_getaffinity(0))
    binding = core_binding(2)
    views = run_group(2, rank_view, binding=binding, timeout_s=60)
    if len(cores) >= 2:
        assert [v["cores"] for v in views] == binding["rank_cores"]
        assert not set(views[0]["cores"]) & set(views[1]["cores"])
        assert [v["threads"] for v in views] == [1, 1]
    else:  # one core: nothing to pin, both ranks see it
        assert binding["warning"] and all(v["cores"] == cores for v in views)


def test_hot_start_placement_puts_the_hot_experts_on_the_hot_rank():
    cfg = RuntimeConfig(ranks=2, layers=4, experts=8, slots=12, hot_experts=2, hot_share=0.7, zipf=0.0, hot_on_rank=1)
    validate(cfg)
    pmap = hot_start_placement(cfg)
    routing = SyntheticRouting(4, 8, 2, zipf=0.0, hot_experts=2, hot_share=0.7)
    S = 6
    for layer in range(4):
        row = pmap[layer]
        assert sorted(set(row.tolist())) == list(range(8)), "every expert keeps a slot"
        hot = routing.hot_set(layer, 0, 2)
        assert set(hot) <= set(row[S:].tolist()) and not set(hot) & set(row[:S].tolist())
        # Spare slots replicate a rank's own experts: no expert is on both ranks.
        assert not set(row[:S].tolist()) & set(row[S:].tolist())


@pytest.mark.parametrize("changes", [{"hot_on_rank": 2}, {"hot_on_rank": 0, "hot_experts": 0},
                                     {"hot_on_rank": 0, "hot_experts": 7}])
def test_hot_on_rank_is_validated(changes):
    cfg = RuntimeConfig(ranks=2, layers=2, experts=8, slots=12, hot_experts=2).replace(**changes)
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert info.value.field in ("hot_on_rank", "hot_experts")


def test_the_skewed_start_is_written_out_before_the_ranks_start():
    """launch() and the torchrun entry both start every rank from the same hot-on-rank map."""
    from moewatch.runtime.launcher import with_start_placement

    cfg = RuntimeConfig(ranks=2, layers=4, experts=8, slots=12, hot_experts=2, hot_share=0.7, zipf=0.0, hot_on_rank=1)
    assert with_start_placement(cfg).placement == hot_start_placement(cfg).tolist()
    given = cfg.replace(placement=np.tile(np.arange(12) % 8, (4, 1)).tolist())
    assert with_start_placement(given).placement == given.placement
    assert with_start_placement(RuntimeConfig()).placement is None
