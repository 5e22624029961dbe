"""Runs inside .venv-vllm (the tests start it there): builds real vLLM MoE layers on the CPU with
moewatch's plugin loaded the way vLLM loads it (load_general_plugins, MOEWATCH_WINDOW_DIR set by the
caller), drives one of vLLM's GPU-side paths through vLLM's own code, and prints one JSON line of
what vLLM decided (the reference); the windows the plugin wrote are in the caller's folder.

Set up: a one-process gloo group (vLLM's init_distributed_environment, initialize_model_parallel),
a VllmConfig with a ModelConfig read from a tiny Qwen3-MoE config.json, MoE layers built by vLLM's
FusedMoEFactory (MoERunner, RoutedExperts, UnquantizedFusedMoEMethod, the router vLLM chooses or
the one given), forwards under vLLM's set_forward_context.

usage: vllm_paths_driver.py CASE FOLDER     (CASE: monolithic, routers, drafter, placement)
"""

from __future__ import annotations

import json
import os
import socket
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

E, K, HIDDEN, N = 8, 2, 128, 6


@contextmanager
def vllm_context(folder: Path, *, eplb: bool = False):
    """vLLM's config in scope, its process groups set up, the plugins loaded; yields the config."""
    import transformers
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.config.parallel import EPLBConfig
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from vllm.plugins import load_general_plugins

    model_dir = folder / "model"
    transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=HIDDEN, intermediate_size=256, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=64,
        decoder_sparse_step=1, mlp_only_layers=[]).save_pretrained(model_dir)
    model_config = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                               max_model_len=256)
    config = VllmConfig(model_config=model_config)
    if eplb:  # vLLM's config check allows EPLB on GPUs only; its state itself runs on the CPU
        config.parallel_config.enable_eplb = True
        config.parallel_config.eplb_config = EPLBConfig(num_redundant_experts=2, communicator="torch_gloo")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(config):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
        initialize_model_parallel(1, 1)
        load_general_plugins()
        yield config


def moe_layer(layer: int, model: str = "model", **options):
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

    return FusedMoEFactory(num_experts=E, top_k=K, hidden_size=HIDDEN, intermediate_size=64,
                           params_dtype=torch.float32, prefix=f"{model}.layers.{layer}.mlp.experts", **options)


def step(config, tokens: int, forwards) -> None:
    """One engine step as the plugin sees it: the recorder's step around the forwards."""
    from moewatch.runtime.engines import vllm_plugin

    rec = vllm_plugin.recorder()
    rec.begin_step(tokens)
    try:
        forwards()
    finally:
        rec.end_step()


def histogram(ids: torch.Tensor, weights: torch.Tensor | None = None) -> list[int]:
    ids = ids.reshape(-1).long()
    keep = (ids >= 0) & (ids < E)
    if weights is not None:
        keep &= weights.reshape(-1) != 0
    return np.bincount(ids[keep].numpy(), minlength=E).tolist()


# --- monolithic kernels ------------------------------------------------------------------------------

