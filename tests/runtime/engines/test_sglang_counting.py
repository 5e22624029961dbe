"""The SGLang hook counts what SGLang 0.5.23 routed on the layouts operators run, driving SGLang's own
Python on CPU tensors (sglang_server.py publishes its configuration and builds its real recorder):

- CUDA graphs: SGLang's `capture_cuda_graphs` then `finalize_cuda_graph_capture` (compiled from the
  installed cuda_graph_setup.py: its import needs SGLang's server dependencies) register the --forward-hooks after the graphs
  are captured, so a replayed pass runs no hook; the counts come from SGLang's expert-distribution
  recorder (`_ExpertDistributionRecorderReal.with_forward_pass`, `with_current_layer`,
  `on_select_experts` through SGLang's `TopK` -> `select_experts`, its `_SelectExpertsSinglePassGatherer`
  and `_StatAccumulator.append`), whose gatherer runs inside the graph. A replay here is the pass's
  device ops traced before the hooks were registered (torch's make_fx), replayed on new inputs
  without Python: what a CUDA graph replay runs.
- Top-k formats without ids (FlashInfer TRT-LLM's BypassedTopKOutput from `TopK.forward_cuda`,
  the Triton-kernel format): refused with one warning naming SGLang's version.
- DP attention with DeepEP (`is_moe_input_scattered_across_dp_ranks`): every rank a shard of one
  window; without an all-to-all backend, TP rank 0 alone, unsharded.
- Two-batch overlap: top-k runs once per micro-batch inside one recorder pass: one step.
"""

from __future__ import annotations

import logging
import types
import warnings

import numpy as np
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import sglang_server
from moewatch.runtime.engines import sglang_hooks

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from sglang.srt.eplb.expert_distribution import get_global_expert_distribution_recorder
    from sglang.srt.layers.moe.topk import BypassedTopKOutput, TopK, TopKOutputFormat
    from sglang.srt.layers.moe.utils import MoeRunnerBackend

GRAPH_SETUP = sglang_server.cuda_graph_setup_functions("finalize_cuda_graph_capture", "capture_cuda_graphs")
finalize_cuda_graph_capture = GRAPH_SETUP["finalize_cuda_graph_capture"]

L, E, P, K, W, N = 3, 4, 6, 2, 2, 5
PMAP = torch.arange(P).remainder(E).repeat(L, 1)  # slot s holds expert s % E
SPY_CALLS = sglang_server.SPY_CALLS


def hook_specs(**config):
    return [{"name": "moewatch", "target_modules": ["layers.*.mlp.topk"],
             "hook_factory": "moewatch.runtime.engines.sglang_hooks:topk_counter",
             "config": {"num_layers": L, "num_experts": E, "num_slots": P, "ep_size": W, "top_k": K,
                        "model": "tiny", "window_seconds": 3600, **config}},
            {"name": "spy", "target_modules": ["layers.*.mlp.topk"], "hook_factory": "sglang_server:spy_hooks"}]


class Layer(torch.nn.Module):
    """A decoder layer's MoE routing as SGLang's models run it: the router logits into SGLang's TopK
    inside the recorder's layer scope."""

    def __init__(self, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.mlp = torch.nn.Module()
        self.mlp.topk = TopK(K, layer_id=layer_id, renormalize=True, output_format=TopKOutputFormat.STANDARD)
        self.mlp.topk._forward_method = self.mlp.topk.forward_native  # the CPU torch's router

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        with get_global_expert_distribution_recorder().with_current_layer(self.layer_id):
            out = self.mlp.topk(torch.zeros(logits.shape[0], 8), logits)
        return out.topk_ids


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer(i) for i in range(L))

    def forward(self, logits: torch.Tensor) -> torch.Tensor:  # logits [L, N, E]
        return torch.stack([layer(logits[i]) for i, layer in enumerate(self.layers)])


