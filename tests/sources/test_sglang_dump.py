"""SGLang's expert-distribution dumps, written by SGLang's own accumulators, read back as Windows."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
from click.testing import CliRunner

from moewatch.cli import main
from moewatch.integrations.base import SourceError
from moewatch.integrations.sglang.dump import DumpWatcher, load_source, read_dump
from moewatch.telemetry import rank_load

# 2 layers, 4 logical experts in 6 slots on 2 ranks (3 slots each); expert 0 has a replica.
PMAP = np.array([[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 2, 3]])


def _logical(physical: np.ndarray) -> np.ndarray:
    """Independent recount: physical counts [.., L, P] -> logical [.., L, E] through PMAP."""
    out = np.zeros((*physical.shape[:-1], 4), dtype=np.int64)
    for layer in range(PMAP.shape[0]):
        for slot, expert in enumerate(PMAP[layer]):
            out[..., layer, expert] += physical[..., layer, slot]
    return out


def _passes(n: int, seed: int = 0) -> list[tuple[int, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(i, rng.integers(0, 50, size=PMAP.shape)) for i in range(n)]


def test_stat_dump_wrapped_buffer_sums_the_newest_passes(sglang_recorder, tmp_path, monkeypatch):
    passes = _passes(5)
    meta = sglang_recorder.metadata(PMAP, ep_size=2)
    sglang_recorder.dump(tmp_path, monkeypatch, "stat", meta, 0, passes, buffer_size=3)
    (path,) = tmp_path.iterdir()
    dump = read_dump(path)
    assert dump.kind == "stat" and dump.logical_count.shape == (3, 2, 4)
    # Five passes into three rows: rows hold passes 3, 4, 2 (out of time order after the wrap).
    assert np.array_equal(dump.logical_count[0], _logical(passes[3][1]))
    window = load_source(path)
    expected = sum(_logical(c) for _, c in passes[2:])
    assert np.array_equal(window.expert_tokens, expected)
    assert window.steps == 3 and window.runtime == "sglang"
    assert window.extra["source"]["buffer_full"] is True
    assert window.slot_tokens is None and window.layer_seconds is None and window.step_seconds is None
    assert "rank_load" in window.missing_evidence and "a2a_time" in window.missing_evidence


def test_stat_dump_zero_rows_are_unused_not_steps(sglang_recorder, tmp_path, monkeypatch):
    passes = _passes(2, seed=1)
    meta = sglang_recorder.metadata(PMAP, ep_size=2)
    sglang_recorder.dump(tmp_path, monkeypatch, "stat", meta, 0, passes, buffer_size=6)
    window = load_source(next(tmp_path.iterdir()))
    assert window.steps == 2
    assert window.extra["source"]["rows_used"] == 2 and window.extra["source"]["buffer_full"] is False
    assert np.array_equal(window.expert_tokens, _logical(passes[0][1] + passes[1][1]))


def test_per_pass_dumps_of_every_rank_give_slot_counts_and_rank_load(sglang_recorder, tmp_path, monkeypatch):
    meta = sglang_recorder.metadata(PMAP, ep_size=2)
    rank_passes = {0: _passes(3, seed=2), 1: [(i, c) for i, c in _passes(3, seed=3)]}
    for rank, passes in rank_passes.items():
        sglang_recorder.dump(tmp_path, monkeypatch, "per_pass", meta, rank, passes)
    assert len(list(tmp_path.iterdir())) == 2
    window = load_source(tmp_path)
    slots = sum(c for passes in rank_passes.values() for _, c in passes)
    assert np.array_equal(window.slot_tokens, slots)
    assert np.array_equal(window.expert_tokens, _logical(slots))
    assert np.array_equal(window.physical_to_logical_map, PMAP)
    assert window.world_size == 2 and window.steps == 3
    assert np.array_equal(rank_load(window), slots.reshape(2, 2, 3).sum(axis=2))
    assert window.local_tokens is None and window.dispatch_seconds is None


def test_diagnose_skewed_per_pass_folder_is_imbalance_bound(sglang_recorder, tmp_path, monkeypatch):
    meta = sglang_recorder.metadata(PMAP, ep_size=2)
    hot = np.full(PMAP.shape, 10)
    hot[:, 0] = 400  # slot 0 (rank 0) takes most pairs in both layers
    for rank in (0, 1):
        sglang_recorder.dump(tmp_path, monkeypatch, "per_pass", meta, rank, [(0, hot), (1, hot)])
    result = CliRunner().invoke(main, ["diagnose", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    layers = json.loads(result.output)["layers"]
    assert [d["verdict"] for d in layers] == ["imbalance-bound"] * 2
    assert all("rank_load" not in d["missing"] and "a2a_time" in d["missing"] for d in layers)


def test_diagnose_skewed_stat_dump_names_hot_experts(sglang_recorder, tmp_path, monkeypatch):
    meta = sglang_recorder.metadata(PMAP, ep_size=2)
    hot = np.full(PMAP.shape, 5)
    hot[:, 0] = 300
    sglang_recorder.dump(tmp_path, monkeypatch, "stat", meta, 0, [(0, hot)], buffer_size=4)
    result = CliRunner().invoke(main, ["diagnose", str(next(tmp_path.iterdir())), "--json"])
    assert result.exit_code == 0, result.output
    layers = json.loads(result.output)["layers"]
    assert [(d["verdict"], d["cause"]) for d in layers] == [("imbalance-bound", "hot-experts")] * 2
    assert layers[0]["metrics"]["hot_experts"][0] == 0


def test_bad_dumps_exit_2_with_one_line(sglang_recorder, tmp_path, monkeypatch):
    import torch

    meta = sglang_recorder.metadata(PMAP, ep_size=2)
    sglang_recorder.dump(tmp_path / "ok", monkeypatch, "stat", meta, 0, _passes(2), buffer_size=4)
    good = next((tmp_path / "ok").iterdir())
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.zeros(3)}, foreign)
    sglang_recorder.dump(tmp_path / "pp", monkeypatch, "per_pass", meta, 1, _passes(1))
    one_rank = next((tmp_path / "pp").iterdir())
    runner = CliRunner()
    for path, words in ((truncated, "not a loadable torch file"), (foreign, "not an SGLang"),
                        (one_rank, "per_pass dump holds one rank")):
        result = runner.invoke(main, ["diagnose", str(path)])
        assert result.exit_code == 2, (path, result.output)
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and words in lines[0] and "Traceback" not in result.output
    # A folder holding rank 1's dump only: rank 0 is missing.
    result = runner.invoke(main, ["diagnose", str(tmp_path / "pp")])
    assert result.exit_code == 2 and "every rank" in result.output


def test_watcher_ingests_each_dump_set_once(sglang_recorder, tmp_path, monkeypatch):
    meta = sglang_recorder.metadata(PMAP, ep_size=2)
    now = [time.time() + 100]
    errors = []
    watcher = DumpWatcher(tmp_path, settle_seconds=5, clock=lambda: now[0], on_error=errors.append,
                          model="m", ep_group="g")
    assert watcher.poll() == []
    sglang_recorder.dump(tmp_path, monkeypatch, "stat", meta, 0, _passes(2), buffer_size=4)
    first = watcher.poll()
    assert len(first) == 1 and first[0].model == "m" and first[0].ep_group == "g"
    assert watcher.poll() == []  # seen once, never again
    for rank in (0, 1):
        sglang_recorder.dump(tmp_path, monkeypatch, "per_pass", meta, rank, _passes(1, seed=rank))
    (tmp_path / "expert_distribution_recorder_1.0.pt").write_bytes(b"junk")
    later = watcher.poll()
    assert [w.world_size for w in later] == [2]
    assert len(errors) == 1 and "not a loadable torch file" in errors[0]
    assert later[0].start_time == first[0].end_time  # successive dumps tile time
    assert watcher.poll() == [] and watcher.windows == 2


def test_per_pass_set_waits_for_the_other_ranks(sglang_recorder, tmp_path, monkeypatch):
    meta = sglang_recorder.metadata(PMAP, ep_size=2)
    sglang_recorder.dump(tmp_path, monkeypatch, "per_pass", meta, 0, _passes(1))
    path = next(tmp_path.iterdir())
    os.utime(path, (time.time(), time.time()))
    watcher = DumpWatcher(tmp_path, settle_seconds=60)
    assert watcher.poll() == []  # too fresh: rank 1 may still be writing


def test_read_dump_names_the_file(tmp_path):
    with pytest.raises(SourceError, match="no such file"):
        read_dump(tmp_path / "missing.pt")
