"""Transfer against waiting inside the all-to-all, and the triage step 1 and 2 that use them."""

from __future__ import annotations

import numpy as np
import pytest

from moewatch import telemetry as tm
from moewatch.telemetry import WindowError
from moewatch.triage import diagnose


def test_the_last_rank_to_arrive_spends_only_the_transfer(hand):
    # Rank 1 computes 0.6 s, rank 0 0.2 s; rank 0 waits 0.4 s in the combine for rank 1.
    w = hand.window(hand.uniform(2, 1000), dispatch=[0.05, 0.05], combine=[0.5, 0.1], compute=[0.2, 0.6])
    assert tm.a2a_transfer_seconds(w) == pytest.approx([0.15])
    np.testing.assert_allclose(tm.a2a_wait_seconds(w), [[0.4, 0.0]], atol=1e-12)
    layer_total = 0.75 + 0.75
    assert tm.a2a_transfer_share(w) == pytest.approx([2 * 0.15 / layer_total])
    assert tm.a2a_wait_share(w) == pytest.approx([0.4 / layer_total])
    # The two parts add up to the whole share.
    assert tm.a2a_transfer_share(w) + tm.a2a_wait_share(w) == pytest.approx(tm.a2a_share(w))


def test_each_phase_has_its_own_late_rank(hand):
    # Rank 0 is late to the dispatch, rank 1 to the combine: each phase's least time is its transfer.
    w = hand.window(hand.uniform(2, 1000), dispatch=[0.1, 0.3], combine=[0.4, 0.1], compute=[0.2, 0.2])
    assert tm.a2a_transfer_seconds(w) == pytest.approx([0.2])
    np.testing.assert_allclose(tm.a2a_wait_seconds(w), [[0.3, 0.2]], atol=1e-12)


def test_measured_waits_replace_the_estimate(hand):
    w = hand.window(hand.uniform(2, 1000), dispatch=[0.05, 0.05], combine=[0.5, 0.1], compute=[0.2, 0.6],
                    wait_seconds=[[0.3, 0.02]])
    np.testing.assert_allclose(tm.a2a_wait_seconds(w), [[0.3, 0.02]], atol=1e-12)
    # Transfer: each rank's all-to-all less its wait, the least over ranks (0.55 - 0.3, 0.15 - 0.02).
    assert tm.a2a_transfer_seconds(w) == pytest.approx([0.13])


def test_a_measured_wait_longer_than_the_all_to_all_is_refused(hand):
    with pytest.raises(WindowError) as err:
        hand.window(hand.uniform(2, 1000), dispatch=[0.05, 0.05], combine=[0.5, 0.1], compute=[0.2, 0.6],
                    wait_seconds=[[0.3, 0.2]])
    assert err.value.field == "wait_seconds[0][1]"


def test_a_slow_rank_at_even_load_is_a_straggler_not_communication(hand):
    # The case that used to read comm-bound / volume: the full share is 0.51, but 0.27 of it is rank
    # 0 waiting for rank 1's slow compute.
    w = hand.window(hand.uniform(2, 1000), dispatch=[0.1, 0.1], combine=[0.55, 0.1], compute=[0.21, 0.6],
                    hidden_bytes=1 << 20)
    assert tm.a2a_share(w)[0] >= 0.5
    d = diagnose(w).layers[0]
    assert (d.verdict, d.cause) == ("imbalance-bound", "straggler")
    assert d.metrics["a2a_transfer_share"] < 0.5
    assert d.metrics["slowest_compute_rank"] == 1 and d.metrics["last_arriving_rank"] == 1
    assert any("waiting for a later rank" in line for line in d.evidence)


def test_real_transfer_stays_communication(hand):
    # Both ranks spend the same long time in the collective: nobody waits, all of it is transfer.
    w = hand.window(hand.uniform(2, 1000), dispatch=[0.4, 0.4], combine=[0.4, 0.4], compute=[0.2, 0.2],
                    hidden_bytes=1 << 20)
    d = diagnose(w).layers[0]
    assert (d.verdict, d.cause) == ("comm-bound", "volume")
    assert d.metrics["a2a_wait_share"] == pytest.approx(0.0)


def test_waiting_without_a_compute_straggler_names_the_last_rank(hand):
    # Even load, even expert compute, yet rank 0 waits: rank 1 arrives late (its delay is outside the
    # experts). Without compute time at all, waiting is the only evidence.
    w = hand.window(hand.uniform(2, 1000), dispatch=[0.45, 0.05], combine=[0.05, 0.05], compute=[0.2, 0.2],
                    hidden_bytes=1 << 20, compute_seconds=None)
    d = diagnose(w).layers[0]
    assert (d.verdict, d.cause) == ("imbalance-bound", "straggler")
    assert d.metrics["last_arriving_rank"] == 1


def test_uneven_load_at_even_time_keeps_its_verdict_with_time_beside_it(hand):
    # Rank 1 is half as fast and carries a third of the pairs: both take 0.4 s. Plain balancedness
    # is low, time balancedness 1. One window cannot tell this from compute that ignores pairs, so
    # the verdict is the documented one and the evidence says what time shows.
    traffic = np.array([[1000, 500], [1000, 500]])
    w = hand.window(traffic, dispatch=[0.02, 0.02], combine=[0.02, 0.02], compute=[0.4, 0.4])
    assert tm.balancedness(w)[0] == pytest.approx(0.75)
    assert tm.time_balancedness(w)[0] == pytest.approx(1.0)
    speed = tm.rank_speed(w)
    assert speed[0] / speed[1] == pytest.approx(2.0)
    d = diagnose(w).layers[0]
    assert d.verdict == "imbalance-bound"
    assert d.metrics["time_balancedness"] == pytest.approx(1.0)
    assert any("compute time is even" in line for line in d.evidence)


def test_uneven_load_that_takes_uneven_time_is_still_imbalance(hand):
    traffic = np.array([[1000, 500], [1000, 500]])
    w = hand.window(traffic, dispatch=[0.02, 0.02], combine=[0.02, 0.02], compute=[0.4, 0.2])
    assert diagnose(w).layers[0].verdict == "imbalance-bound"


def test_rank_speed_is_nan_for_a_rank_that_computed_nothing(hand):
    traffic = np.array([[1000, 0], [1000, 0]])
    w = hand.window(traffic, dispatch=[0.02, 0.02], combine=[0.02, 0.02], compute=[0.4, 0.0])
    speed = tm.rank_speed(w)
    assert speed[0] == pytest.approx(2000 / 0.4) and np.isnan(speed[1])
