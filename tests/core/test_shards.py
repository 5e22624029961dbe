"""Shards of one EP group's window (docs/telemetry.md, "Shards"): the shard identity a window carries,
and the whole window moewatch/shards.py merges from one sequence's shards, checked against the
window built directly from the same (token, expert) pairs."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
from click.testing import CliRunner

from moewatch import shards as sh
from moewatch import wire
from moewatch.cli import main
from moewatch.schema import packaged_schema
from moewatch.telemetry import ARRAY_FIELDS, SCALAR_FIELDS, Shard, Window, WindowError
from moewatch.triage import diagnose

L, E, W, P, K = 2, 8, 4, 12, 2  # 12 slots on 4 ranks: experts 0-3 have a second slot on ranks 2-3
PMAP = np.tile(np.arange(P) % E, (L, 1))
SLOT_RANK = np.arange(P) // (P // W)


def routed_pairs(seed: int = 0, tokens: int = 600, pmap: np.ndarray = PMAP):
    """(layer, source rank, slot) of each pair: tokens start on a random rank, pick k distinct experts
    with a skew, and use a replica on their own rank when there is one (the runtime's rule)."""
    rng = np.random.default_rng(seed)
    num_slots = pmap.shape[1]
    slot_rank = np.arange(num_slots) // (num_slots // W)
    layer, source, slot = [], [], []
    weights = np.linspace(3.0, 1.0, E)
    for layer_index in range(L):
        for _ in range(tokens):
            rank = int(rng.integers(W))
            for expert in rng.choice(E, size=K, replace=False, p=weights / weights.sum()):
                slots = np.flatnonzero(pmap[layer_index] == expert)
                own = slots[slot_rank[slots] == rank]
                layer.append(layer_index)
                source.append(rank)
                slot.append(int(own[0] if len(own) else slots[int(rng.integers(len(slots)))]))
    return np.array(layer), np.array(source), np.array(slot)


def timings(seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    layer = rng.uniform(1.0, 2.0, (L, W))
    return {"layer_seconds": layer, "compute_seconds": layer * rng.uniform(0.3, 0.5, (L, W)),
            "dispatch_seconds": layer * 0.2, "combine_seconds": layer * 0.25, "wait_seconds": layer * 0.1}


def window_from_pairs(pairs, ranks, *, pmap=PMAP, rank_level=True, timed=True, step_seconds=None,
                      step_tokens=None, shard=None, extra=None, epoch=0, start=100.0, end=101.0) -> Window:
    """The window of the pairs whose source rank is in `ranks`: every count from the pairs, timings in
    those ranks' columns only (zeros elsewhere), per-step data the slowest / summed over those ranks.
    rank_level=False: a logical window (expert counts and the map only, as engine adapters send)."""
    num_slots = pmap.shape[1]
    slot_rank = np.arange(num_slots) // (num_slots // W)
    layer, source, slot = pairs
    keep = np.isin(source, ranks)
    layer, source, slot = layer[keep], source[keep], slot[keep]
    slot_tokens = np.zeros((L, num_slots), np.int64)
    np.add.at(slot_tokens, (layer, slot), 1)
    expert_tokens = np.zeros((L, E), np.int64)
    np.add.at(expert_tokens, (layer, pmap[layer, slot]), 1)
    traffic = np.zeros((L, W, W), np.int64)
    np.add.at(traffic, (layer, source, slot_rank[slot]), 1)
    local = np.diagonal(traffic, axis1=1, axis2=2).copy()
    mine = np.isin(np.arange(W), ranks)[None, :]
    times = {name: np.where(mine, value, 0.0) if timed else None for name, value in timings().items()}
    steps = 3 if step_seconds is None else len(step_seconds[0])
    rank_level_fields = dict(slot_tokens=slot_tokens, local_tokens=local, sent_tokens=traffic.sum(2) - local,
                             received_tokens=traffic.sum(1) - local, traffic=traffic)
    if not rank_level:
        rank_level_fields = {name: None for name in rank_level_fields}
    return Window(
        runtime="test", model="m", ep_group="g", world_size=W, ranks_per_node=W, num_layers=L, num_experts=E,
        num_slots=num_slots, top_k=K, epoch=epoch, steps=steps, start_time=start, end_time=end, hidden_bytes=4096,
        physical_to_logical_map=pmap, expert_tokens=expert_tokens, dropped_tokens=np.zeros((L, E), np.int64),
        rerouted_tokens=np.zeros((L, E), np.int64), capacity_factor=np.zeros(L), **rank_level_fields, **times,
        step_seconds=None if step_seconds is None else np.max([step_seconds[r] for r in ranks], axis=0),
        step_tokens=None if step_tokens is None else np.sum([step_tokens[r] for r in ranks], axis=0),
        extra={**(extra or {}), **({} if shard is None else {"shard": shard})})


def shards_of(pairs, sequence: int = 7, **kw) -> list[Window]:
    """One shard per rank: shard i routes rank i's tokens."""
    return [window_from_pairs(pairs, [r], shard={"index": r, "count": W, "rank": r, "sequence": sequence}, **kw)
            for r in range(W)]


def assert_same_window(merged: Window, whole: Window) -> None:
    for name in SCALAR_FIELDS:
        assert getattr(merged, name) == getattr(whole, name), name
    for name in ARRAY_FIELDS:
        a, b = getattr(merged, name), getattr(whole, name)
        assert (a is None) == (b is None), f"{name}: {'absent' if a is None else 'present'} in the merge"
        if a is not None:
            np.testing.assert_array_equal(a, b, err_msg=name)


STEP_SECONDS = np.array([[0.10, 0.20, 0.15], [0.12, 0.18, 0.30], [0.11, 0.25, 0.14], [0.09, 0.21, 0.16]])
STEP_TOKENS = np.array([[5, 6, 7], [1, 2, 3], [4, 4, 4], [0, 9, 2]])


def test_the_merge_of_every_shard_equals_the_whole_window_of_the_same_pairs():
    pairs = routed_pairs()
    kw = dict(step_seconds=STEP_SECONDS, step_tokens=STEP_TOKENS)
    whole = window_from_pairs(pairs, list(range(W)), **kw)
    shards = shards_of(pairs, **kw)
    merged = sh.merge_shards(shards[::-1])  # arrival order does not matter
    assert_same_window(merged, whole)
    assert merged.shard is None and merged.shards_report.to_dict() == {
        "count": W, "received": [0, 1, 2, 3], "missing": [], "refused": []}
    assert merged.extra["rank_step_seconds"] == STEP_SECONDS.tolist()
    assert merged.missing_evidence == whole.missing_evidence == []
    assert diagnose(merged).to_dict()["layers"] == diagnose(whole).to_dict()["layers"]
    # Each shard alone is a valid window whose traffic is its own rank's row only.
    for r, shard in enumerate(shards):
        assert shard.traffic[:, np.arange(W) != r].sum() == 0 and shard.traffic[:, r].sum() > 0


def test_logical_shards_get_their_traffic_from_the_source_rank_and_the_map():
    """Engine shards carry expert counts only; with one slot per expert (P = E, a permuted map) the
    merge builds slot counts, traffic and local / sent / received exactly as the pairs say."""
    pmap = np.stack([np.roll(np.arange(E), 3), np.arange(E)[::-1]])
    pairs = routed_pairs(seed=3, pmap=pmap)
    whole = window_from_pairs(pairs, list(range(W)), pmap=pmap, timed=False)
    shards = shards_of(pairs, pmap=pmap, rank_level=False, timed=False)
    assert all(s.traffic is None and s.slot_tokens is None for s in shards)
    merged = sh.merge_shards(shards)
    assert_same_window(merged, whole)
    assert "rank_load" not in merged.missing_evidence and "cross_rank" not in merged.missing_evidence


def test_logical_shards_with_replicas_carry_no_invented_rank_counts():
    """With redundant slots, expert counts do not say which replica computed a pair: no traffic."""
    merged = sh.merge_shards(shards_of(routed_pairs(), rank_level=False))
    assert merged.traffic is None and merged.slot_tokens is None and merged.local_tokens is None
    assert "rank_load" in merged.missing_evidence


def test_shards_that_count_receptions_keep_slot_loads_but_form_no_traffic_rows():
    """A source that sees what its rank's slots received (SGLang's DeepEP low-latency gatherers without
    moewatch's routed counts: extra.source.counts = "received") sends each rank's own slots' loads:
    summed they are the slot loads, but no shard is a source row, so no traffic is built from them."""
    pairs = routed_pairs(seed=5)
    whole = window_from_pairs(pairs, list(range(W)), timed=False)
    shards = []
    for r in range(W):
        own_slots = np.where(SLOT_RANK[None, :] == r, whole.slot_tokens, 0)
        pmap_experts = np.zeros((L, E), np.int64)
        np.add.at(pmap_experts, (np.arange(L)[:, None], PMAP), own_slots)
        shards.append(Window(**{**{n: getattr(whole, n) for n in SCALAR_FIELDS},
                                "physical_to_logical_map": PMAP, "expert_tokens": pmap_experts,
                                "slot_tokens": own_slots, "capacity_factor": np.zeros(L),
                                "dropped_tokens": np.zeros((L, E), np.int64),
                                "rerouted_tokens": np.zeros((L, E), np.int64),
                                "extra": {"source": {"counts": "received"},
                                          "shard": {"index": r, "count": W, "rank": r, "sequence": 1}}}))
    assert all(sh.counts_received(s) for s in shards)
    merged = sh.merge_shards(shards)
    np.testing.assert_array_equal(merged.slot_tokens, whole.slot_tokens)
    np.testing.assert_array_equal(merged.expert_tokens, whole.expert_tokens)
    assert merged.traffic is None and merged.local_tokens is None and merged.sent_tokens is None
    assert "cross_rank" in merged.missing_evidence and "rank_load" not in merged.missing_evidence


def test_traffic_row_is_each_shards_source_rank_and_slots_count_on_their_rank():
    slot_counts = [np.zeros((1, 8), np.int64), np.zeros((1, 8), np.int64)]
    slot_counts[0][0, [0, 5, 7]] = [3, 2, 1]  # shard from rank 1: slots 0 (rank 0), 5 (rank 2), 7 (rank 3)
    slot_counts[1][0, [2, 3]] = [4, 6]  # shard from rank 3: both slots on rank 1
    traffic = sh.traffic_from_sources([1, 3], slot_counts, 4)
    expected = np.zeros((1, 4, 4), np.int64)
    expected[0, 1] = [3, 0, 2, 1]
    expected[0, 3] = [0, 10, 0, 0]
    np.testing.assert_array_equal(traffic, expected)


def test_a_missing_shard_is_named_its_rank_untimed_and_the_counts_are_the_others():
    pairs = routed_pairs()
    shards = shards_of(pairs, step_seconds=STEP_SECONDS, step_tokens=STEP_TOKENS)
    merged = sh.merge_shards(shards[:2] + shards[3:], missing=[2])
    present = window_from_pairs(pairs, [0, 1, 3], timed=False, step_seconds=STEP_SECONDS, step_tokens=STEP_TOKENS)
    for name in ("expert_tokens", "slot_tokens", "traffic", "local_tokens", "sent_tokens", "received_tokens",
                 "step_seconds", "step_tokens"):
        np.testing.assert_array_equal(getattr(merged, name), getattr(present, name), err_msg=name)
    # Rank 2 was measured by nobody: its timings are unknown, not zero.
    assert merged.layer_seconds is None and merged.dispatch_seconds is None and merged.wait_seconds is None
    assert merged.extra["shards"] == {"count": 4, "received": [0, 1, 3], "missing": [2], "refused": []}
    assert merged.extra["rank_step_seconds"][2] is None
    assert "shards" in merged.missing_evidence and "a2a_time" in merged.missing_evidence
    layer0 = diagnose(merged).to_dict()["layers"][0]
    assert "shards" in layer0["missing"] and any("shards" in line for line in layer0["evidence"])
    back = Window.from_json(merged.to_json())
    assert back.missing_evidence == merged.missing_evidence


@pytest.mark.parametrize("change, reason", [
    (lambda w: w.replace(physical_to_logical_map=np.tile((np.arange(P) + 1) % E, (L, 1))), "map_mismatch"),
    (lambda w: w.replace(epoch=3), "epoch_mismatch"),
    (lambda w: w.replace(hidden_bytes=2048), "sizes_mismatch"),
    (lambda w: w.replace(extra={**w.extra, "shard": {**w.extra["shard"], "count": 5}}), "count_mismatch"),
])
def test_a_shard_that_disagrees_with_the_others_is_refused_never_half_merged(change, reason):
    pairs = routed_pairs()
    shards = shards_of(pairs)
    odd = change(shards[1])
    kept, refused = sh.agreement([shards[0], odd, shards[2], shards[3]])
    assert [w.shard.index for w in kept] == [0, 2, 3]
    assert [(w.shard.index, why) for w, why in refused] == [(1, reason)]
    merged = sh.merge_shards(kept, refused=[1])
    np.testing.assert_array_equal(merged.expert_tokens, window_from_pairs(pairs, [0, 2, 3]).expert_tokens)
    assert merged.extra["shards"]["refused"] == [1] and "shards" in merged.missing_evidence
    with pytest.raises(ValueError):
        sh.merge_shards([shards[0], odd])


def test_on_a_tie_the_side_with_the_lowest_shard_index_is_kept():
    shards = shards_of(routed_pairs())
    later = [w.replace(epoch=1) for w in shards[2:]]
    kept, refused = sh.agreement([later[1], shards[1], later[0], shards[0]])
    assert [w.shard.index for w in kept] == [0, 1]
    assert [(w.shard.index, why) for w, why in refused] == [(2, "epoch_mismatch"), (3, "epoch_mismatch")]


def test_step_data_is_merged_only_when_the_shards_have_the_same_steps():
    pairs = routed_pairs()
    shards = shards_of(pairs, step_seconds=STEP_SECONDS, step_tokens=STEP_TOKENS)
    merged = sh.merge_shards(shards)
    np.testing.assert_array_equal(merged.step_seconds, STEP_SECONDS.max(axis=0))
    np.testing.assert_array_equal(merged.step_tokens, STEP_TOKENS.sum(axis=0))
    longer = window_from_pairs(pairs, [3], step_seconds=np.hstack([STEP_SECONDS, STEP_SECONDS[:, :1]]),
                               step_tokens=np.hstack([STEP_TOKENS, STEP_TOKENS[:, :1]]),
                               shard={"index": 3, "count": W, "rank": 3, "sequence": 7})
    uneven = sh.merge_shards(shards[:3] + [longer])
    assert uneven.steps == 4 and uneven.step_seconds is None and uneven.step_tokens is None
    assert "steps" in uneven.missing_evidence
    assert [len(x) for x in uneven.extra["rank_step_seconds"]] == [3, 3, 3, 4]
    assert uneven.start_time == min(s.start_time for s in shards)
    # A rank that ran no steps in the window (an idle DP rank's empty shard) adds no step data.
    idle = shards[3].replace(steps=0, step_seconds=np.zeros(0), step_tokens=np.zeros(0, np.int64))
    with_idle = sh.merge_shards(shards[:3] + [idle])
    assert with_idle.steps == 3
    np.testing.assert_array_equal(with_idle.step_seconds, STEP_SECONDS[:3].max(axis=0))
    np.testing.assert_array_equal(with_idle.step_tokens, STEP_TOKENS[:3].sum(axis=0))


def test_time_span_is_the_union_of_the_shards():
    pairs = routed_pairs()
    shards = [window_from_pairs(pairs, [r], start=100.0 + r, end=110.0 + 2 * r,
                                shard={"index": r, "count": W, "rank": r, "sequence": 1}) for r in range(W)]
    merged = sh.merge_shards(shards)
    assert (merged.start_time, merged.end_time) == (100.0, 116.0)


def test_engine_rebalance_records_are_kept_once_per_call():
    pairs = routed_pairs()
    record = {"engine": "vllm", "layer_outcomes": {}, "experts_moved": 4}
    shards = [window_from_pairs(pairs, [r], shard={"index": r, "count": W, "rank": r, "sequence": 2},
                                extra={"engine_rebalance": [{**record, "call": 1, "digest": f"d{r}"},
                                                            {**record, "note": r}]}) for r in range(W)]
    merged = sh.merge_shards(shards)
    records = merged.extra["engine_rebalance"]
    assert [(r.get("call"), r.get("digest"), r.get("note")) for r in records] == [(1, "d0", None), (None, None, 0)]
    assert sh.rebalance_digests(shards[2]) == {1: "d2"}


def test_the_step_a2a_total_is_the_mean_over_the_shards_and_other_extra_comes_from_the_lowest():
    pairs = routed_pairs()
    shards = [window_from_pairs(pairs, [r], shard={"index": r, "count": W, "rank": r, "sequence": 2},
                                extra={"a2a_step_seconds": float(r), "source": {"kind": f"k{r}"}}) for r in range(W)]
    merged = sh.merge_shards(shards)
    assert merged.extra["a2a_step_seconds"] == 1.5 and merged.extra["source"] == {"kind": "k0"}


# --- the shard identity in the window contract -------------------------------------------------------

@pytest.mark.parametrize("shard, field", [
    ([1, 2], "shard"),
    ({"count": 2, "rank": 0, "sequence": 1}, "shard.index"),
    ({"index": 0, "count": 2, "rank": 0}, "shard.sequence"),
    ({"index": 2, "count": 2, "rank": 0, "sequence": 1}, "shard.index"),
    ({"index": 0, "count": 0, "rank": 0, "sequence": 1}, "shard.count"),
    ({"index": 0, "count": 2, "rank": W, "sequence": 1}, "shard.rank"),
    ({"index": 0, "count": 2, "rank": 0, "sequence": -1}, "shard.sequence"),
    ({"index": True, "count": 2, "rank": 0, "sequence": 1}, "shard.index"),
    ({"index": 0, "count": 2, "rank": 1.5, "sequence": 1}, "shard.rank"),
])
def test_a_malformed_shard_rejects_the_window_naming_the_key(shard, field):
    whole = window_from_pairs(routed_pairs(), list(range(W)))
    data = {**whole.to_dict(), "shard": shard}
    with pytest.raises(WindowError) as err:
        Window.from_dict(data)
    assert err.value.field == field


@pytest.mark.parametrize("report, field", [
    ({"count": 0, "received": []}, "shards.count"),
    ({"count": 2, "received": [0], "missing": [2]}, "shards.missing"),
    ({"count": 2, "received": "0"}, "shards.received"),
])
def test_a_malformed_shards_report_rejects_the_window(report, field):
    whole = window_from_pairs(routed_pairs(), list(range(W)))
    with pytest.raises(WindowError) as err:
        Window.from_dict({**whole.to_dict(), "shards": report})
    assert err.value.field == field


def test_the_shard_survives_json_and_the_binary_wire_form_and_meets_the_schema():
    shard = shards_of(routed_pairs())[2]
    assert shard.shard == Shard(index=2, count=W, rank=2, sequence=7)
    for back in (Window.from_json(shard.to_json()), Window.from_bytes(shard.to_bytes()),
                 wire.FrameDecoder().feed(wire.encode(shard))[0]):
        assert back.shard == shard.shard
    jsonschema.validate(shard.to_dict(), packaged_schema())
    merged = sh.merge_shards(shards_of(routed_pairs()))
    jsonschema.validate(merged.to_dict(), packaged_schema())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**shard.to_dict(), "shard": {"index": 0, "count": 0, "rank": 0, "sequence": 0}},
                            packaged_schema())