def stand_in_kernels():
    """Two CPU stand-ins for a monolithic kernel (one that routes inside itself from the router
    logits), subclasses of vLLM's own CPU monolithic kernel class: softmax top-k of the logits, the
    ids written into routing_replay_out as the TRT-LLM kernels do. One reports its ids
    (supports_routing_replay_capture, like TRT-LLM's), one does not (like AITER's or CPU int4's)."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_int4_moe import CPUExpertsInt4

    chosen: list[torch.Tensor] = []

    class Reporting(CPUExpertsInt4):
        def supports_routing_replay_capture(self) -> bool:
            return True

        def apply(self, hidden_states, w1, w2, router_logits, activation, global_num_experts, expert_map,
                  a1q_scale, apply_router_weight_on_input, num_expert_group=None, e_score_correction_bias=None,
                  routed_scaling_factor=None, topk_group=None, routing_replay_out=None):
            ids = torch.topk(router_logits.float().softmax(-1), K, dim=-1).indices
            chosen.append(ids)
            if routing_replay_out is not None:
                routing_replay_out[: ids.shape[0]] = ids
            return torch.zeros_like(hidden_states)

    class Silent(Reporting):
        def supports_routing_replay_capture(self) -> bool:
            return False

    return Reporting, Silent, chosen


def monolithic(folder: Path) -> dict:
    """Layer 0 gets a kernel that reports its ids, layer 1 one that does not; vLLM's own routed-experts
    capture is bound to layer 0 as well (bind_routed_experts_capturer), after moewatch's first forward
    bound its sink, and both keep capturing. Then two steps."""
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.fused_moe import modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
    from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import MoEPrepareAndFinalizeNoDPEPMonolithic
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer

    Reporting, Silent, chosen = stand_in_kernels()
    out: dict = {"expected": [], "vllm_captured": []}
    with vllm_context(folder) as config:
        layers = torch.nn.ModuleList([moe_layer(0), moe_layer(1)])
        for layer, kernel in zip(layers, (Reporting, Silent)):
            layer._quant_method.moe_kernel = mk.FusedMoEKernel(
                MoEPrepareAndFinalizeNoDPEPMonolithic(), kernel(layer.moe_config, FUSED_MOE_UNQUANTIZED_CONFIG))
        out["is_monolithic"] = [bool(layer.is_monolithic) for layer in layers]
        g = torch.Generator().manual_seed(0)

        class Capturer:  # what vLLM's RoutedExpertsCapturer.capture receives, per layer
            def capture(self, layer_id, ids):
                out["vllm_captured"].append([layer_id, histogram(ids[:N])])

        for i in range(2):
            hidden, logits = torch.randn(N + 2, HIDDEN, generator=g), torch.randn(N + 2, E, generator=g)
            chosen.clear()

            def forwards():
                with set_forward_context(None, config, num_tokens=N + 2):
                    for layer in layers:
                        layer.forward(hidden, logits)

            step(config, N, forwards)  # N real tokens, 2 rows of padding
            out["expected"].append(histogram(chosen[0][:N]))
            if i == 0:  # vLLM's capture binds after the model is built (its aux-output connector)
                bind_routed_experts_capturer(layers[:1], Capturer())
    from moewatch.runtime.engines import vllm_plugin

    vllm_plugin.close()
    return out


# --- routers that hand on ids outside [0, E) ---------------------------------------------------------

def routers(folder: Path) -> dict:
    """Three layers with vLLM's routers that produce ids outside [0, E): GroupedTopKRouter masking
    padding rows to -1 (skip_padding, VLLM_MOE_SKIP_PADDING, the forward context's is_padding: DeepEP
    v2), FusedTopKBiasRouter appending a fused shared expert (id E, as with ROCm AITER), and
    ZeroExpertRouter (LongCat: zero experts E..E+1 handed on as expert 0 with weight 0). The CPU build
    has neither vLLM's topk_softmax op nor Triton: those two kernels are CPU stand-ins (softmax top-k,
    and a zero output for the zero experts' identity term); the routers' own logic runs as is."""
    os.environ["VLLM_MOE_SKIP_PADDING"] = "1"
    from vllm.distributed.eplb.eplb_state import EplbLayerState
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.fused_moe.router import fused_topk_bias_router, zero_expert_router
    from vllm.model_executor.layers.fused_moe.router.fused_topk_bias_router import FusedTopKBiasRouter
    from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import GroupedTopKRouter
    from vllm.model_executor.layers.fused_moe.router.zero_expert_router import ZeroExpertRouter

    from moewatch.runtime.engines import vllm_plugin

    def topk_softmax(topk_weights, topk_ids, token_expert_indices, gating_output, renormalize, bias=None):
        scores = gating_output.float().softmax(-1)
        chosen = (scores + bias if bias is not None else scores).topk(topk_weights.shape[1], dim=-1).indices
        weights = scores.gather(1, chosen)
        if renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, chosen.to(topk_ids.dtype)

    fused_topk_bias_router.vllm_topk_softmax = topk_softmax
    zero_expert_router.zero_experts_compute_triton = \
        lambda expert_indices, expert_scales, num_experts, zero_expert_type, hidden_states: torch.zeros_like(hidden_states)

    out: dict = {"layers": []}
    with vllm_context(folder) as config:
        made = [
            GroupedTopKRouter(K, E, num_expert_group=2, topk_group=1, skip_padding=True),
            FusedTopKBiasRouter(K, E, e_score_correction_bias=torch.zeros(E), scoring_func="softmax",
                                num_fused_shared_experts=1),
            ZeroExpertRouter(K, E + 2, e_score_correction_bias=torch.zeros(E + 2), num_logical_experts=E,
                             zero_expert_type="identity", scoring_func="softmax"),
        ]
        layers = [moe_layer(i, router=router) for i, router in enumerate(made)]
        # LongCat with EPLB: the zero-expert router's ids also go through vLLM's EPLB mapping to slots
        with_eplb = ZeroExpertRouter(K, E + 2, e_score_correction_bias=torch.zeros(E + 2), num_logical_experts=E,
                                     zero_expert_type="identity", scoring_func="softmax", eplb_state=EplbLayerState())
        layers.append(moe_layer(3, router=with_eplb, enable_eplb=True, num_redundant_experts=2))
        slots = E + 2
        layers[3].set_eplb_state(0, torch.zeros(1, slots, dtype=torch.int32),
                                 torch.cat([torch.arange(slots).remainder(E)[:E, None], torch.full((E, 1), -1)], 1)[None],
                                 torch.ones(1, E, dtype=torch.long))
        with_eplb.eplb_state.should_record_tensor = torch.tensor(True)
        with_eplb.eplb_state.num_unpadded_tokens_tensors = [torch.tensor(N, dtype=torch.int32)]
        g = torch.Generator().manual_seed(1)
        padding = torch.tensor([False] * (N - 2) + [True, True])  # DP padding rows inside the batch
        hidden = torch.randn(N, HIDDEN, generator=g)
        logits = [torch.randn(N, E, generator=g), torch.randn(N, E, generator=g), torch.randn(N, E + 2, generator=g)]
        logits[2][:, E:] += 1.5  # zero experts win often, and so does expert 0 (whose pairs must stay apart)
        logits[2][:, 0] += 1.5
        logits.append(logits[2])
        for layer, row in zip(layers, logits):
            with set_forward_context(None, config, num_tokens=N, is_padding=padding):
                ids_seen = []

                def forwards():
                    weights, ids = layer.router.select_experts(hidden, row)
                    ids_seen.append((weights, ids))

                step(config, N, forwards)
            weights, ids = ids_seen[0]
            routed = ids[:, :K]
            outside = int(((routed < 0) | (routed >= E)).sum()) + int((ids.shape[1] - K) * N)
            zero_weight = int(((weights[:, :K] == 0) & (routed >= 0) & (routed < E)).sum())
            out["layers"].append({"router": type(layer.router).__name__, "ids": ids.tolist(),
                                  "expected": histogram(routed, weights[:, :K]),
                                  "discarded": outside + zero_weight, "zero_weight_pairs": zero_weight})
        counter = vllm_plugin.recorder().counters[3]  # the EPLB layer's expert and slot counts, as counted
        out["eplb_zero"] = {"experts": counter.counts.tolist(), "discarded": int(counter.discarded),
                            "slots": counter.slot_counts.tolist(), "slots_discarded": int(counter.slot_discarded)}
    vllm_plugin.close()
    return out


# --- a drafter with its own EPLB state, registered first ---------------------------------------------

def drafter(folder: Path) -> dict:
    """The target's two MoE layers and a drafter's one (built under vLLM's set_model_tag, as every
    drafter is; its layer index 0, the same as the target's first layer), each model with its EPLB state added by vLLM's EplbState.add_model, the drafter's
    first (as GPUModelRunner.load_model does); the target's map then rearranged by vLLM's own
    _commit_eplb_maps. A target step routes N tokens through both target layers; a proposal runs the
    drafter's layer twice, padded (4 real of 8 rows, then 2 real of 4), through the plugin's proposal
    wrappers around stand-ins for vLLM's propose and its padding (whose real ones need a GPU runner)."""
    from types import SimpleNamespace

    from vllm.compilation.backends import set_model_tag
    from vllm.distributed.eplb.eplb_state import EplbState, _commit_eplb_maps
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.models.interfaces import MixtureOfExperts

    from moewatch.runtime.engines import vllm_plugin

    class Model(torch.nn.Module, MixtureOfExperts):
        """The MixtureOfExperts interface EplbState reads, over real MoE layers."""

        def __init__(self, layers):
            super().__init__()
            self.moe_layers = torch.nn.ModuleList(layers)
            self.num_moe_layers, self.num_logical_experts, self.num_routed_experts = len(layers), E, E
            self.num_redundant_experts, self.num_physical_experts = 2, E + 2
            self.num_local_physical_experts, self.num_expert_groups, self.num_shared_experts = E + 2, 1, 0
            self.expert_weights = []

    out: dict = {}
    with vllm_context(folder, eplb=True) as config:
        target = Model([moe_layer(0, enable_eplb=True, num_redundant_experts=2),
                        moe_layer(1, enable_eplb=True, num_redundant_experts=2)])
        with set_model_tag("eagle_head"):
            # its layer index 0, as the target's first: told apart by the model, not the index
            draft = Model([moe_layer(0, "draft_model", enable_eplb=True, num_redundant_experts=2)])
        state = EplbState(config.parallel_config, torch.device("cpu"))
        state.add_model(draft, SimpleNamespace(compute_hash=lambda: "draft", model="tiny (draft)"),
                        model_name="tiny (draft)")
        state.add_model(target, config.model_config)
        out["registered"] = [s.model_name for s in state.model_states.values()]
        target_state = state.model_states[config.model_config.compute_hash()]
        moved = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 3, 3], [7, 6, 5, 4, 3, 2, 1, 0, 0, 1]])
        _commit_eplb_maps(target_state, moved)
        out["target_map"] = target_state.physical_to_logical_map.tolist()
        out["draft_map"] = state.model_states["draft"].physical_to_logical_map.tolist()
        vllm_plugin._state["model_runner"] = SimpleNamespace(eplb_state=state)  # what execute_model records

        g = torch.Generator().manual_seed(2)
        hidden, logits = torch.randn(N, HIDDEN, generator=g), torch.randn(N, E, generator=g)
        seen = []

        def target_forwards():
            with set_forward_context(None, config, num_tokens=N):
                for layer in target.moe_layers:
                    seen.append(layer.router.select_experts(hidden, logits)[1])

        step(config, N, target_forwards)
        out["target_expected"] = [histogram(ids) for ids in seen]

        draft_layer, drafted = draft.moe_layers[0], []

        def padding(self, num_tokens):  # stands in for vLLM's: the padded size of a batch
            return None, 2 * num_tokens, None

        determine = vllm_plugin._arming_draft_forwards(padding)

        def propose(self):  # stands in for vLLM's: forwards of padded batches, each after its padding
            for real in (4, 2):
                _, rows, _ = determine(self, real)
                x, row_logits = torch.randn(rows, HIDDEN, generator=g), torch.randn(rows, E, generator=g)
                with set_forward_context(None, config, num_tokens=rows):
                    ids = draft_layer.router.select_experts(x, row_logits)[1]
                drafted.append(ids[:real])

        vllm_plugin._drafting_steps(propose)(None)
        out["draft_expected"] = histogram(torch.cat(drafted))
    vllm_plugin.close()
    return out


