"""The pieces every engine adapter shares: settings from the environment, graph-safe counters, the
window built from logical counts, the folder sink."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
import torch

from moewatch.runtime.engines import common
from moewatch.telemetry import Window


def test_settings_are_inactive_without_a_destination_and_name_the_bad_variable():
    assert common.EngineSettings.from_env({}) is None
    assert common.EngineSettings.from_env({"MOEWATCH_WINDOW_STEPS": "5"}) is None
    s = common.EngineSettings.from_env({"MOEWATCH_WINDOW_DIR": "/tmp/x"})
    assert (s.window_dir, s.socket, s.window_steps, s.window_seconds) == ("/tmp/x", None, 50, None)
    s = common.EngineSettings.from_env({"MOEWATCH_SOCKET": "/run/a.sock", "MOEWATCH_WINDOW_SECONDS": "2.5"})
    assert (s.window_steps, s.window_seconds) == (None, 2.5)
    for env, name in [({"MOEWATCH_WINDOW_DIR": "d", "MOEWATCH_WINDOW_STEPS": "ten"}, "MOEWATCH_WINDOW_STEPS"),
                      ({"MOEWATCH_WINDOW_DIR": "d", "MOEWATCH_WINDOW_STEPS": "0"}, "MOEWATCH_WINDOW_STEPS"),
                      ({"MOEWATCH_WINDOW_DIR": "d", "MOEWATCH_WINDOW_SECONDS": "-1"}, "MOEWATCH_WINDOW_SECONDS"),
                      ({"MOEWATCH_WINDOW_DIR": "d", "MOEWATCH_WINDOW_SECONDS": "x"}, "MOEWATCH_WINDOW_SECONDS")]:
        with pytest.raises(ValueError, match=name):
            common.EngineSettings.from_env(env)


def test_counter_counts_only_armed_tokens_and_allocates_nothing_per_step():
    weights = common.PairWeights(max_tokens=8, top_k=2, device="cpu")
    counter = common.PairCounter(4, weights.tensor)
    ids = torch.tensor([[0, 1], [1, 2], [3, 3], [2, 0]], dtype=torch.int32)  # 4 tokens, the last 2 padding
    counter.add(ids)  # not armed: warm-up / dummy run
    assert counter.counts.tolist() == [0, 0, 0, 0]
    weights.arm(2)
    storage = counter.counts.data_ptr()
    counter.add(ids)
    weights.disarm()
    counter.add(ids)
    assert counter.counts.data_ptr() == storage
    assert counter.counts.tolist() == [1, 2, 1, 0]
    assert weights.tensor.sum().item() == 0
    # what a flush reads: the cumulative counts, never zeroed (the recorder differences its reads)
    assert counter.buffers()["expert_tokens"] is counter.counts and "slot_tokens" not in counter.buffers()


def test_counter_survives_torch_compile():
    weights = common.PairWeights(max_tokens=16, top_k=2, device="cpu")
    counter = common.PairCounter(4, weights.tensor)

    @torch.compile(backend="eager", fullgraph=True)
    def route(x):
        ids = torch.topk(x, 2, dim=-1).indices
        counter.add(ids)
        return ids

    x = torch.tensor([[0.0, 1, 2, 3], [3, 2, 1, 0], [0, 3, 1, 2]])
    route(x)  # compile warm-up: not armed, counts nothing
    weights.arm(3)
    route(x)
    weights.disarm()
    assert counter.counts.tolist() == [1, 2, 1, 2]  # top-2 of each row: {3, 2}, {0, 1}, {1, 3}


def test_logical_window_marks_what_was_not_measured_as_absent(tmp_path):
    window = common.logical_window(runtime="vllm", model="m", ep_group="ep0", top_k=2, hidden_bytes=512,
                                   expert_tokens=np.array([[3, 1, 0, 2], [1, 1, 2, 2]]), steps=2,
                                   start_time=10.0, end_time=11.0, step_tokens=[2, 1])
    assert window.num_slots == 4 and window.physical_to_logical_map.tolist() == [[0, 1, 2, 3]] * 2
    for name in ("slot_tokens", "local_tokens", "sent_tokens", "received_tokens", "traffic",
                 "dispatch_seconds", "combine_seconds", "compute_seconds", "layer_seconds", "step_seconds"):
        assert getattr(window, name) is None, name
    sink = common.DirSink(tmp_path / "w")
    sink(window)
    sink(window)
    files = sorted((tmp_path / "w").iterdir())
    assert len(files) == 2 and all(f.suffix == ".json" for f in files)
    back = Window.from_json(files[0].read_text())
    np.testing.assert_array_equal(back.expert_tokens, window.expert_tokens)
    assert back.layer_seconds is None and back.runtime == "vllm"


def test_recorder_flushes_by_steps_and_at_close():
    settings = common.EngineSettings(window_steps=2)
    weights = common.PairWeights(4, 1, "cpu")
    seen = []
    rec = common.EngineRecorder(settings, runtime="vllm", model="m", top_k=1, hidden_bytes=4, num_experts=3,
                                weights=weights, sinks=[seen.append])
    counter = rec.counter(5)
    for tokens, ids in [(2, [0, 1]), (1, [2]), (2, [2, 2])]:
        rec.begin_step(tokens)
        counter.add(torch.tensor(ids)[:, None])
        rec.end_step()
    assert len(seen) == 1 and seen[0].expert_tokens.tolist() == [[1, 1, 1]]
    rec.close()
    assert len(seen) == 2 and seen[1].expert_tokens.tolist() == [[0, 0, 2]] and seen[1].steps == 1
    assert seen[1].extra["layer_ids"] == [5]
    rec.close()  # nothing pending: no empty window
    assert len(seen) == 2


def test_slot_counts_and_the_map_in_force_make_rank_load_real():
    # The GPU-only EPLB path: vLLM's mapping from logical ids to slots is wrapped, its output counted
    # per slot with the same weights. Here a stand-in mapping (the real one needs CUDA) sends expert
    # e to slot e, and expert 0's second replica, slot 4, takes every other pair of expert 0.
    from moewatch.runtime.engines import vllm_plugin

    class Router:
        def _apply_eplb_mapping(self, topk_ids):
            slots = topk_ids.clone()
            zero = (topk_ids == 0).reshape(-1).nonzero().reshape(-1)
            slots.view(-1)[zero[1::2]] = 4
            return slots

    pmap = np.array([[0, 1, 2, 3, 0, 1]])
    seen = []
    weights = common.PairWeights(8, 2, "cpu")
    rec = common.EngineRecorder(common.EngineSettings(window_steps=10), runtime="vllm", model="m", top_k=2,
                                hidden_bytes=4, num_experts=4, weights=weights, world_size=2, sinks=[seen.append])
    counter = rec.counter(0, num_slots=6)
    router = Router()
    vllm_plugin._count_slots(router, counter, rec)
    rec.slot_map = lambda: pmap
    rec.begin_step(3)
    ids = torch.tensor([[0, 1], [0, 2], [3, 0], [1, 1]])  # the last token is padding
    counter.add(ids)
    assert router._apply_eplb_mapping(ids).tolist() == [[0, 1], [4, 2], [3, 0], [1, 1]]
    rec.end_step()
    rec.close()
    (window,) = seen
    assert window.expert_tokens.tolist() == [[3, 1, 1, 1]]
    assert window.slot_tokens.tolist() == [[2, 1, 1, 1, 1, 0]]
    assert window.num_slots == 6 and window.world_size == 2
    assert "rank_load" not in window.missing_evidence and "cross_rank" in window.missing_evidence


def test_recorder_ends_a_window_after_its_seconds():
    seen = []
    rec = common.EngineRecorder(common.EngineSettings(window_steps=None, window_seconds=0.001), runtime="vllm",
                                model="m", top_k=1, hidden_bytes=4, num_experts=2,
                                weights=common.PairWeights(4, 1, "cpu"), sinks=[seen.append])
    counter = rec.counter(0)
    for _ in range(2):
        rec.begin_step(1)
        counter.add(torch.tensor([[1]]))
        time.sleep(0.01)  # past the window's 1 ms: the step that ends it closes the window
        rec.end_step()
    assert [w.steps for w in seen] == [1, 1] and [w.expert_tokens.tolist() for w in seen] == [[[0, 1]]] * 2


def test_windows_carry_what_an_adapter_has_pending_and_nothing_when_it_has_none():
    from moewatch.planner.rebalance import DecisionRecords

    records = DecisionRecords(limit=2)
    seen = []
    rec = common.EngineRecorder(common.EngineSettings(window_steps=1), runtime="vllm", model="m", top_k=1,
                                hidden_bytes=4, num_experts=2, weights=common.PairWeights(4, 1, "cpu"),
                                sinks=[seen.append])
    rec.extra_fields["engine_rebalance"] = records.take
    counter = rec.counter(0)
    for call in range(3):
        records.append({"layers_moved": call})
    for _ in range(2):
        rec.begin_step(1)
        counter.add(torch.tensor([[1]]))
        rec.end_step()
    assert len(seen) == 2
    # at most `limit` pending: the oldest was dropped and counted
    assert seen[0].extra["engine_rebalance"] == [{"layers_moved": 1}, {"layers_moved": 2}] and records.dropped == 1
    assert "engine_rebalance" not in seen[1].extra
    assert Window.from_json(seen[0].to_json()).extra["engine_rebalance"] == [{"layers_moved": 1}, {"layers_moved": 2}]


def test_ids_outside_the_experts_go_to_the_discard_bin_in_place_and_under_compile():
    """-1 (padding rows a router masks), ids >= E, columns a router appends after its top-k (fused
    shared experts) and, with the router's weights, pairs of weight 0 (a zero-expert router's) land in
    the discard bin: never an index out of range (an IndexError here, a device-side assert on CUDA).
    The ids the engine uses are left as they were; the bins and scratch keep their storage."""
    weights = common.PairWeights(max_tokens=8, top_k=2, device="cpu")
    counter = common.PairCounter(4, weights)
    weights.arm(3)
    ids = torch.tensor([[0, -1], [3, 7], [2, 2], [1, 1]], dtype=torch.int32)  # the last row: not armed
    kept = ids.clone()
    storage = (counter.counts.data_ptr(), weights.scratch.data_ptr())

    @torch.compile(backend="eager", fullgraph=True)
    def route(topk_ids):
        counter.add(topk_ids)

    route(ids)
    assert counter.counts.tolist() == [1, 0, 2, 1] and counter.discarded.tolist() == [2]
    counter.add(torch.tensor([[0, 1, 4], [3, 2, 4], [1, 1, 4]]))  # a fused shared expert appended: id E
    assert counter.counts.tolist() == [2, 3, 3, 2] and counter.discarded.tolist() == [5]
    counter.add(torch.tensor([[0, 1], [0, 2], [0, 0]]), torch.tensor([[0.5, 0.0], [0.0, 0.3], [0.2, 0.1]]))
    assert counter.counts.tolist() == [5, 3, 4, 2] and counter.discarded.tolist() == [7]
    assert torch.equal(ids, kept) and (counter.counts.data_ptr(), weights.scratch.data_ptr()) == storage
    assert counter.buffers()["discarded_pairs"] is counter.discarded


def test_expert_bytes_for_the_engines_own_rebalances_are_read_once_for_both_engines(caplog):
    from moewatch.runtime.engines.rebalance_hook import recorded_expert_bytes

    logger = logging.getLogger("test.expert_bytes")
    assert recorded_expert_bytes({}, "vLLM", logger) is None
    assert recorded_expert_bytes({"MOEWATCH_EPLB_EXPERT_BYTES": "1.5e8"}, "vLLM", logger) == 1.5e8
    with caplog.at_level(logging.WARNING, logger="test.expert_bytes"):
        assert recorded_expert_bytes({"MOEWATCH_EPLB_EXPERT_BYTES": "lots"}, "SGLang", logger) is None
    assert len(caplog.records) == 1
    assert "MOEWATCH_EPLB_EXPERT_BYTES" in caplog.text and "SGLang's rebalances are recorded without bytes" in caplog.text