def test_shard_extra_checks_what_an_engine_adapter_sends():
    assert sh.shard_extra(1, 2, 3, 40, world_size=4) == {"shard": {"index": 1, "count": 2, "rank": 3, "sequence": 40}}
    with pytest.raises(WindowError) as err:
        sh.shard_extra(2, 2, 0, 0, world_size=4)
    assert err.value.field == "shard.index"


def test_policy_digest_is_over_values_not_dtypes_and_sees_every_change():
    a = np.arange(12).reshape(3, 4)
    same = sh.policy_digest(a.astype(np.int32), {"x": 1, "y": [2.5]}, 0.75)
    assert same == sh.policy_digest(a.astype(np.int64), {"y": [2.5], "x": 1}, 0.75)
    assert len(same) == 64 and int(same, 16) >= 0
    assert same != sh.policy_digest(a.reshape(4, 3).astype(np.int64), {"x": 1, "y": [2.5]}, 0.75)
    changed = a.copy()
    changed[2, 3] += 1
    assert same != sh.policy_digest(changed, {"x": 1, "y": [2.5]}, 0.75)
    assert same != sh.policy_digest(a, {"x": 1, "y": [2.5]}, 0.76)


# --- the hello -----------------------------------------------------------------------------------------

def test_a_shards_hello_names_it_and_a_whole_runtimes_hello_is_framed_as_before():
    base = dict(runtime="vllm", model="m", ep_group="g", world_size=4, num_layers=2, num_experts=8, num_slots=8)
    shard = wire.Hello(**base, shard_index=1, shard_count=4)
    back = wire.FrameDecoder().feed(wire.encode(shard))[0]
    assert (back.shard_index, back.shard_count, back.sharded) == (1, 4, True)
    whole = wire.Hello(**base)
    payload = wire.encode(whole)[wire.HEADER.size:]
    assert b"shard" not in payload  # an agent that predates shards reads it as before
    old_peer = wire.FrameDecoder().feed(wire.encode(whole))[0]
    assert (old_peer.shard_index, old_peer.shard_count, old_peer.sharded) == (0, 1, False)
    for bad in ({"shard_index": 4, "shard_count": 4}, {"shard_count": 0}, {"shard_index": -1, "shard_count": 2}):
        with pytest.raises(ValueError, match="hello.shard_"):
            wire.Hello(**base, **bad)


