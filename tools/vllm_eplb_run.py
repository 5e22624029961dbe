"""A short vLLM run with EPLB and moewatch's policy: the multi-GPU part of the GPU check's
`engine_policy` (tools/gpu_check.py), run where two GPUs or more and vLLM are present.

A tiny random-weight Qwen3-MoE (`moewatch bench vllm`'s) whose HOT_EXPERTS of each layer win more
of the routing (their gate rows scaled), so that vLLM's contiguous start leaves the first rank
busier; served on two ranks with `enable_expert_parallel`, `enable_eplb` (2 redundant
experts, a rebalance every STEP_INTERVAL steps over a window of WINDOW_SIZE) and MOEWATCH_EPLB=1,
the plugin writing a window every WINDOW_STEPS steps. What the windows must show (`verdict`): the
map in force changing, each change decided by moewatch's policy (the windows' engine_rebalance
records, none a fallback), the agent's own next-window check of those rebalances finding no layer
worse, and the balancedness measured after the last change above the one measured before the first.

Never run on GPUs: no machine this project is developed on has two. Its CPU path (tests/tools/
test_vllm_eplb_run.py) runs the same model, prompts, engine process and window reading on vLLM's
CPU build with EPLB off, on one rank (vLLM refuses EPLB without CUDA, and its CPU fused-MoE kernel
crashes with expert parallelism: a segmentation fault in cpu_fused_moe.cpp, vLLM 0.32.0, two ranks
here): what a GPU run adds is the two ranks, expert parallelism, EPLB and the slot counts it brings
into the windows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

RANKS = 2
EXPERTS = 16
LAYERS = 3
# On the first rank, each with one replica: vLLM's start holds experts 0 and 1 twice (its redundant
# slots), one on each rank, which would spread them already.
HOT_EXPERTS = (2, 3, 4)
HOT_GATE_SCALE = 3.0
REDUNDANT_EXPERTS = 2
STEP_INTERVAL = 48
WINDOW_SIZE = 24
WINDOW_STEPS = 8


def engine_environment(window_dir: Path, eplb: bool, cache_dir: Path, model: Path) -> dict[str, str]:
    """The engine process's environment: the caller's without its MOEWATCH_ and VLLM_ settings, plus
    the plugin's window folder and, with EPLB, moewatch's policy priced for this model's experts."""
    config = json.loads((model / "config.json").read_text())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOEWATCH_", "VLLM_"))}
    env.update(MOEWATCH_WINDOW_DIR=str(window_dir), MOEWATCH_WINDOW_STEPS=str(WINDOW_STEPS),
               VLLM_CACHE_ROOT=str(cache_dir), VLLM_CPU_KVCACHE_SPACE="1")
    if eplb:
        # gate, up and down projections of one expert in bf16: what a move transfers
        expert_bytes = 3 * config["hidden_size"] * config["moe_intermediate_size"] * 2
        env.update(MOEWATCH_EPLB="1", MOEWATCH_EPLB_EXPERT_BYTES=str(expert_bytes),
                   MOEWATCH_EPLB_HORIZON_STEPS=str(STEP_INTERVAL), MOEWATCH_EPLB_WINDOW_STEPS=str(WINDOW_SIZE))
    return env


