"""The engines' own rebalancing policies, each called in its engine's environment.

moewatch's core never imports torch or an engine: it writes the calls to a temporary folder and runs
`python -m moewatch.runtime.engines.eplb_policy_driver ENGINE FOLDER` with the engine's interpreter
(--vllm-python, --sglang-python: a Python where the engine and moewatch are installed), which calls
vLLM's DefaultEplbPolicy or SGLang's deepseek algorithm through the engine's own function and writes
the maps back. One process per engine for all of a replay's calls (an engine's import takes seconds).

Sizes: R rebalances, L layers, E experts, P slots.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np

from ..errors import InputError

DRIVER = "moewatch.runtime.engines.eplb_policy_driver"
# moewatch's name of each engine's own policy -> the engine the driver runs it in.
ENGINE_POLICIES = {"vllm_default": "vllm", "sglang_deepseek": "sglang"}
TIMEOUT_SECONDS = 3600


class EnginePolicyError(InputError):
    """An engine's environment could not run its policy (no such Python, the engine missing there, a failure)."""


@dataclass(frozen=True)
class PolicySizes:
    slots: int  # P
    ranks: int  # W
    nodes: int
    groups: int  # expert groups (DeepSeek-V3's n_group); 1 for models without group-limited routing

    def to_dict(self) -> dict[str, int]:
        return {"slots": self.slots, "ranks": self.ranks, "nodes": self.nodes, "groups": self.groups}


def run_engine_policy(policy: str, python: str, sequences: Mapping[str, np.ndarray], initial: np.ndarray,
                      sizes: PolicySizes) -> dict[str, tuple[np.ndarray, list[float]]]:
    """{name: [R, L, E] loads} -> {name: ([R, L, P] maps, seconds per call)}: `policy` (a key of
    ENGINE_POLICIES) called once per load in order, each from the map the call before returned (the
    first from `initial` [L, P]), by `python`. Raises EnginePolicyError naming the interpreter."""
    engine = ENGINE_POLICIES[policy]
    flag = f"--{engine}-python"
    if not Path(python).is_file():
        raise EnginePolicyError(flag, f"{python} is not a file (a Python with {engine} and moewatch installed)")
    with tempfile.TemporaryDirectory(prefix="moewatch-replay-") as folder:
        base = Path(folder)
        (base / "shape.json").write_text(json.dumps(sizes.to_dict()))
        np.savez(base / "calls.npz", initial=np.asarray(initial, dtype=np.int64),
                 **{name: np.asarray(loads, dtype=np.float64) for name, loads in sequences.items()})
        try:
            proc = subprocess.run([python, "-m", DRIVER, engine, folder], capture_output=True, text=True,
                                  timeout=TIMEOUT_SECONDS)
        except OSError as exc:
            raise EnginePolicyError(flag, f"cannot run {python} ({exc.strerror or exc})") from None
        except subprocess.TimeoutExpired:
            raise EnginePolicyError(flag, f"{engine}'s policy did not finish in {TIMEOUT_SECONDS} s") from None
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise EnginePolicyError(flag, f"{engine}'s policy failed in {python}: {last}")
        with np.load(base / f"{engine}.npz") as data:
            maps = {name: data[name] for name in data.files}
        seconds = json.loads((base / f"{engine}.json").read_text())
    return {name: (maps[name], seconds[name]) for name in sequences}
