"""Runs inside .venv-vllm (the tests start it there): loads vLLM's general plugins the way each vLLM
process does, with the caller's MOEWATCH_EPLB / MOEWATCH_EPLB_PLACEMENT (or, with those unset and
MOEWATCH_WINDOW_DIR set, vLLM's own policy recorded), then asks the policy vLLM
resolves (vllm.distributed.eplb.policy.EPLB_POLICIES["default"], what EplbState looks up for
EPLBConfig().policy) for a map as EplbState.rearrange does: the profile run's all-zero load first,
then two rebalances of different loads, each from the map committed before it (the profile
run's answer is not committed). Prints one JSON
line: the maps, what vLLM's own compute_logical_maps reads from the first, vLLM's own policy's answers
to the same calls, the warnings and the records the process keeps for its windows.

usage: vllm_static_placement_driver.py LAYERS EXPERTS SLOTS RANKS
"""

from __future__ import annotations

import json
import logging
import sys

import numpy as np


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def main() -> None:
    layers, experts, slots, ranks = map(int, sys.argv[1:5])
    warnings = Warnings()
    logging.getLogger().addHandler(warnings)
    import torch
    from vllm.config.parallel import EPLBConfig
    from vllm.distributed.eplb import policy as policies
    from vllm.distributed.eplb.eplb_state import compute_logical_maps
    from vllm.distributed.eplb.policy.default import DefaultEplbPolicy
    from vllm.plugins import load_general_plugins

    from moewatch.runtime.engines import vllm_eplb

    load_general_plugins()
    chosen = policies.EPLB_POLICIES[EPLBConfig().policy]
    rng = np.random.default_rng(0)
    loads = [torch.zeros(layers, experts, dtype=torch.int64)]  # the profile run's window
    loads += [torch.from_numpy((rng.zipf(1.5, (layers, experts)).clip(max=1000) * 10).astype(np.int64))
              for _ in range(2)]
    current = torch.arange(slots).remainder(experts).repeat(layers, 1)  # vLLM's start: contiguous
    maps, own = [], []
    for load in loads:
        own.append(DefaultEplbPolicy.rebalance_experts(load, slots, 1, 1, ranks, current).tolist())
        answer = chosen.rebalance_experts(load, slots, 1, 1, ranks, current)
        assert answer.dtype == torch.int64 and answer.device.type == "cpu", answer
        maps.append(answer.tolist())
        if load.any():  # vLLM commits no map from the profile run (EplbState.rearrange, is_profile)
            current = answer
    _, replicas = compute_logical_maps(torch.tensor(maps[0]), experts)
    print(json.dumps({"policy": chosen.__name__, "maps": maps, "vllm_own": own, "replicas": replicas.tolist(),
                      "warnings": warnings.messages, "records": vllm_eplb.take_records()}))


if __name__ == "__main__":
    main()
