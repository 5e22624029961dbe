"""NCCL Inspector output (fixtures under fixtures/nccl/, in the shape of NCCL 2.30.7's
inspector_json.cc and inspector_prom.cc: see their README) -> all-to-all time in a Window, matched
to layers only where the order makes it certain; DeepEP low-latency wait cycles -> seconds."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from moewatch import telemetry as tm
from moewatch.integrations.base import SourceError
from moewatch.integrations.nccl import a2a, deepep, inspector
from moewatch.telemetry import Window, WindowError
from moewatch.triage import diagnose

FIXTURES = Path(__file__).parent / "fixtures" / "nccl"
L, W, S = 2, 2, 2


def window(**overrides) -> Window:
    """Two layers, two experts on two ranks, two steps: step and layer time, no all-to-all time."""
    fields = dict(
        runtime="vllm", model="m", ep_group="g", world_size=W, ranks_per_node=W, num_layers=L, num_experts=2,
        num_slots=2, top_k=1, epoch=0, steps=S, start_time=0.0, end_time=1.0, hidden_bytes=1024,
        physical_to_logical_map=[[0, 1], [0, 1]], expert_tokens=[[60, 40], [50, 50]], capacity_factor=[0.0, 0.0],
        step_seconds=[0.002, 0.002], step_tokens=[50, 50])
    fields.update(overrides)
    return Window(**fields)


def test_json_lines_parse_to_collective_records():
    log = inspector.read_dump_dir(FIXTURES)
    assert log.p2p_records == 2  # one Send per file, counted and not timed
    assert len(log.collectives) == W * S * L * 3  # per layer and step: dispatch, combine, AllReduce
    first = min((r for r in log.collectives if r.rank == 1), key=lambda r: r.seq)
    assert (first.op, first.seq, first.num_ranks, first.comm_name) == ("All2All", 41, 2, "ep_group")
    assert first.exec_seconds == pytest.approx(110e-6) and first.timing_source == "kernel_gpu"


def test_records_in_certain_order_match_layers_and_phases():
    log = inspector.read_dump_dir(FIXTURES)
    got = a2a.match_records(log.collectives, num_layers=L, world_size=W, steps=S)
    assert got.matched == a2a.PER_LAYER and got.ranks == [0, 1]
    # fixture: rank r, step s, layer l: dispatch 100(l+1) + 10r + s us, combine 50(l+1) + 10r + s us
    for layer in range(L):
        for rank in range(W):
            assert got.dispatch_seconds[layer, rank] == pytest.approx((2 * (100 * (layer + 1) + 10 * rank) + 1) * 1e-6)
            assert got.combine_seconds[layer, rank] == pytest.approx((2 * (50 * (layer + 1) + 10 * rank) + 1) * 1e-6)
    w = a2a.attach(window(layer_seconds=[[0.001, 0.001], [0.002, 0.002]]), got)
    assert w.extra["source"]["a2a_time"]["matched"] == "per-layer"
    assert w.extra["source"]["a2a_time"]["communicator"] == "0x5f1e2d3c4b5a6978"
    # The triage's step 1 is answered per layer now.
    share = tm.a2a_share(w)
    assert share[0] == pytest.approx(got.dispatch_seconds[0].sum() / 0.002 + got.combine_seconds[0].sum() / 0.002)
    assert "a2a_time" not in diagnose(w).layers[0].missing
    # The JSON form keeps the provenance.
    assert Window.from_json(w.to_json()).extra["source"]["a2a_time"]["kind"] == "nccl-inspector"


def _log_without(seq: int, rank: int = 0):
    log = inspector.read_dump_dir(FIXTURES)
    return [r for r in log.collectives if not (r.rank == rank and r.seq == seq)]


def test_a_dropped_record_leaves_a_per_step_total_only():
    records = _log_without(43)  # an AllReduce of rank 0: its gap makes every later position uncertain
    got = a2a.match_records(records, num_layers=L, world_size=W, steps=S)
    assert got.matched == a2a.PER_STEP and got.dispatch_seconds is None
    assert any("gaps" in why for why in got.provenance["why"])
    totals = [sum(r.exec_seconds for r in records if r.rank == k and r.op == "All2All") for k in range(W)]
    assert got.step_total_seconds == pytest.approx(np.mean(totals))


def test_a_wrong_count_or_a_missing_rank_is_per_step():
    log = inspector.read_dump_dir(FIXTURES)
    assert a2a.match_records(log.collectives, num_layers=L, world_size=W, steps=3).matched == a2a.PER_STEP
    rank0 = [r for r in log.collectives if r.rank == 0]
    got = a2a.match_records(rank0, num_layers=L, world_size=W, steps=S, communicator="ep_group")
    assert got.matched == a2a.PER_STEP and got.ranks == [0]
    assert "ranks without records: [1]" in got.provenance["why"]


def test_per_step_total_gives_the_per_step_form_of_step_one():
    got = a2a.match_records(_log_without(43), num_layers=L, world_size=W, steps=S)
    w = a2a.attach(window(), got)
    assert w.dispatch_seconds is None and "a2a_time" in w.missing_evidence
    share = tm.a2a_step_share(w)
    assert share == pytest.approx(got.step_total_seconds / 0.004)
    d = diagnose(w)
    assert d.summary["a2a_step_share"] == pytest.approx(share)
    assert any("Per step, all layers together" in e for e in d.layers[0].evidence)
    # Round trips and survives validation; a bad value is refused whole, the key named.
    assert Window.from_json(w.to_json()).extra[tm.STEP_A2A_KEY] == pytest.approx(got.step_total_seconds)
    with pytest.raises(WindowError) as e:
        window(extra={tm.STEP_A2A_KEY: -1.0})
    assert e.value.field == tm.STEP_A2A_KEY


def test_no_per_step_share_without_step_time():
    got = a2a.match_records(_log_without(43), num_layers=L, world_size=W, steps=S)
    w = a2a.attach(window(step_seconds=None, step_tokens=None), got)
    assert tm.a2a_step_share(w) is None and diagnose(w).summary["a2a_step_share"] is None


def test_communicator_must_be_certain():
    log = inspector.read_dump_dir(FIXTURES)
    other = [dataclasses.replace(r, communicator="0xother") for r in log.collectives]
    with pytest.raises(SourceError, match="name it"):
        a2a.match_records(list(log.collectives) + other, num_layers=L, world_size=W, steps=S)
    with pytest.raises(SourceError, match="no NCCL Inspector records"):
        a2a.match_records(log.collectives, num_layers=L, world_size=W, steps=S, communicator="nope")


def test_foreign_lines_are_refused_naming_the_line(tmp_path):
    with pytest.raises(SourceError) as e:
        inspector.parse_json_lines(['{"header": {}, "coll_perf": {"coll": "All2All"}}'], where="x.log")
    assert e.value.field == "x.log:1"
    with pytest.raises(SourceError, match="not JSON"):
        inspector.parse_json_lines(["{"], where="y.log")
    good = json.loads((FIXTURES / "node-a-pid4100.log").read_text().splitlines()[0])
    good["coll_perf"]["coll_exec_time_us"] = -3
    with pytest.raises(SourceError, match="finite"):
        inspector.parse_json_lines([json.dumps(good)])
    with pytest.raises(SourceError, match="no NCCL Inspector"):
        inspector.read_dump_dir(tmp_path)


def test_prom_textfile_gives_a_per_step_total_from_means():
    means = inspector.prom_collective_means((FIXTURES / "inspector.prom").read_text())
    assert {(m.op, m.comm_name) for m in means} == {("All2All", "ep_group"), ("AllReduce", "tp_group")}
    got = a2a.from_prom_means(means, calls_per_step=2 * L, steps=S)
    assert got.matched == a2a.PER_STEP and got.step_total_seconds == pytest.approx(80e-6 * 2 * L * S)
    assert got.provenance["kind"] == "nccl-inspector-prom" and got.provenance["gpus"] == ["GPU0"]
    w = a2a.attach(window(), got)
    assert tm.a2a_step_share(w) == pytest.approx(80e-6 * 2 * L * S / 0.004)
    with pytest.raises(SourceError, match="no All2All"):
        a2a.from_prom_means(means, calls_per_step=4, steps=S, comm_name="tp_group")
    with pytest.raises(SourceError):
        inspector.prom_collective_means("this is { not prometheus")


def test_deepep_wait_cycles_to_seconds():
    before = np.zeros((1, 2, 2), dtype=np.int64)
    after = np.array([[[1000, 3000], [500, 200]]], dtype=np.int64)
    assert np.allclose(deepep.wait_seconds(before, after, 1e6), [[3e-3, 5e-4]])
    # A counter that went down was zeroed: it counts whole from zero.
    assert np.allclose(deepep.wait_seconds(after, before + 7, 1e6), [[7e-6, 7e-6]])
    with pytest.raises(ValueError):
        deepep.wait_seconds(before, after[:, :1], 1e6)
    with pytest.raises(ValueError):
        deepep.wait_seconds(before, after, 0.0)


def test_diagnose_reads_the_inspector_output_beside_a_window(tmp_path):
    from click.testing import CliRunner

    from moewatch.cli import main

    path = tmp_path / "w.json"
    path.write_text(window(layer_seconds=[[0.001, 0.001], [0.002, 0.002]]).to_json())
    result = CliRunner().invoke(main, ["diagnose", str(path), "--json", "--nccl-inspector", str(FIXTURES)])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["layers"][0]["metrics"]["a2a_share"] is not None and "a2a_time" not in out["layers"][0]["missing"]
    prom = CliRunner().invoke(main, ["diagnose", str(path), "--nccl-inspector", str(FIXTURES / "inspector.prom")])
    assert prom.exit_code == 0 and "of step time (per step, all layers together)" in prom.output
    bad = CliRunner().invoke(main, ["diagnose", str(path), "--nccl-inspector", str(tmp_path)])
    assert bad.exit_code == 2 and "--nccl-inspector" in bad.output
