"""What vLLM's router chose, counted on the kernel paths, drafters and placements the CPU build does
not serve, each driven through vLLM's own code in .venv-vllm (vllm_paths_driver.py): real MoE
layers from vLLM's FusedMoEFactory with moewatch's plugin loaded by vLLM's load_general_plugins, the
windows it wrote read back as Windows (validated) and compared with what vLLM decided."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from moewatch.telemetry import Window

REPO = Path(__file__).resolve().parents[3]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
DRIVER = Path(__file__).parent / "vllm_paths_driver.py"


def run_case(case: str, folder: Path) -> tuple[dict, list[Window], str]:
    """(the driver's JSON, the windows in the order written, its stderr)."""
    assert VLLM_PYTHON.is_file(), f"{VLLM_PYTHON} is missing: `make vllm-env` builds vLLM's environment"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOEWATCH_", "VLLM_"))}
    env.update(MOEWATCH_WINDOW_DIR=str(folder / "windows"), MOEWATCH_WINDOW_STEPS="1000", VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run([str(VLLM_PYTHON), str(DRIVER), case, str(folder)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), read_windows(folder / "windows"), proc.stderr


def read_windows(folder: Path) -> list[Window]:
    files = sorted(folder.glob("*.json"), key=lambda f: int(f.name.split("-")[1]))
    return [Window.from_json(f.read_text()) for f in files]


@pytest.mark.slow
def test_a_monolithic_kernel_is_counted_through_vllms_routed_experts_sink(tmp_path):
    """Drives MoERunner.forward -> _apply_quant_method -> RoutedExperts.forward_monolithic ->
    UnquantizedFusedMoEMethod.apply_monolithic -> FusedMoEKernel.apply_monolithic ->
    FusedMoEKernelMonolithicImpl.apply (prepare by MoEPrepareAndFinalizeNoDPEPMonolithic, the kernel
    a CPU stand-in subclass of vLLM's CPUExpertsInt4 that routes inside itself and fills
    routing_replay_out), and vLLM's bind_routed_experts_capturer binding its own RoutedExpertsSink on
    the same layer after the first step. Before: all zeros (the router's capture slot never runs)."""
    out, windows, stderr = run_case("monolithic", tmp_path)
    assert out["is_monolithic"] == [True, True]
    assert len(windows) == 1
    window = windows[0]
    # Layer 0 (a kernel that reports its ids): both steps' real tokens, padding rows left out.
    assert window.extra["layer_ids"] == [0]
    np.testing.assert_array_equal(window.expert_tokens[0], np.sum(out["expected"], axis=0))
    assert window.expert_tokens.sum() == 2 * 6 * 2
    # vLLM's own capture, bound after moewatch's sink, still captured its step (the sink is shared).
    assert out["vllm_captured"] == [[0, out["expected"][1]]]
    # Layer 1 (a kernel that cannot report its ids) is not in the window as a row of zeros: it is named.
    assert list(window.extra["uncounted_layers"]) == ["1"]
    assert "does not report the expert ids" in window.extra["uncounted_layers"]["1"]
    assert stderr.count("MoE layer 1 is not counted") == 1


@pytest.mark.slow
def test_ids_outside_the_experts_go_to_the_discard_count_and_zero_experts_stay_off_expert_0(tmp_path):
    """Drives vLLM's BaseRouter.select_experts (its capture slot) on GroupedTopKRouter with
    skip_padding (padding rows masked to -1 from the forward context's is_padding, DeepEP v2),
    FusedTopKBiasRouter with num_fused_shared_experts=1 (id E appended to every token, ROCm AITER's
    fused shared experts), and ZeroExpertRouter._compute_routing (LongCat's zero experts remapped to
    expert 0 with weight 0), once more with EPLB (BaseRouter._apply_eplb_mapping, the layer's state
    set by MoERunner.set_eplb_state); vLLM's topk_softmax op and zero-expert Triton kernel, absent
    from the CPU build, are CPU stand-ins. Before: IndexError in index_add_ (a device-side assert on CUDA, which
    ends the engine) for the first two, expert 0 inflated by every zero-expert pair for the third."""
    out, windows, _ = run_case("routers", tmp_path)
    assert [layer["router"] for layer in out["layers"]] == ["GroupedTopKRouter", "FusedTopKBiasRouter",
                                                            "ZeroExpertRouter", "ZeroExpertRouter"]
    grouped, shared, zero, _ = out["layers"]
    assert -1 in np.array(grouped["ids"]) and np.array(shared["ids"])[:, 2].tolist() == [8] * 6
    assert zero["zero_weight_pairs"] > 0 and zero["expected"][0] > 0  # zero experts and real expert-0 pairs
    assert len(windows) == 1
    window = windows[0]
    np.testing.assert_array_equal(window.expert_tokens, [layer["expected"] for layer in out["layers"]])
    assert window.extra["discarded_pairs"] == [layer["discarded"] for layer in out["layers"]]
    # every pair of every real token is either at an expert or discarded, none twice
    assert (window.expert_tokens.sum(axis=1) + window.extra["discarded_pairs"] == [12, 18, 12, 12]).all()
    # With EPLB, the zero experts vLLM maps to expert 0's slots are discarded from the slot counts too,
    # so the slots add up to the experts (else the window would break sum(slot) = sum(expert)); on the
    # CPU vLLM's mapping passes logical ids through (its GPU kernel maps them), so slot e is expert e.
    eplb = out["eplb_zero"]
    assert eplb["experts"] == out["layers"][3]["expected"] and eplb["discarded"] == out["layers"][3]["discarded"]
    assert eplb["slots"] == eplb["experts"] + [0, 0] and eplb["slots_discarded"] == eplb["discarded"]


@pytest.mark.slow
def test_a_drafter_registered_first_counts_apart_against_its_own_map(tmp_path):
    """Drives vLLM's EplbState.add_model (the drafter's state first, as GPUModelRunner.load_model
    adds it), _commit_eplb_maps on the target's state, MoE layers built by FusedMoEFactory under
    vLLM's set_model_tag (as every drafter is built), their routers' select_experts with EPLB
    (_apply_eplb_mapping), and the plugin's wrappers of SpecDecodeBaseProposer.propose and
    _determine_batch_execution_and_padding around stand-ins (vLLM's need a GPU runner). Before: the
    drafter's layer joined the target's window, the drafter's [1, P] map was taken for it, and every
    window failed validation and was dropped without a word."""
    out, windows, _ = run_case("drafter", tmp_path)
    assert out["registered"][0] == "tiny (draft)"  # vLLM registered the drafter first
    assert len(windows) == 2
    target, draft = sorted(windows, key=lambda w: w.model.endswith("(draft)"))
    assert draft.model == target.model + " (draft)"
    # The target's window: its two layers, its own map (the rearranged one), its pairs.
    assert target.extra["layer_ids"] == [0, 1]
    np.testing.assert_array_equal(target.physical_to_logical_map, out["target_map"])
    np.testing.assert_array_equal(target.expert_tokens, out["target_expected"])
    assert target.slot_tokens is not None and target.steps == 1
    # The drafter's window: its layer, the drafter's map, the real tokens of its padded forwards.
    assert draft.extra["layer_ids"] == [0]  # the drafter's own layer 0, not the target's
    np.testing.assert_array_equal(draft.physical_to_logical_map, out["draft_map"])
    np.testing.assert_array_equal(draft.expert_tokens, [out["draft_expected"]])
    assert draft.expert_tokens.sum() == (4 + 2) * 2 and draft.steps == 1


@pytest.mark.slow
def test_expert_placement_is_stated_as_vllm_places_experts(tmp_path):
    """Drives vLLM's determine_expert_map (linear and round_robin, E divisible by W and not) on every
    rank, the reference for the windows the plugin's recorder writes for that layout. Before: every
    window stated a contiguous map (round_robin's baseline wrong), and with E % W != 0 the window
    failed its P % W check and was dropped without a word."""
    out, _, stderr = run_case("placement", tmp_path)
    assert len(out) == 4
    for case in out:
        windows = read_windows(Path(case["windows"]))
        assert len(windows) == 1, case
        window, held, ranks = windows[0], case["held"], case["ranks"]
        placement = window.extra["expert_placement"]
        assert placement["strategy"] == case["strategy"] and placement["ep_size"] == ranks
        assert placement["experts_per_rank"] == [len(h) for h in held]
        assert placement["slot_experts"] == [e for h in held for e in h]
        if case["experts"] % ranks == 0:  # stated as the window's own map: slot s on rank s // (P / W)
            assert window.world_size == ranks
            per_rank = window.num_slots // ranks
            for slot, expert in enumerate(window.physical_to_logical_map[0]):
                assert held[slot // per_rank][slot % per_rank] == expert
        else:  # unequal ranks: a window cannot state them; one rank, the layout under extra
            assert window.world_size == 1 and window.ranks_per_node == 1
        assert window.expert_tokens.sum() == 4
    assert stderr.count("do not divide over 4 EP ranks") == 2
