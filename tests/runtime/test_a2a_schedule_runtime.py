"""The scheduled all-to-all in the reference runtime (runtime/dispatch.py, --a2a-schedule aurora) on
a real gloo group of 4 ranks: outputs bit for bit those of the single all_to_all_single, on skewed
traffic with replicas, capacity drops and padding; and the config's checks of the new fields."""

from __future__ import annotations

import pytest
import torch

from moewatch.errors import ConfigError
from moewatch.runtime import checks
from moewatch.runtime.config import RuntimeConfig, validate
from moewatch.runtime.launcher import run_group

pytestmark = pytest.mark.slow

L, E, P, W = 3, 8, 12, 4


@pytest.mark.parametrize("rounds", ["bound", "whole"])
def test_aurora_rounds_give_the_collective_outputs_bit_for_bit(rounds):
    # "whole": declared link rates and a dear round make the planner pick whole-transfer rounds.
    links = {} if rounds == "bound" else {"link_bytes_per_second": [1e6] * W, "a2a_round_seconds": 1.0}
    cfg = RuntimeConfig(**links,ranks=W, layers=L, experts=E, slots=P, hidden=24, ffn=32, batch_tokens=48,
                        pad_fraction=0.1, zipf=1.4, capacity_factor=1.5, overflow="drop",
                        placement=checks.replicated_placement(L, E, P, seed=7).tolist())
    report = run_group(W, checks.exchange_outputs, (cfg, ("none", "aurora"), 3), timeout_s=60)[0]
    plain, planned = report["none"], report["aurora"]
    assert plain["planned"] == 0
    assert planned["planned"] == 3 * L  # every layer of every step ran as rounds on rank 0
    assert planned["most_rounds"] >= W - 1  # real rounds, not one collective in disguise
    for rank in range(W):
        for step in range(3):
            a, b = plain["outputs"][rank][step], planned["outputs"][rank][step]
            assert a.dtype == b.dtype == torch.float32
            assert torch.equal(a, b), f"rank {rank} step {step}: outputs differ"


def test_config_checks_schedule_and_link_fields():
    with pytest.raises(ConfigError, match="a2a_schedule"):
        validate(RuntimeConfig(a2a_schedule="sjf"))
    with pytest.raises(ConfigError, match="link_bytes_per_second"):
        validate(RuntimeConfig(ranks=4, link_bytes_per_second=[1e8, 1e8]))
    with pytest.raises(ConfigError, match="link_bytes_per_second"):
        validate(RuntimeConfig(ranks=2, link_bytes_per_second=[1e8, 0.0]))
    with pytest.raises(ConfigError, match="link_rate_mbit"):
        validate(RuntimeConfig(link_rate_mbit=0.5))
    with pytest.raises(ConfigError, match="link_rate_mbit"):
        validate(RuntimeConfig(link_rate_mbit=100.0, socket="tcp://127.0.0.1:9000"))
    validate(RuntimeConfig(ranks=2, a2a_schedule="aurora", link_rate_mbit=300.0, link_bytes_per_second=[3e7, 3e7]))
