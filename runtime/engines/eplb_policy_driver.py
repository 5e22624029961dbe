"""The engines' own EPLB policy functions, called in the engine's environment (torch and the engine
installed) for `moewatch replay` (moewatch/replay/engine_policies.py starts this module there):

    python -m moewatch.runtime.engines.eplb_policy_driver ENGINE FOLDER      (ENGINE: vllm | sglang)

reads FOLDER/shape.json ({"slots", "ranks", "nodes", "groups"}) and FOLDER/calls.npz (`initial`: the
[L, P] map in force at the start; every other key a sequence of [R, L, E] loads, one per rebalance),
calls the engine's function once per load in order, each from the map the one before returned (the
first from `initial`), and writes FOLDER/<ENGINE>.npz (each sequence's [R, L, P] maps) and
FOLDER/<ENGINE>.json ({sequence: [seconds per call]}).

- vllm: `vllm.distributed.eplb.policy.default.DefaultEplbPolicy.rebalance_experts(weight, num_replicas,
  num_groups, num_nodes, num_ranks, old_global_expert_indices)`, vLLM 0.32's default policy as its
  EplbState calls it (the map in force passed, so its same-GPU slot keeping runs);
- sglang: `sglang.srt.eplb.eplb_algorithms.rebalance_experts(tokens_per_expert, num_physical_experts,
  num_local_physical_experts, num_groups, num_nodes, EplbAlgorithm.deepseek)`, SGLang 0.5.23's, which
  is not given the map in force.
The engine's own class, not the registry entry: moewatch's plugin may have replaced vLLM's "default".
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ENGINES = ("vllm", "sglang")


def vllm_default(loads: np.ndarray, initial: np.ndarray, shape: dict) -> tuple[np.ndarray, list[float]]:
    """[R, L, E] loads -> ([R, L, P] maps, seconds per call) from vLLM's DefaultEplbPolicy."""
    from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

    current = torch.from_numpy(initial.astype(np.int64))
    maps, seconds = [], []
    for load in loads:
        started = time.perf_counter()
        current = DefaultEplbPolicy.rebalance_experts(torch.from_numpy(load), shape["slots"], shape["groups"],
                                                      shape["nodes"], shape["ranks"], current)
        seconds.append(time.perf_counter() - started)
        maps.append(current.numpy().astype(np.int64))
    return _stacked(maps, loads, initial), seconds


def sglang_deepseek(loads: np.ndarray, initial: np.ndarray, shape: dict) -> tuple[np.ndarray, list[float]]:
    """[R, L, E] loads -> ([R, L, P] maps, seconds per call) from SGLang's deepseek algorithm."""
    from sglang.srt.eplb import eplb_algorithms  # noqa: F401  imported before the timed calls

    maps, seconds = [], []
    for load in loads:
        started = time.perf_counter()
        phy2log = sglang_deepseek_call(load, shape)
        seconds.append(time.perf_counter() - started)
        maps.append(phy2log.numpy().astype(np.int64))
    return _stacked(maps, loads, initial), seconds


def sglang_deepseek_call(load: np.ndarray, shape: dict) -> "torch.Tensor":
    """[L, E] load -> [L, P] physical-to-logical map: one call of SGLang's deepseek algorithm."""
    from sglang.srt.eplb import eplb_algorithms

    phy2log, _, _ = eplb_algorithms.rebalance_experts(
        tokens_per_expert=torch.from_numpy(load)[None], num_physical_experts=shape["slots"],
        num_local_physical_experts=shape["slots"] // shape["ranks"], num_groups=shape["groups"],
        num_nodes=shape["nodes"], algorithm=eplb_algorithms.EplbAlgorithm.deepseek)
    return phy2log


def _stacked(maps: list[np.ndarray], loads: np.ndarray, initial: np.ndarray) -> np.ndarray:
    return np.stack(maps) if maps else np.zeros((0, loads.shape[1], initial.shape[1]), dtype=np.int64)


def main(engine: str, folder: str) -> None:
    if engine not in ENGINES:
        raise SystemExit(f"engine: expected one of {ENGINES}, got {engine!r}")
    base = Path(folder)
    shape = json.loads((base / "shape.json").read_text())
    with np.load(base / "calls.npz") as data:
        initial = data["initial"]
        sequences = {name: data[name].astype(np.float64) for name in data.files if name != "initial"}
    policy = vllm_default if engine == "vllm" else sglang_deepseek
    maps, seconds = {}, {}
    for name, loads in sequences.items():
        maps[name], seconds[name] = policy(loads, initial, shape)
    np.savez(base / f"{engine}.npz", **maps)
    (base / f"{engine}.json").write_text(json.dumps(seconds))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
