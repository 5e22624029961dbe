"""Runs in the project venv (SGLang 0.5.23's Python): loads SGLang's plugins with moewatch observing
(the caller sets MOEWATCH_WINDOW_DIR) and MOEWATCH_EPLB off, then calls `eplb_algorithms.rebalance_experts`
as SGLang's rebalance does: once before any map is published (its start), once with its contiguous map
published. Prints one JSON line: SGLang's own deepseek answers to the same calls, the hooked answers,
the records for the windows and the warnings."""

from __future__ import annotations

import json
import logging

from sglang_eplb_driver import N, P, W, Records, call, publish, tokens


def main() -> None:
    import torch
    from sglang.srt.eplb.eplb_algorithms import deepseek
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    from moewatch.runtime.engines import sglang_eplb

    records = Records()
    logging.getLogger().addHandler(records)
    load_plugins()
    hooked = "sglang.srt.eplb.eplb_algorithms.rebalance_experts" in HookRegistry._patched
    answers, own = [], []
    for seed, published in ((0, None), (1, torch.arange(P).remainder(16).repeat(4, 1))):
        if published is not None:
            publish(published)
        load = tokens(seed)
        answers.append([t.tolist() for t in call(load)])
        own.append([t.tolist() for t in deepseek.rebalance_experts(
            weight=load.sum(dim=0), num_replicas=P, num_groups=None, num_nodes=N, num_gpus=W,
            enable_hierarchical=False)])
    print(json.dumps({"hooked": hooked, "observed": sglang_eplb.observed(), "answers": answers, "own": own,
                      "records": sglang_eplb.take_records(), "warnings": records.messages}))


if __name__ == "__main__":
    main()
