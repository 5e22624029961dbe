"""Runs inside .venv-vllm (tests/runtime/engines/test_vllm_ledger.py starts it): vLLM's offline engine
(in process, eager, one rank) serves token prompts for ROUNDS rounds with moewatch's plugin writing
windows to MOEWATCH_WINDOW_DIR and MOEWATCH_EPLB off, so the plugin wraps vLLM's own "default" EPLB
policy to record its rebalances (vllm_eplb.record_engine_policy). Between two rounds it rebalances as
vLLM's EplbState.rearrange asks its policy: EPLB_POLICIES[EPLBConfig().policy].rebalance_experts on
the load the plugin's windows measured since the previous rebalance ([L, E], summed: vLLM's EPLB
rebalances on its recent steps' load), NUM_SLOTS slots on NUM_RANKS ranks,
from the map committed before (vLLM's contiguous start first). vLLM's CPU build refuses EPLB, so
its EplbState never runs here and no weights move (the transfer is CUDA): the record the policy call
leaves goes into the plugin's next window, as a GPU run's would. Prints one JSON line: each call's
map before, answer, vLLM's DefaultEplbPolicy answer to the same call, and the load it was given.

usage: vllm_ledger_driver.py MODEL_DIR PROMPTS_JSON ROUNDS NUM_SLOTS NUM_RANKS
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np


def measured_load(paths: list[Path], layers: int, experts: int) -> np.ndarray:
    """[L, E] pairs the plugin's windows in `paths` counted."""
    load = np.zeros((layers, experts), dtype=np.int64)
    for path in paths:
        load += np.asarray(json.loads(path.read_text())["expert_tokens"], dtype=np.int64)
    return load


def require(condition: bool, what: str) -> None:
    """Stop with the reason on stderr (the test shows it) when what the driver relies on does not hold:
    a later figure built on it would fail far from the cause."""
    if not condition:
        raise SystemExit(f"vllm_ledger_driver: {what}")


def main() -> None:
    model, prompts_path, rounds, slots, ranks = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    import torch
    from vllm import LLM, SamplingParams
    from vllm.config.parallel import EPLBConfig
    from vllm.distributed.eplb import policy as policies
    from vllm.distributed.eplb.policy.default import DefaultEplbPolicy
    from vllm.inputs import TokensPrompt

    prompts = json.loads(Path(prompts_path).read_text())
    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype="float32", max_model_len=256,
              enable_prefix_caching=False, seed=0)
    config = llm.llm_engine.vllm_config.model_config
    layers, experts = config.get_total_num_hidden_layers(), config.get_num_experts()
    params = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False, ignore_eos=True)
    window_dir = Path(os.environ["MOEWATCH_WINDOW_DIR"])
    chosen = policies.EPLB_POLICIES[EPLBConfig().policy]
    require(chosen is not DefaultEplbPolicy, "the plugin did not wrap vLLM's default EPLB policy (is "
            "MOEWATCH_WINDOW_DIR set and MOEWATCH_EPLB off?)")
    current = torch.arange(slots).remainder(experts).repeat(layers, 1)  # vLLM's start: contiguous
    calls = []
    seen: set[Path] = set()
    for round_ in range(rounds):
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        if round_ == rounds - 1:
            break
        recent = sorted(set(window_dir.glob("*.json")) - seen)
        seen |= set(recent)
        require(bool(recent), f"round {round_}: the plugin wrote no window")
        load = torch.from_numpy(measured_load(recent, layers, experts))
        # An all-zero load is vLLM's profile call, which the wrapper does not record.
        require(bool(load.sum() > 0), f"round {round_}: the windows counted no routed pair")
        own = DefaultEplbPolicy.rebalance_experts(load, slots, 1, 1, ranks, current)
        answer = chosen.rebalance_experts(load, slots, 1, 1, ranks, current)
        require(tuple(answer.shape) == (layers, slots), f"round {round_}: the policy answered shape "
                f"{tuple(answer.shape)}, not ({layers}, {slots})")
        calls.append({"before": current.tolist(), "after": answer.tolist(), "vllm_own": own.tolist(),
                      "load": load.tolist()})
        current = answer
    del llm  # shuts the engine down: the plugin flushes its last window
    print(json.dumps({"policy": chosen.__name__, "calls": calls}))


if __name__ == "__main__":
    main()
