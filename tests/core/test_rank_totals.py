"""rank_tokens, the Window's per-rank totals (an additive v1 extension): a source that sees only how many
pairs each rank computed (SGLang's /metrics heatmap) sends them in place of expert_tokens. The window
checks them against whatever else is present, keeps them in both forms, and the triage judges rank
balance from them while everything per expert reads unknown."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from click.testing import CliRunner

from moewatch import telemetry as tm
from moewatch.cli import main
from moewatch.tools.examples import PARTIAL_EXAMPLES, SCENARIOS, partial_example, simulate, without_evidence
from moewatch.schema import packaged_schema
from moewatch.telemetry import Window, WindowError
from moewatch.triage import diagnose

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = "rank-totals-imbalance"
PER_EXPERT = ("expert_load_cv", "expected_cross_rank_ratio", "expected_cross_node_ratio", "routed_pairs",
              "hot_experts", "overflow_rate", "dropped_pairs", "effective_capacity_factor")


def rank_only(rank_tokens, E=8, W=4, **kw) -> Window:
    rank_tokens = np.asarray(rank_tokens)
    L = rank_tokens.shape[0]
    base = dict(runtime="sglang", model="m", ep_group="g", world_size=W, ranks_per_node=W, num_layers=L,
                num_experts=E, num_slots=E, top_k=1, epoch=0, steps=0, start_time=10.0, end_time=20.0,
                hidden_bytes=0, physical_to_logical_map=np.tile(np.arange(E), (L, 1)), capacity_factor=np.zeros(L),
                rank_tokens=rank_tokens)
    return Window(**{**base, **kw})


@pytest.fixture(scope="module")
def full() -> Window:
    return simulate(SCENARIOS["overflow"], seed=4)


def test_rank_only_window_round_trips_in_both_forms():
    w = rank_only([[900, 100, 100, 100], [300, 300, 300, 300]])
    assert w.expert_tokens is None and "expert_tokens" in w.absent_fields and "rank_tokens" not in w.absent_fields
    data = json.loads(w.to_json())
    assert data["expert_tokens"] is None and data["rank_tokens"] == [[900, 100, 100, 100], [300, 300, 300, 300]]
    jsonschema.validate(data, packaged_schema())
    del data["expert_tokens"]  # absent key reads as absent
    assert Window.from_dict(data).to_json() == w.to_json()
    blob = w.to_bytes()
    header = json.loads(blob[8:8 + int.from_bytes(blob[4:8], "little")])
    assert "expert_tokens" not in header["arrays"] and "rank_tokens" in header["arrays"]
    back = Window.from_bytes(blob)
    assert back.expert_tokens is None and np.array_equal(back.rank_tokens, w.rank_tokens)
    assert back.to_json() == w.to_json()


def test_expert_tokens_stays_required_unless_rank_tokens_stands_in():
    with pytest.raises(WindowError, match="^expert_tokens: missing") as err:
        rank_only(np.ones((2, 4), int)).replace(rank_tokens=None)
    assert err.value.field == "expert_tokens"
    data = json.loads(rank_only(np.ones((2, 4), int)).to_json())
    data["rank_tokens"] = None
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, packaged_schema())
    with pytest.raises(WindowError, match="^expert_tokens: missing"):
        Window.from_dict(data)


@pytest.mark.parametrize("change,field,needle", [
    # per rank, rank_tokens must be what the slots computed
    (lambda w: dict(rank_tokens=tm.rank_load(w) + np.eye(4, dtype=int)[0] - np.eye(4, dtype=int)[1]),
     "rank_tokens", "slot_tokens do not add up"),
    # ... and what local + received say, when the slots are absent
    (lambda w: dict(slot_tokens=None, rank_tokens=tm.rank_load(w) + np.eye(4, dtype=int)[0] - np.eye(4, dtype=int)[1]),
     "rank_tokens", "local + received"),
    # the per-layer total must be routed minus dropped
    (lambda w: dict(slot_tokens=None, local_tokens=None, sent_tokens=None, received_tokens=None, traffic=None,
                    rank_tokens=tm.rank_load(w) + 1), "rank_tokens", "sum(expert_tokens) - sum(dropped_tokens)"),
    # without drops, no more than was routed
    (lambda w: dict(slot_tokens=None, local_tokens=None, sent_tokens=None, received_tokens=None, traffic=None,
                    dropped_tokens=None, rank_tokens=tm.rank_load(w) + 10**9), "rank_tokens", "more pairs computed"),
    (lambda w: dict(rank_tokens=np.zeros((w.num_layers, w.world_size + 1), int)), "rank_tokens", "shape"),
    (lambda w: dict(rank_tokens=-tm.rank_load(w)), "rank_tokens", "negative"),
    # capacity counts are per expert: not without expert_tokens
    (lambda w: dict(expert_tokens=None, rank_tokens=tm.rank_load(w)), "dropped_tokens", "expert_tokens is absent"),
])
def test_rank_tokens_agree_with_what_is_present(full, change, field, needle):
    with pytest.raises(WindowError, match=re.escape(needle)) as err:
        full.replace(**change(full))
    assert err.value.field == field


def test_rank_tokens_beside_full_evidence_are_accepted_and_change_nothing(full):
    both = full.replace(rank_tokens=tm.rank_load(full))
    assert both.missing_evidence == [] and diagnose(both).to_dict()["layers"] == diagnose(full).to_dict()["layers"]


def test_triage_judges_rank_balance_from_totals_and_names_no_expert():
    w = rank_only([[900, 100, 100, 100], [300, 300, 300, 300], [0, 0, 0, 0]])
    result = diagnose(w)
    hot, even, idle = result.layers
    assert (hot.verdict, hot.cause) == ("imbalance-bound", None)  # hot experts or packing: cannot tell
    assert hot.metrics["rank_load"] == [900, 100, 100, 100] and hot.metrics["busiest_rank"] == 0
    assert hot.metrics["balancedness"] == pytest.approx(300 / 900)
    assert (even.verdict, even.cause) == ("healthy", None) and even.metrics["balancedness"] == 1.0
    assert idle.verdict == "healthy" and "nothing to judge" in idle.evidence[0]
    for d in (hot, even):
        assert "expert_load" in d.missing and "rank_load" not in d.missing
        assert all(d.metrics[key] is None for key in PER_EXPERT), d.metrics
        assert d.actions == []  # no replica or placement from per-rank totals
        assert any(line.startswith("Hot experts: unknown") for line in d.evidence)
    assert any("Cause unknown: without per-expert counts" in line for line in hot.evidence)
    out = result.to_dict()
    assert out["layers"][0]["seconds_at_stake"] is None and out["layers"][1]["seconds_at_stake"] == 0.0
    assert result.summary["hot_experts_across_layers"] == [] and "expert_load" in result.summary["missing"]
    json.dumps(out, allow_nan=False)


def test_a_slow_device_is_still_a_straggler_at_even_totals():
    compute = np.full((1, 4), 1.0)
    compute[0, 2] = 3.0
    d = diagnose(rank_only([[300, 300, 300, 300]], compute_seconds=compute)).layers[0]
    assert (d.verdict, d.cause) == ("imbalance-bound", "straggler") and d.actions == []


def test_partial_example_is_the_full_one_seen_as_rank_totals():
    w = partial_example(EXAMPLE)
    full = simulate(SCENARIOS[PARTIAL_EXAMPLES[EXAMPLE][0]], seed=w.extra["example"]["seed"])
    assert w.absent_fields == [n for n in tm.ARRAY_FIELDS if n not in ("physical_to_logical_map", "capacity_factor",
                                                                          "rank_tokens")]
    assert np.array_equal(w.rank_tokens, tm.rank_load(full))
    assert without_evidence(full, {"expert_tokens"}).dropped_tokens is None


def run(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_diagnose_cli_on_a_rank_totals_window():
    path = str(ROOT / "examples" / f"{EXAMPLE}.json")
    result = run("diagnose", path, "--json")
    assert result.exit_code == 0
    out = json.loads(result.output)
    for layer in out["layers"]:
        assert (layer["verdict"], layer["cause"]) == ("imbalance-bound", None)
        assert "expert_load" in layer["missing"] and layer["metrics"]["hot_experts"] is None
    table = run("diagnose", path).output
    row = next(line for line in table.splitlines() if line.startswith("0 "))
    assert "imbalance-bound" in row and "expert_load" in row and row.split()[6:8] == ["?", "?/?"]
    explain = run("diagnose", path, "--explain").output
    assert "Hot experts: unknown (the window does not carry expert_tokens)" in explain
    assert run("diagnose", path, "--fail-on", "imbalance-bound").exit_code == 1