def routed(seed: int) -> tuple[torch.Tensor, np.ndarray]:
    """Router logits [L, N, E] whose top-k picks known distinct experts, and those ids [L, N, K]."""
    rng = np.random.default_rng(seed)
    ids = np.stack([[rng.choice(E, size=K, replace=False) for _ in range(N)] for _ in range(L)])
    logits = torch.full((L, N, E), -10.0)
    for rank in range(K):
        logits.scatter_(2, torch.as_tensor(ids[:, :, rank:rank + 1]), float(5 - rank))
    return logits, ids


def recount(all_ids: list[np.ndarray]) -> np.ndarray:
    slots = np.zeros((L, P), dtype=np.int64)
    for ids in all_ids:
        for layer in range(L):
            np.add.at(slots[layer], ids[layer].reshape(-1), 1)
    return slots


@pytest.fixture
def made(monkeypatch, tmp_path):
    """The counters SGLang's hook manager builds through the factory, closed after the test."""
    monkeypatch.setenv("MOEWATCH_WINDOW_DIR", str(tmp_path))
    monkeypatch.delenv("MOEWATCH_SOCKET", raising=False)
    out: list = []
    real = sglang_hooks.topk_counter
    monkeypatch.setattr(sglang_hooks, "topk_counter", lambda cfg: out.append(real(cfg)) or out[-1])
    SPY_CALLS.clear()
    yield out
    for counter in out:
        if counter is not None:
            counter.close()


SERVER = dict(tp_size=W, ep_size=W, expert_distribution_recorder_mode="stat", expert_distribution_recorder_buffer_size=16)


def test_sglang_registers_forward_hooks_only_after_capturing_its_graphs():
    capture = GRAPH_SETUP["__source__"]["capture_cuda_graphs"]
    assert capture.index("capture_decode_graph(") < capture.index("finalize_cuda_graph_capture(model_runner)")
    assert "register_forward_hooks(" in GRAPH_SETUP["__source__"]["finalize_cuda_graph_capture"]


def test_decode_replayed_from_cuda_graphs_is_counted_through_sglangs_recorder(monkeypatch, made):
    with sglang_server.server(monkeypatch, ranks={"tp_rank": 0, "moe_ep_rank": 0}, recorder_pmap=PMAP,
                              recording=True, forward_hooks=hook_specs(), **SERVER) as recorder:
        model = Model()
        static = torch.zeros(L, N, E)
        graph = make_fx(model)(static)  # capture: before SGLang registers any hook
        assert all(not layer.mlp.topk._forward_hooks for layer in model.layers)
        finalize_cuda_graph_capture(types.SimpleNamespace(model=model, is_draft_worker=False, device="cpu",
                                                          forward_stream=None, canary_manager=None))
        assert all(len(layer.mlp.topk._forward_hooks) == 2 for layer in model.layers)
        counter = made[0]
        assert counter is not None and counter.recorder is recorder
        seen, pass_id = [], 0
        prefill, ids = routed(0)
        with recorder.with_forward_pass(pass_id, types.SimpleNamespace()):  # eager: model_runner.forward
            model(prefill)
        seen.append(ids)
        for step in range(1, 5):  # decode: the captured graph replays on the static buffer
            logits, ids = routed(step)
            with recorder.with_forward_pass(step, types.SimpleNamespace()):
                static.copy_(logits)
                graph(static)
            seen.append(ids)
        window = counter.flush()
        recorder._accumulator._first_dump = False  # its first dump frees the CUDA cache, absent here
        sglangs_own = recorder.dump_record(output_mode="object")["logical_count"].sum(dim=0)
    assert SPY_CALLS == list(range(L)), "a replay ran a forward hook"  # the eager pass only
    slots = recount(seen)
    assert np.array_equal(window.slot_tokens, slots) and window.steps == 5
    assert np.array_equal(window.expert_tokens, sglangs_own.numpy())
    assert window.extra["source"] == {"kind": "sglang-expert-distribution-recorder", "counts": "routed"}
    assert "shard" not in window.extra and window.world_size == W


