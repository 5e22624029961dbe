"""Absent evidence: a source that cannot measure a field leaves it out; the Window keeps it absent in
both forms, checks the invariants on what is present, and the triage reports the steps it could not
take as unknown, never as a guessed number."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from click.testing import CliRunner

from moewatch import telemetry as tm
from moewatch.cli import main
from moewatch.tools.examples import PARTIAL_EXAMPLES, SCENARIOS, partial_example, simulate, without_evidence
from moewatch.schema import packaged_schema
from moewatch.telemetry import EVIDENCE, OPTIONAL_ARRAYS, Window, WindowError
from moewatch.triage import diagnose

ROOT = Path(__file__).resolve().parents[2]
LOGICAL = "logical-only-hot-experts"
TIMINGS = ("dispatch_seconds", "combine_seconds", "compute_seconds", "layer_seconds", "step_seconds")
RANK_COUNTS = ("slot_tokens", "local_tokens", "sent_tokens", "received_tokens", "traffic")
# A window of logical counts lacks every kind of evidence but the expert load it carries.
LOGICAL_MISSING = [kind for kind in EVIDENCE if kind != "expert_load"]


def fields_of(kind: str) -> set[str]:
    """Every field an evidence kind can draw on (removing them all makes it missing)."""
    out = {name for option in EVIDENCE[kind] for name in option}
    return out | ({"traffic"} if out & {"local_tokens", "sent_tokens", "received_tokens"} else set())


@pytest.fixture(scope="module")
def logical() -> Window:
    return partial_example(LOGICAL, seed=3)


def test_only_placement_routing_and_capacity_factor_are_required():
    assert tm.REQUIRED_ARRAYS == {"physical_to_logical_map", "expert_tokens", "capacity_factor"}
    assert (set(TIMINGS) | {"step_tokens"} | set(RANK_COUNTS) | {"dropped_tokens", "rerouted_tokens", "rank_tokens", "wait_seconds",
                                                                  "a2a_bound_seconds", "a2a_over_bound"}
            == OPTIONAL_ARRAYS)
    assert tm.REQUIRED_UNLESS == {"expert_tokens": "rank_tokens"}  # the routed counts, unless rank totals stand in


def test_logical_only_window_round_trips_in_both_forms(logical):
    assert logical.absent_fields == sorted(OPTIONAL_ARRAYS, key=list(tm.ARRAY_FIELDS).index)
    data = json.loads(logical.to_json())
    assert all(data[name] is None for name in OPTIONAL_ARRAYS)
    again = Window.from_json(logical.to_json())
    assert again.absent_fields == logical.absent_fields and again.to_json() == logical.to_json()
    blob = logical.to_bytes()
    header = json.loads(blob[8:8 + int.from_bytes(blob[4:8], "little")])
    assert set(header["arrays"]) == tm.REQUIRED_ARRAYS  # absent fields are not in the binary form at all
    back = Window.from_bytes(blob)
    assert back.absent_fields == logical.absent_fields
    np.testing.assert_array_equal(back.expert_tokens, logical.expert_tokens)
    # A JSON reader also takes an absent key for an absent field, and the schema accepts both.
    for name in OPTIONAL_ARRAYS:
        del data[name]
    assert Window.from_dict(data).absent_fields == logical.absent_fields
    jsonschema.validate(data, packaged_schema())
    jsonschema.validate(logical.to_dict(), packaged_schema())


@pytest.mark.parametrize("name", sorted(OPTIONAL_ARRAYS))
def test_each_field_alone_may_be_absent_in_both_forms(name):
    w = simulate(SCENARIOS["overflow"], seed=2)
    drop = {name} | ({"traffic"} if name in ("local_tokens", "sent_tokens", "received_tokens") else set())
    bare = without_evidence(w, drop)
    for again in (Window.from_json(bare.to_json()), Window.from_bytes(bare.to_bytes())):
        assert again.absent_fields == bare.absent_fields and name in again.absent_fields
    diagnose(bare)  # the triage takes any combination


@pytest.mark.parametrize("name,change,needle", [
    # slot_tokens absent: local + sent must still equal local + received
    ("sent_tokens", lambda d: d.update(slot_tokens=None, traffic=None) or d["sent_tokens"][0].__setitem__(0, 10**6),
     "sum(local_tokens) + sum(sent_tokens)"),
    # drops unknown: slots cannot have computed more than was routed
    ("slot_tokens", lambda d: d.update(dropped_tokens=None) or d["slot_tokens"][0].__setitem__(0, 10**9),
     "more pairs computed than were routed"),
    # a traffic matrix states local, sent and received: it cannot come without them
    ("traffic", lambda d: d.update(local_tokens=None), "local_tokens absent"),
    # what is present keeps its own checks: a negative timing is still rejected
    ("compute_seconds", lambda d: d.update(dispatch_seconds=None) or d["compute_seconds"][0].__setitem__(0, -1.0),
     "negative"),
])
def test_invariants_apply_to_what_is_present(name, change, needle):
    data = simulate(SCENARIOS["overflow"], seed=2).to_dict()
    change(data)
    with pytest.raises(WindowError) as err:
        Window.from_dict(data)
    assert err.value.field == name and needle in str(err.value)


def test_rank_load_comes_from_slots_or_from_local_plus_received_never_from_the_placement(logical):
    w = simulate(SCENARIOS["imbalance-hot-experts"], seed=4)
    full = tm.rank_load(w)
    np.testing.assert_array_equal(full, w.local_tokens + w.received_tokens)
    np.testing.assert_array_equal(tm.rank_load(without_evidence(w, {"local_tokens", "received_tokens",
                                                                     "sent_tokens", "traffic"})), full)
    np.testing.assert_array_equal(tm.rank_load(without_evidence(w, {"slot_tokens"})), full)
    for f in (tm.rank_load, tm.balancedness, tm.rank_load_cv, tm.rank_load_max_mean, tm.rank_load_max_min,
              tm.cross_rank_ratio, tm.a2a_share, tm.overflow_rate, tm.compute_max_mean, tm.mean_message_bytes,
              tm.a2a_measured_seconds, tm.effective_capacity_factor):
        assert f(logical) is None, f.__name__
    assert tm.a2a_efficiency(logical, 1e11) is None and tm.a2a_lower_bound_seconds(logical, 1e11) is None
    # What every window supports: expert load and the placement's prediction.
    assert tm.expert_load_cv(logical).shape == (logical.num_layers,)
    assert tm.expected_cross_rank_ratio(logical).shape == (logical.num_layers,)


def test_logical_only_window_is_judged_on_expert_load_and_says_what_it_lacked(logical):
    result = diagnose(logical)
    for d in result.layers:
        assert (d.verdict, d.cause, d.overflow) == ("imbalance-bound", "hot-experts", False)
        assert d.missing == LOGICAL_MISSING
        for key in ("a2a_share", "rank_load", "busiest_rank", "balancedness", "rank_load_cv", "cross_rank_ratio",
                    "overflow_rate", "layer_seconds_per_step", "dropped_pairs", "effective_capacity_factor"):
            assert d.metrics[key] is None, key
        assert d.metrics["routed_pairs"] == int(logical.expert_tokens[d.layer].sum())
        assert sorted(d.metrics["hot_experts"]) == [1, 2, 3]
        # Replication is named from expert load; its gain needs rank load, so it is unknown, not invented.
        assert d.actions[0].kind == "replicate" and d.actions[0].predicted_gain is None
        assert all(a.predicted_gain is None for a in d.actions)
        assert not any(a.params.get("lossy") for a in d.actions)
        assert sum("unknown" in line for line in d.evidence) == 4  # steps 1 and 3, rank load, overflow
        out = d.to_dict()
        assert out["missing"] == LOGICAL_MISSING and out["seconds_at_stake"] is None
    assert result.summary["missing"] == LOGICAL_MISSING
    assert result.summary["balancedness_mean"] is None and result.summary["slowest_rank"]["rank"] is None
    json.dumps(result.to_dict(), allow_nan=False)


def test_timings_absent_leave_the_verdict_to_the_balance_and_traffic_steps():
    w = simulate(SCENARIOS["imbalance-hot-experts"], seed=5)
    bare = without_evidence(w, set(TIMINGS))
    for full, part in zip(diagnose(w).layers, diagnose(bare).layers):
        assert (part.verdict, part.cause) == (full.verdict, full.cause) == ("imbalance-bound", "hot-experts")
        assert part.missing == ["a2a_time", "compute_time", "layer_time", "steps"]
        assert part.metrics["a2a_share"] is None and part.metrics["balancedness"] == full.metrics["balancedness"]
        # Rank load is measured, so the replicate gain is the same number as with timings.
        assert part.actions[0].predicted_gain == full.actions[0].predicted_gain > 0
    # A comm-bound layer without timings: step 1 is unknown, the measured steps find nothing wrong.
    volume = without_evidence(simulate(SCENARIOS["comm-bound-volume"], seed=5), set(TIMINGS))
    for d in diagnose(volume).layers:
        assert (d.verdict, d.cause) == ("healthy", None)
        assert any(line.startswith("All-to-all share of layer time: unknown") for line in d.evidence)


def test_rank_counts_absent_keep_step_one_and_leave_the_cause_unknown():
    w = simulate(SCENARIOS["comm-bound-volume"], seed=6)
    bare = without_evidence(w, set(RANK_COUNTS))
    for d in diagnose(bare).layers:
        assert (d.verdict, d.cause) == ("comm-bound", None)
        assert d.missing == ["rank_load", "cross_rank"]
        assert d.metrics["a2a_share"] > 0.5 and d.metrics["cross_rank_ratio"] is None


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_full_windows_miss_nothing_and_any_missing_kind_reads_null(name):
    w = simulate(SCENARIOS[name], seed=8)
    assert all(d.missing == [] for d in diagnose(w).layers)
    for kind in EVIDENCE:
        bare = without_evidence(w, fields_of(kind))
        layers = diagnose(bare).layers
        assert all(kind in d.missing for d in layers), kind
        json.dumps(diagnose(bare).to_dict(), allow_nan=False)


# --- the CLI on a window with absent evidence ---------------------------------------------------

def run(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_committed_partial_example_is_what_the_generator_writes(tmp_path):
    from moewatch.tools.examples import write_examples

    write_examples(tmp_path)
    for name in PARTIAL_EXAMPLES:
        assert (ROOT / "examples" / f"{name}.json").read_text() == (tmp_path / f"{name}.json").read_text()


def test_diagnose_json_table_and_explain_say_what_was_missing(tmp_path):
    path = str(ROOT / "examples" / f"{LOGICAL}.json")
    out = json.loads(run("diagnose", path, "--json").output)
    verdict, cause, overflow = PARTIAL_EXAMPLES[LOGICAL][2]
    for layer in out["layers"]:
        assert (layer["verdict"], layer["cause"], layer["overflow"]) == (verdict, cause, overflow)
        assert layer["missing"] == LOGICAL_MISSING
        assert layer["metrics"]["a2a_share"] is None and layer["metrics"]["rank_load"] is None
        assert layer["actions"][0]["kind"] == "replicate" and layer["actions"][0]["predicted_gain"] is None
    assert out["summary"]["missing"] == LOGICAL_MISSING
    table = run("diagnose", path).output
    header = next(line for line in table.splitlines() if line.startswith("layer"))
    assert "evidence missing" in table and "missing" in header.split()
    row = next(line for line in table.splitlines() if line.startswith("0 "))
    assert "imbalance-bound" in row and "rank_load" in row and "gain unknown" in row and " ? " in row
    explain = run("diagnose", path, "--explain").output
    assert ("Rank load: unknown (the window does not carry slot_tokens or local_tokens + received_tokens "
            "or rank_tokens)") in explain
    assert "[missing: a2a_time, rank_load" in explain
    report = run("report", path, "--out", str(tmp_path / "r.png"))
    assert report.exit_code == 0 and (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