def serve(model: str, prompts_path: str, out_path: str, ranks: int, eplb: bool, rounds: int, max_tokens: int) -> None:
    """Inside the engine's environment: serve the prompts `rounds` times, write what was served."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p in json.loads(Path(prompts_path).read_text())]
    options: dict[str, Any] = {}
    if eplb:
        options = {"enable_expert_parallel": True, "enable_eplb": True,
                   "eplb_config": {"num_redundant_experts": REDUNDANT_EXPERTS, "step_interval": STEP_INTERVAL,
                                   "window_size": WINDOW_SIZE}}
    on_gpu = eplb  # vLLM's EPLB needs CUDA; the CPU path runs without it, in float32
    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16" if on_gpu else "float32",
              max_model_len=512, enable_prefix_caching=False, tensor_parallel_size=ranks, seed=0,
              **({"gpu_memory_utilization": 0.3} if on_gpu else {}), **options)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False, ignore_eos=True)
    served = []
    for _ in range(rounds):
        started = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        served.append({"tokens": sum(len(r.outputs[0].token_ids) for r in results),
                       "seconds": time.perf_counter() - started})
    del llm  # shuts the engine down: the plugin flushes its last window
    Path(out_path).write_text(json.dumps({"rounds": served}))


def run(python: str, ranks: int = RANKS, eplb: bool = True, rounds: int = 4, prompts: int = 32,
        prompt_len: int = 48, max_tokens: int = 48, timeout_s: float = 240.0) -> dict:
    """Build the model, serve it in an engine process of `python` (an environment with vLLM and
    moewatch), read the windows the plugin wrote -> {"ran", "served" (tokens and seconds per round),
    "windows", "expert_pairs" ([L, E] pairs the windows counted), "verdict", "ok"}."""
    from moewatch.telemetry import Window
    from moewatch.tools.bench.vllm import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="moewatch-vllm-eplb-") as tmp:
        root = Path(tmp)
        model = root / "model"
        build_tiny_model(python, model, min(timeout_s, 120.0), layers=LAYERS, experts=EXPERTS,
                         hot_experts=HOT_EXPERTS, hot_scale=HOT_GATE_SCALE)
        rng = np.random.default_rng(0)
        (root / "prompts.json").write_text(json.dumps(rng.integers(0, 1024, (prompts, prompt_len)).tolist()))
        env = engine_environment(root / "windows", eplb, root / "cache", model)
        args = [python, "-m", "moewatch.tools.vllm_eplb_run", str(model), str(root / "prompts.json"),
                str(root / "served.json"), "--ranks", str(ranks), "--rounds", str(rounds),
                "--max-tokens", str(max_tokens)]
        proc = subprocess.run(args + (["--eplb"] if eplb else []), env=env, capture_output=True, text=True,
                              timeout=timeout_s)
        if proc.returncode != 0:
            return {"ran": False, "ok": False, "why": f"the engine exited {proc.returncode}: {proc.stderr[-2000:]}"}
        windows = [Window.from_json(f.read_text()) for f in sorted((root / "windows").glob("*.json"))]
        served = json.loads((root / "served.json").read_text())["rounds"]
    found = verdict(windows)
    pairs = sum(w.expert_tokens for w in windows) if windows else np.zeros((LAYERS, EXPERTS), dtype=np.int64)
    return {"ran": True, "ranks": ranks, "eplb": eplb, "served": served, "windows": len(windows),
            "expert_pairs": pairs.tolist(), "verdict": found, "ok": found["ok"]}


def verdict(windows: Sequence) -> dict:
    """Windows in the order written -> what they show of the engine's rebalancing: the map's changes
    (windows whose map in force differs from the previous window's), the policy's records (decided,
    fallbacks; read as the agent reads them), the agent's own next-window checks replayed over the
    windows as its daemon runs them (engine_rebalance.step, the default drop), the mean over layers
    of the measured balancedness before the first change and after the last, and ok when the map
    changed, no record was a fallback, every layer a change touched was moved by a decided record in
    that window or an earlier one (vLLM may migrate one rebalance's layers over several steps), the
    agent settled at least one check and found no layer worse, and the balancedness after is above
    the one before."""
    from moewatch.agent import engine_rebalance
    from moewatch.agent.config import VerifySettings
    from moewatch.agent.metrics.engine_rebalance import records_of
    from moewatch.telemetry import balancedness

    # a window of logical counts only carries the identity map: the map in force comes with slot counts
    maps = [w.physical_to_logical_map if w.slot_tokens is not None else None for w in windows]
    measured = [balancedness(w) for w in windows]
    records = [records_of(w) for w in windows]
    decided = sum(1 for rs in records for r in rs if r.get("fallback") is not True)
    fallbacks = sum(1 for rs in records for r in rs if r.get("fallback") is True)
    checks = {"not_worse": 0, "worse": 0}
    pending, previous, drop = None, None, VerifySettings().rollback_balancedness_drop
    for current, rs in zip(measured, records):
        pending, check = engine_rebalance.step(pending, previous, current, rs, drop)
        previous = current
        if check is not None:
            checks[check["verdict"]] += 1
    out: dict[str, Any] = {"windows": len(windows), "decided": decided, "fallbacks": fallbacks, "changes": [],
                           "agent_checks": checks, "balancedness_before": None, "balancedness_after": None,
                           "ok": False}
    with_map = [i for i, m in enumerate(maps) if m is not None]
    if not with_map:
        out["why"] = "no window carries the map in force and its slot counts (EPLB off, or not on a GPU)"
        return out
    unexplained = []
    moved_so_far: set[int] = set()  # a record rides the window flushed after its call; its map comes in after
    for i in range(len(windows)):
        moved_so_far.update(engine_rebalance.moved_layers(records[i]))
        if i == 0 or maps[i] is None or maps[i - 1] is None or np.array_equal(maps[i], maps[i - 1]):
            continue
        layers = [int(x) for x in np.flatnonzero((maps[i] != maps[i - 1]).any(axis=1))]
        out["changes"].append({"window": i, "layers": layers})
        if not set(layers) <= moved_so_far:
            unexplained.append(i)
    if not out["changes"]:
        out["why"] = f"the map in force never changed over {len(with_map)} windows"
        return out
    first, last = out["changes"][0]["window"], out["changes"][-1]["window"]
    before = [float(measured[i].mean()) for i in range(first) if measured[i] is not None]
    after = [float(measured[i].mean()) for i in range(last, len(windows)) if measured[i] is not None]
    if not before or not after:
        out["why"] = "no balancedness measured before the first change or after the last"
        return out
    out["balancedness_before"] = round(float(np.mean(before)), 4)
    out["balancedness_after"] = round(float(np.mean(after)), 4)
    problems = []
    if fallbacks:
        problems.append(f"{fallbacks} rebalance(s) answered by vLLM's own policy")
    if unexplained:
        problems.append(f"map changes in windows {unexplained} on layers no decided record moved")
    if checks["worse"]:
        problems.append(f"the agent found layers worse after {checks['worse']} rebalance(s)")
    elif not checks["not_worse"]:
        problems.append("the agent settled no check of a rebalance")
    if out["balancedness_after"] <= out["balancedness_before"]:
        problems.append("balancedness did not rise")
    out["ok"] = not problems
    if problems:
        out["why"] = "; ".join(problems)
    return out


def main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m moewatch.tools.vllm_eplb_run")
    parser.add_argument("model")
    parser.add_argument("prompts")
    parser.add_argument("out")
    # run() passes every option: the engine process has no defaults of its own to drift from run()'s
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--eplb", action="store_true")
    args = parser.parse_args(argv)
    serve(args.model, args.prompts, args.out, args.ranks, args.eplb, args.rounds, args.max_tokens)


if __name__ == "__main__":
    main(sys.argv[1:])