# --- expert placement without EPLB --------------------------------------------------------------------

def placement(folder: Path) -> dict:
    """For each (E, W, strategy): vLLM's own determine_expert_map on every EP rank (the reference: the
    experts each rank holds, by local index), and the window the plugin's recorder writes for that
    layout (`_describe_placement` given the layout a MoERunner reports: its moe_config's EP size and
    logical experts, its resolved expert_placement_strategy, no EPLB state)."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    from moewatch.runtime.engines import vllm_plugin
    from moewatch.runtime.engines.common import EngineRecorder, EngineSettings, PairWeights

    out = []
    for experts, ranks, strategy in ((8, 4, "linear"), (8, 4, "round_robin"), (10, 4, "linear"),
                                     (10, 4, "round_robin")):
        held = []
        for rank in range(ranks):
            local, expert_map, _ = determine_expert_map(ranks, rank, experts, strategy)
            by_local = [-1] * local
            for expert, index in enumerate(expert_map.tolist()):
                if index >= 0:
                    by_local[index] = expert
            held.append(by_local)
        runner = SimpleNamespace(
            moe_config=SimpleNamespace(num_logical_experts=experts,
                                       moe_parallel_config=SimpleNamespace(use_ep=True, ep_size=ranks)),
            router=SimpleNamespace(eplb_state=None), expert_placement_strategy=strategy)
        windows = folder / f"windows-{experts}-{ranks}-{strategy}"
        rec = EngineRecorder(EngineSettings(window_dir=str(windows), window_steps=1), runtime="vllm", model="tiny",
                             top_k=K, hidden_bytes=4, num_experts=experts, weights=PairWeights(4, K, "cpu"),
                             world_size=ranks)
        vllm_plugin._describe_placement(rec, runner)
        counter = rec.counter(0)
        rec.begin_step(2)
        counter.add(torch.tensor([[0, experts - 1], [1, 2]]))
        rec.end_step()
        rec.close()
        out.append({"experts": experts, "ranks": ranks, "strategy": strategy, "held": held,
                    "windows": str(windows)})
    return out


def main() -> None:
    case, folder = sys.argv[1], Path(sys.argv[2])
    result = {"monolithic": monolithic, "routers": routers, "drafter": drafter, "placement": placement}[case](folder)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
