"""The --forward-hooks factory on a module returning SGLang's own top-k output type, registered by
SGLang's own hook manager (python/sglang/srt/model_executor/hook_manager.py), counted against an
independent recount of the ids. The forward-hook path: SGLang's configuration is published with CUDA
graphs off (with them, or two-batch overlap, the hook counts through SGLang's recorder instead:
tests/runtime/engines/test_sglang_counting.py)."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch

from moewatch.runtime.engines import sglang_hooks
from moewatch.runtime.engines.sglang_hooks import HookConfigError, topk_counter
from moewatch.telemetry import Window, rank_load

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from sglang.srt import runtime_context
    from sglang.srt.layers.moe.topk import BypassedTopKOutput, StandardTopKOutput
    from sglang.srt.model_executor.hook_manager import register_forward_hooks

L, E, P, K, W = 3, 8, 10, 2, 2
PMAP = [[e % E for e in range(P)], [e % E for e in range(P)], [(e + 3) % E for e in range(P)]]


@pytest.fixture(autouse=True)
def eager_sglang():
    """SGLang's published configuration of an eager server (no CUDA graphs, no recorder), TP rank 0."""
    with runtime_context._CONTEXT.override_server_args(disable_cuda_graph=True, tp_size=W, ep_size=W):
        with runtime_context.get_parallel().override(tp_rank=0, moe_ep_rank=0):
            yield


class Gate(torch.nn.Module):
    """Stands in for SGLang's TopK module: a layer_id and a StandardTopKOutput of physical ids."""

    def __init__(self, layer_id: int, ids: list[torch.Tensor]):
        super().__init__()
        self.layer_id = layer_id
        self.ids = ids

    def forward(self, hidden: torch.Tensor) -> StandardTopKOutput:
        ids = self.ids.pop(0)
        return StandardTopKOutput(torch.ones(ids.shape), ids, hidden)


class Block(torch.nn.Module):
    def __init__(self, layer_id: int, ids):
        super().__init__()
        self.mlp = torch.nn.Module()
        self.mlp.topk = Gate(layer_id, ids)

    def forward(self, hidden):
        self.mlp.topk(hidden)
        return hidden


class Model(torch.nn.Module):
    def __init__(self, ids_per_layer):
        super().__init__()
        self.layers = torch.nn.ModuleList(Block(i, ids) for i, ids in enumerate(ids_per_layer))

    def forward(self, hidden):
        for block in self.layers:
            hidden = block(hidden)
        return hidden


def spec(**config):
    return [{"name": "moewatch", "target_modules": ["layers.*.mlp.topk"],
             "hook_factory": "moewatch.runtime.engines.sglang_hooks:topk_counter",
             "config": {"num_layers": L, "num_experts": E, "num_slots": P, "ep_size": W, "top_k": K,
                        "model": "tiny", "window_seconds": 3600, "physical_to_logical_map": PMAP, **config}}]