# --- moewatch diagnose on shard files ---------------------------------------------------------------------

def test_diagnose_merges_the_shard_files_of_one_window_as_the_agent_does(tmp_path):
    pairs = routed_pairs()
    whole = window_from_pairs(pairs, list(range(W)))
    paths = []
    for r, shard in enumerate(shards_of(pairs)):
        path = tmp_path / f"shard-{r}.{'json' if r % 2 else 'bin'}"
        path.write_bytes(shard.to_json().encode() if r % 2 else shard.to_bytes())
        paths.append(str(path))
    (tmp_path / "whole.json").write_text(whole.to_json())

    def run(*args):
        return CliRunner().invoke(main, ["diagnose", *args, "--json"], catch_exceptions=False)

    merged, reference = run(*paths), run(str(tmp_path / "whole.json"))
    assert merged.exit_code == 0 and reference.exit_code == 0, merged.output
    assert json.loads(merged.output)["layers"] == json.loads(reference.output)["layers"]
    partial = json.loads(run(*paths[:3]).output)
    assert "shards" in partial["summary"]["missing"] and "a2a_time" in partial["summary"]["missing"]
    # A lone shard is its group's window without the other shards, not the group's window.
    assert "shards" in json.loads(run(paths[0]).output)["summary"]["missing"]
    other = tmp_path / "other-sequence.json"
    other.write_text(shards_of(pairs, sequence=8)[3].to_json())
    bad_inputs = (((*paths[:3], str(other)), "sequence 8"), ((paths[0], str(tmp_path / "whole.json")), "not a shard"),
                  ((paths[0], paths[0]), "given twice"))
    for bad, says in bad_inputs:
        result = CliRunner().invoke(main, ["diagnose", *bad])
        assert result.exit_code == 2 and says in result.output, result.output


def test_recorded_shards_are_merged_per_sequence_once_each_and_whole_windows_kept():
    """What `moewatch ledger` and `moewatch replay` read from files: shards grouped by model, group and
    sequence and merged as the agent merges them; a shard read twice counts once; a whole window as it is."""
    from moewatch.shards import merge_recorded

    pairs = routed_pairs()
    whole = window_from_pairs(pairs, list(range(W)), start=90.0, end=91.0)
    shards = shards_of(pairs)
    got, refused = merge_recorded([whole, *shards, shards[1]])
    assert refused == [] and len(got) == 2 and got[0] is whole
    assert_same_window(got[1], window_from_pairs(pairs, list(range(W))))