def test_without_the_recorder_cuda_graphs_are_refused_with_one_warning(monkeypatch, made, caplog):
    caplog.set_level(logging.WARNING, "moewatch.runtime.engines.sglang")
    with sglang_server.server(monkeypatch, ranks={"tp_rank": 0, "moe_ep_rank": 0}, tp_size=W, ep_size=W):
        assert sglang_hooks.topk_counter(hook_specs()[0]["config"]) is None
    refusals = [r.getMessage() for r in caplog.records if "observation off" in r.getMessage()]
    assert len(refusals) == 1 and "SGLang 0.5.23" in refusals[0] and "CUDA graph" in refusals[0], refusals


def test_the_recorder_is_started_when_off_and_its_buffer_is_bounded(monkeypatch, made):
    with sglang_server.server(monkeypatch, ranks={"tp_rank": 0, "moe_ep_rank": 0}, recorder_pmap=PMAP,
                              **SERVER) as recorder:
        assert not recorder.recording
        counter = sglang_hooks.topk_counter(hook_specs()[0]["config"])
        made.append(counter)
        assert recorder.recording and counter.recorder is recorder


@pytest.mark.parametrize("backend, named", [("flashinfer_trtllm", "TRT-LLM"), ("triton_kernel", "Triton-kernel")])
def test_top_k_formats_without_ids_are_refused_with_one_warning(monkeypatch, made, caplog, backend, named):
    caplog.set_level(logging.WARNING, "moewatch.runtime.engines.sglang")
    with sglang_server.server(monkeypatch, ranks={"tp_rank": 0, "moe_ep_rank": 0}, recorder_pmap=PMAP,
                              recording=True, moe_runner_backend=backend, **SERVER) as recorder:
        if backend == "flashinfer_trtllm":
            # What deepseek_v2 runs: TopK bound to the TRT-LLM runner, forward_cuda called directly.
            from sglang.srt.layers.moe.topk import RoutingMethodType

            topk = TopK(K, layer_id=0, renormalize=True)
            topk.bind_runner_backend(MoeRunnerBackend.FLASHINFER_TRTLLM,
                                     routing_method_type=RoutingMethodType.Renormalize)
            with recorder.with_forward_pass(0, types.SimpleNamespace()):
                out = topk.forward_cuda(torch.zeros(N, 8), routed(0)[0][0])
            assert isinstance(out, BypassedTopKOutput) and not hasattr(out, "topk_ids")
            recorder._accumulator._first_dump = False
            assert int(recorder.dump_record(output_mode="object")["logical_count"].sum()) == 0  # nor the recorder
        assert sglang_hooks.topk_counter(hook_specs()[0]["config"]) is None
    refusals = [r.getMessage() for r in caplog.records if "observation off" in r.getMessage()]
    assert len(refusals) == 1 and "SGLang 0.5.23" in refusals[0] and named in refusals[0], refusals


DEEPEP_DP = dict(tp_size=4, attn_dp_size=4, ep_size=4, moe_a2a_backend="deepep", deepep_mode="normal",
                 expert_distribution_recorder_mode="stat", expert_distribution_recorder_buffer_size=16)