def test_hook_counts_pairs_per_slot_and_expert_like_a_recount(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEWATCH_WINDOW_DIR", str(tmp_path))
    monkeypatch.delenv("MOEWATCH_SOCKET", raising=False)
    rng = np.random.default_rng(0)
    steps = [[rng.integers(0, P, size=(n, K)) for _ in range(L)] for n in (5, 9, 4)]
    steps[1][2][-2:] = -1  # padded tokens of a graph batch
    steps[2][0][0, 1] = P  # a fused shared-expert column beyond the routed slots
    ids_per_layer = [[torch.as_tensor(steps[s][layer], dtype=torch.int32) for s in range(len(steps))]
                     for layer in range(L)]
    model = Model(ids_per_layer)
    made = []
    real_factory = sglang_hooks.topk_counter
    monkeypatch.setattr(sglang_hooks, "topk_counter", lambda cfg: made.append(real_factory(cfg)) or made[-1])
    register_forward_hooks(model, spec())
    assert len(made) == 1 and all(len(b.mlp.topk._forward_hooks) == 1 for b in model.layers)
    counter = made[0]
    for _ in steps:
        model(torch.zeros(1, 4))
    window = counter.flush()
    counter.close()
    # Independent recount from the ids themselves.
    slots = np.zeros((L, P), dtype=np.int64)
    for step in steps:
        for layer, ids in enumerate(step):
            valid = ids[(ids >= 0) & (ids < P)]
            np.add.at(slots[layer], valid, 1)
    expert = np.zeros((L, E), dtype=np.int64)
    for layer in range(L):
        for slot in range(P):
            expert[layer, PMAP[layer][slot]] += slots[layer, slot]
    assert np.array_equal(window.slot_tokens, slots)
    assert np.array_equal(window.expert_tokens, expert)
    assert window.steps == 3 and window.runtime == "sglang" and window.world_size == W
    outside = sum(int(((ids < 0) | (ids >= P)).sum()) for step in steps for ids in step)
    assert outside == 2 * K + 1 and window.extra["source"]["ids_outside_slots"] == outside
    assert np.array_equal(rank_load(window), slots.reshape(L, W, P // W).sum(axis=2))
    assert window.layer_seconds is None and window.step_tokens is None
    # What the shared window builder states for a dropless engine without a capacity factor.
    assert not window.dropped_tokens.any() and not window.rerouted_tokens.any()
    assert window.capacity_factor.tolist() == [0.0] * L and window.ranks_per_node == W and window.top_k == K
    assert window.epoch == 0 and np.array_equal(window.physical_to_logical_map, PMAP)
    files = sorted(tmp_path.glob("window-*.json"))
    assert len(files) == 1
    assert np.array_equal(Window.from_json(files[0].read_text()).slot_tokens, slots)
    assert counter.flush() is None  # nothing since: no empty window


def test_hook_adds_only_into_its_preallocated_counters():
    cfg = sglang_hooks.HookConfig.from_mapping({"num_layers": 1, "num_experts": 4})
    counter = sglang_hooks.TopKCounter(cfg, [], start_thread=False)
    before = counter.counts.data_ptr()
    gate = Gate(0, [torch.tensor([[0, 1], [1, 3]])])
    gate.register_forward_hook(counter)
    gate(torch.zeros(2, 4))
    assert counter.counts.data_ptr() == before
    assert counter.counts[0].tolist() == [1, 2, 0, 1, 0, 1]


def test_factory_stays_out_of_the_way_without_a_sink(monkeypatch):
    monkeypatch.delenv("MOEWATCH_WINDOW_DIR", raising=False)
    monkeypatch.delenv("MOEWATCH_SOCKET", raising=False)
    assert topk_counter(spec()[0]["config"]) is None


@pytest.mark.parametrize("config, key", [({"num_experts": 8}, "num_layers"), ({"num_layers": 2, "num_experts": 8,
                                         "ep_size": 3}, "num_slots"), ({"num_layers": 2, "num_experts": 8, "colour": 1},
                                         "colour")])
def test_bad_config_names_the_key(config, key):
    with pytest.raises(HookConfigError, match=rf"^config\.{key}: "):
        topk_counter(config)


def test_documented_snippet_is_valid_json():
    doc = sglang_hooks.__doc__
    start = doc.index("--forward-hooks '") + len("--forward-hooks '")
    snippet = doc[start:doc.index("'", start)]
    parsed = json.loads(snippet)
    assert parsed[0]["hook_factory"] == "moewatch.runtime.engines.sglang_hooks:topk_counter"
    sglang_hooks.HookConfig.from_mapping(parsed[0]["config"])


def test_windows_carry_the_eplb_hooks_decisions_since_the_last_window(tmp_path, monkeypatch):
    from moewatch.runtime.engines import sglang_eplb

    monkeypatch.setenv("MOEWATCH_WINDOW_DIR", str(tmp_path))
    monkeypatch.delenv("MOEWATCH_SOCKET", raising=False)
    ids = [[torch.zeros((2, K), dtype=torch.int32)] * 2 for _ in range(L)]
    made = []
    real_factory = sglang_hooks.topk_counter
    monkeypatch.setattr(sglang_hooks, "topk_counter", lambda cfg: made.append(real_factory(cfg)) or made[-1])
    model = Model(ids)
    register_forward_hooks(model, spec())
    sglang_eplb.take_records()  # nothing left from another test
    sglang_eplb._hook.records.append({"engine": "sglang", "layers_moved": 3})
    model(torch.zeros(1, 4))
    first = made[0].flush()
    model(torch.zeros(1, 4))
    second = made[0].flush()
    made[0].close()
    assert first.extra["engine_rebalance"] == [{"engine": "sglang", "layers_moved": 3}]
    assert "engine_rebalance" not in second.extra


def test_a_top_k_output_without_ids_is_warned_once_and_its_layers_named_in_the_window(tmp_path, monkeypatch, caplog):
    """SGLang's BypassedTopKOutput (FlashInfer's in-kernel routing) met through a module call."""
    caplog.set_level("WARNING", "moewatch.runtime.engines.sglang")
    cfg = sglang_hooks.HookConfig.from_mapping({"num_layers": 2, "num_experts": 4, "window_seconds": 3600})
    counter = sglang_hooks.TopKCounter(cfg, [], start_thread=False)
    counted, bypassed = Gate(0, [torch.tensor([[0, 1]])] * 3), torch.nn.Module()
    bypassed.layer_id = 1
    counted.register_forward_hook(counter)
    for _ in range(3):
        counted(torch.zeros(1, 4))
        counter(bypassed, (), BypassedTopKOutput(torch.zeros(1, 4), torch.zeros(1, 4), None))
    window = counter.flush()
    warned = [r.getMessage() for r in caplog.records if "carries no expert ids" in r.getMessage()]
    assert len(warned) == 1 and "BypassedTopKOutput" in warned[0], warned
    assert window.extra["source"]["layers_without_ids"] == [1] and window.slot_tokens[0].tolist() == [3, 3, 0, 0]


def test_a_window_that_cannot_be_built_or_sent_is_counted_by_reason_and_logged_once(caplog):
    caplog.set_level("WARNING", "moewatch.runtime.engines.sglang")

    def full_disk(window):
        raise OSError("No space left on device")

    cfg = sglang_hooks.HookConfig.from_mapping({"num_layers": 1, "num_experts": 4, "window_seconds": 3600})
    counter = sglang_hooks.TopKCounter(cfg, [full_disk], start_thread=False)
    gate = Gate(0, [torch.tensor([[0, 1]])] * 4)
    gate.register_forward_hook(counter)
    for _ in range(2):
        gate(torch.zeros(1, 4))
        assert counter.flush() is not None
    counter.current_map = lambda: np.full((1, 4), 7)  # a map in force naming no expert of the model
    for _ in range(2):
        gate(torch.zeros(1, 4))
        assert counter.flush() is None
    assert counter.windows_lost() == {"sink_error": 2, "invalid": 2}
    assert counter.heartbeat().extra["windows_lost"] == {"sink_error": 2, "invalid": 2}
    lost = [r.getMessage() for r in caplog.records if "a window was lost" in r.getMessage()]
    assert len(lost) == 2 and "sink_error" in lost[0] and "invalid" in lost[1], lost