def test_dp_attention_with_deepep_every_rank_sends_its_shard_of_one_window(monkeypatch, made):
    pmap = torch.arange(8).remainder(E).repeat(L, 1)
    windows = []
    for rank in range(4):
        ranks = {"tp_rank": rank, "attn_dp_rank": rank, "moe_ep_rank": rank}
        with sglang_server.server(monkeypatch, ranks=ranks, recorder_pmap=pmap, recording=True,
                                  disable_cuda_graph=True, **DEEPEP_DP) as recorder:
            counter = sglang_hooks.topk_counter({**hook_specs()[0]["config"], "num_slots": 8, "ep_size": 4})
            made.append(counter)
            assert counter is not None, f"rank {rank} does not report its tokens"
            with recorder.with_forward_pass(0, types.SimpleNamespace()):
                with recorder.with_current_layer(1):
                    recorder.on_select_experts(torch.full((rank + 1, K), rank))  # this DP rank's own tokens
            windows.append(counter.flush(sequence=41))
            hello = counter.hello()
            assert (hello.shard_index, hello.shard_count, hello.ep_group) == (rank, 4, "ep0")
            # A shard whose previous window had passes is sent even when empty (the agent need not
            # wait for it at the deadline); after an idle window, nothing.
            empty = counter.flush(sequence=42)
            assert empty.steps == 0 and not empty.slot_tokens.any() and empty.extra["shard"]["sequence"] == 42
            assert counter.flush(sequence=43) is None
            counter.close()
    shards = [w.extra["shard"] for w in windows]
    assert shards == [{"index": r, "count": 4, "rank": r, "sequence": 41} for r in range(4)]
    assert all(w.ep_group == "ep0" and w.world_size == 4 for w in windows)  # the group's, not a rank's
    assert [int(w.slot_tokens[1, r]) for r, w in enumerate(windows)] == [K * (r + 1) for r in range(4)]
    # As the agent merges them (moewatch.shards.merge_sequence): one window of the group's pairs,
    # each rank's pairs in its own row of the traffic (rank r's tokens to slot r, on rank r // 2).
    from moewatch.shards import merge_sequence

    merged, refused = merge_sequence(windows)
    assert not refused and merged.extra["shards"]["missing"] == []
    assert merged.slot_tokens[1, :4].tolist() == [K * (r + 1) for r in range(4)] and merged.steps == 1
    assert [merged.traffic[1, r].tolist() for r in range(4)] == [
        [K * (r + 1) if dest == r // 2 else 0 for dest in range(4)] for r in range(4)]


def test_dp_attention_without_an_all_to_all_backend_reports_once_for_the_group(monkeypatch, made):
    # SGLang gathers every DP rank's tokens before the MoE: every rank routes the whole batch.
    reporting = []
    for rank in range(4):
        ranks = {"tp_rank": rank, "attn_dp_rank": rank, "moe_ep_rank": rank}
        with sglang_server.server(monkeypatch, ranks=ranks, recorder_pmap=torch.arange(8).remainder(E).repeat(L, 1),
                                  **{**DEEPEP_DP, "moe_a2a_backend": "none"}):
            counter = sglang_hooks.topk_counter({**hook_specs()[0]["config"], "num_slots": 8, "ep_size": 4})
            made.append(counter)
            reporting.append(counter is not None and counter.shard is None)
            if counter is not None:  # SGLang pads each DP rank's rows to the longest and masks none
                assert counter.counts_padding and counter._source(counter._last)["padded_rows"] == "counted"
            if counter is not None:
                counter.close()
    assert reporting == [True, False, False, False]


def test_two_batch_overlap_counts_one_step_per_step(monkeypatch, made):
    with sglang_server.server(monkeypatch, ranks={"tp_rank": 0, "moe_ep_rank": 0}, recorder_pmap=PMAP,
                              recording=True, enable_two_batch_overlap=True, forward_hooks=hook_specs(),
                              **SERVER) as recorder:
        model = Model()
        finalize_cuda_graph_capture(types.SimpleNamespace(model=model, is_draft_worker=False, device="cpu",
                                                          forward_stream=None, canary_manager=None))
        counter = made[0]
        seen = []
        for step in range(3):
            logits, ids = routed(step)
            with recorder.with_forward_pass(step, types.SimpleNamespace()):
                model(logits[:, :2])  # the two micro-batches of one step, each through top-k
                model(logits[:, 2:])
            seen.append(ids)
        window = counter.flush()
    assert window.steps == 3
    assert np.array_equal(window.slot_tokens, recount(seen))


def layout(**changes):
    from moewatch.runtime.engines.sglang_layout import SGLangLayout

    base = dict(version="0.5.23", recorder_mode="stat", recording=True, accumulator="_StatAccumulator",
                gatherer="_SelectExpertsSinglePassGatherer", bounded_buffer=True, routed_counts=False, cuda_graphs=True,
                two_batch_overlap=False, runner_backend="deep_gemm", moe_input_scattered=True, tp_rank=3, tp_size=8,
                pp_size=1, nnodes=2, attn_dp_rank=3, attn_dp_size=8, attn_tp_size=1, moe_ep_rank=3, moe_ep_size=8)
    return SGLangLayout(**{**base, **changes})


@pytest.mark.parametrize("changes, reason", [
    ({"attn_tp_size": 2, "attn_dp_size": 4}, "attention TP 2"),
    ({"pp_size": 2}, "pipeline parallelism"),
    ({"moe_ep_size": 4}, "config.ep_size 8"),
    ({"recording": False, "bounded_buffer": False}, "buffer-size"),
    ({"recording": False, "accumulator": "_DetailAccumulator"}, "not recording"),
    ({"recorder_mode": None}, "CUDA graph replay"),
    ({"recorder_mode": None, "cuda_graphs": False, "two_batch_overlap": True}, "two-batch overlap"),
    ({"runner_backend": "flashinfer_mxfp4"}, "MXFP4"),
])
def test_layouts_the_hook_cannot_count_right_are_refused_naming_why(changes, reason):
    from moewatch.runtime.engines.sglang_layout import decide

    decision = decide(layout(**changes), num_layers=L, num_slots=8, ep_size=8, recorder_layers=L, recorder_slots=8)
    assert decision.refusal is not None and reason in decision.refusal and not decision.reports


def test_deepep_dispatch_counts_are_marked_received_and_ranks_per_node_comes_from_the_nodes():
    from moewatch.runtime.engines.sglang_layout import decide

    decision = decide(layout(gatherer="_DeepepLowLatencySinglePassGatherer"), num_layers=L, num_slots=8, ep_size=8,
                      recorder_layers=L, recorder_slots=8)
    assert decision.refusal is None and decision.counts_received and decision.ranks_per_node == 4
    assert decision.shard == {"index": 3, "count": 8, "rank": 3}


def test_a_speculative_drafters_passes_are_not_steps_of_the_model(monkeypatch, made):
    """SGLang's SpecInput draft / verify inputs (speculative/spec_info.py) and ForwardMode on the
    forward batches the drafter's and the target's model runners hand the shared recorder."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.spec_info import SpecInput, SpecInputType

    verify = types.SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, spec_info=SpecInput(SpecInputType.EAGLE_VERIFY))
    drafts = [types.SimpleNamespace(forward_mode=ForwardMode.DECODE, spec_info=SpecInput(SpecInputType.EAGLE_DRAFT)),
              types.SimpleNamespace(forward_mode=ForwardMode.DRAFT_EXTEND_V2,
                                    spec_info=SpecInput(SpecInputType.EAGLE_DRAFT_EXTEND))]
    with sglang_server.server(monkeypatch, ranks={"tp_rank": 0, "moe_ep_rank": 0}, recorder_pmap=PMAP,
                              recording=True, forward_hooks=hook_specs(), **SERVER) as recorder:
        model = Model()
        finalize_cuda_graph_capture(types.SimpleNamespace(model=model, is_draft_worker=False, device="cpu",
                                                          forward_stream=None, canary_manager=None))
        seen = []
        for step in range(2):
            logits, ids = routed(step)
            with recorder.with_forward_pass(3 * step, verify):
                model(logits)
            seen.append(ids)
            for offset, draft in enumerate(drafts, 1):  # the drafter's MTP layers record nothing
                with recorder.with_forward_pass(3 * step + offset, draft):
                    pass
        window = made[0].flush()
    assert window.steps == 2 and np.array_equal(window.slot_tokens, recount(seen))


@pytest.fixture
def routed_counts_plugin():
    """sglang_routed's hooks registered and applied by SGLang's HookRegistry, as its plugin loader does;
    SGLang's gatherer classes restored after."""
    from sglang.srt.eplb import expert_distribution as ed
    from sglang.srt.plugins.hook_registry import HookRegistry

    from moewatch.runtime.engines import sglang_routed

    saved = {name: dict(vars(getattr(ed, name))) for name in sglang_routed.GATHERERS}
    hooks_before = {k: list(v) for k, v in HookRegistry._hooks.items()}
    patched_before = set(HookRegistry._patched)
    assert sglang_routed.register({"MOEWATCH_WINDOW_DIR": "/nonexistent"}) is True
    HookRegistry.apply_hooks()
    yield
    for name, attrs in saved.items():
        cls = getattr(ed, name)
        for attr in ("__init__", "on_select_experts", "reset", "collect"):
            if attr in attrs:
                setattr(cls, attr, attrs[attr])
            elif attr in vars(cls):
                delattr(cls, attr)
    HookRegistry._hooks.clear()
    HookRegistry._hooks.update(hooks_before)
    HookRegistry._patched.clear()
    HookRegistry._patched.update(patched_before)


DEEPEP_LL = {**DEEPEP_DP, "deepep_mode": "low_latency"}


@pytest.mark.parametrize("plugin", [True, False])
def test_under_deepep_low_latency_a_shard_counts_what_its_rank_routed(monkeypatch, made, request, plugin):
    """SGLang's _DeepepLowLatencySinglePassGatherer counts what this rank's slots received
    (`on_deepep_dispatch_low_latency`, as DeepEP's dispatch reports it); with moewatch's SGLang plugin
    its `on_select_experts` (called by select_experts with this rank's ids) also counts what this
    rank's tokens routed, which the shard carries. Without the plugin the shard says it carries
    received counts."""
    if plugin:
        request.getfixturevalue("routed_counts_plugin")
    pmap = torch.arange(8).remainder(E).repeat(L, 1)
    ranks = {"tp_rank": 2, "attn_dp_rank": 2, "moe_ep_rank": 2}
    with sglang_server.server(monkeypatch, ranks=ranks, recorder_pmap=pmap, recording=True,
                              disable_cuda_graph=True, **DEEPEP_LL) as recorder:
        assert type(recorder._single_pass_gatherers["primary"]).__name__ == "_DeepepLowLatencySinglePassGatherer"
        counter = sglang_hooks.topk_counter({**hook_specs()[0]["config"], "num_slots": 8, "ep_size": 4})
        made.append(counter)
        routed_ids = torch.tensor([[0, 7], [7, 3], [-1, -1]])  # this rank's tokens (a padded row)
        received = torch.tensor([5, 1])  # pairs rank 2's two slots (4, 5) got from every rank
        for _ in range(2):
            with recorder.with_forward_pass(0, types.SimpleNamespace()):
                with recorder.with_current_layer(1):
                    recorder.on_select_experts(routed_ids)
                    recorder.on_deepep_dispatch_low_latency(received)
        window = counter.flush(sequence=7)
        recorder._accumulator._first_dump = False
        sglangs_own = recorder.dump_record(output_mode="object")["logical_count"].sum(dim=0)
    if plugin:
        assert window.slot_tokens[1].tolist() == [2, 0, 0, 2, 0, 0, 0, 4]
        assert window.extra["source"]["counts"] == "routed"
    else:
        assert window.slot_tokens[1].tolist() == [0, 0, 0, 0, 10, 2, 0, 0]
        assert window.extra["source"]["counts"] == "received"
    assert sglangs_own[1].tolist() == [10, 2, 0, 0]  # SGLang's own counts stay what it received
    assert window.extra["shard"] == {"index": 2, "count": 4, "rank": 2, "sequence": 7}
