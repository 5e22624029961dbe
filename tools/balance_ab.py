"""Does balancing shorten the step on this machine? The premise of `moewatch bench loop`, without the agent.

    .venv/bin/python -m moewatch.tools.balance_ab [--steps 80] [--segment 10]

One run of the reference runtime on the bench's shape and skew (two hot experts carrying 70 % of the
pairs, started on rank 0, each rank pinned to its own core), switched by scripted plans every
`--segment` steps between that placement and one that gives each hot expert a replica on rank 1 (the
kind of plan the agent makes), each plan moving all layers at one step boundary (migrations are
outside the step times). Segments alternate, so a drift in the machine's load falls on both sides.
Prints the step p50 of each side (the first two steps of each segment left out) and their ratio:
well under 1 where the busiest rank sets the step; near 1 where other work on the same cores takes
whatever core time a light rank leaves idle, so total work sets it again.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from moewatch.runtime.config import RuntimeConfig
from moewatch.runtime.launcher import launch
from moewatch.runtime.workload import hot_start_placement


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--segment", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=3072)
    parser.add_argument("--batch-tokens", type=int, default=256)
    args = parser.parse_args()
    cfg = RuntimeConfig(ranks=2, layers=4, experts=8, slots=12, top_k=2, hidden=args.hidden, ffn=args.ffn,
                        batch_tokens=args.batch_tokens,
                        workload="zipf", zipf=0.0, hot_experts=2, hot_share=0.7, hot_on_rank=0, steps=args.steps,
                        warmup_steps=2, probe=False, migrate_layers_per_step=4)
    hot = hot_start_placement(cfg)
    spread = hot.copy()
    spread[:, 10:12] = hot[:, 0:2]  # rank 1's two spare slots take the hot experts (slots 0-1 of rank 0)
    plans = [(step, {"epoch": i + 1, "physical_to_logical_map": (spread if i % 2 == 0 else hot).tolist(),
                     "capacity_factor": [0.0] * cfg.layers, "reason": "balance_ab"})
             for i, step in enumerate(range(args.segment, args.steps, args.segment))]
    result = launch(cfg.replace(scripted_plans=plans))
    steps = np.array(result.step_seconds)
    sides: dict[bool, list] = {False: [], True: []}
    for k in range(0, len(steps), args.segment):
        sides[(k // args.segment) % 2 == 1].append(steps[k + 2:k + args.segment])
    skewed, spread_s = np.concatenate(sides[False]), np.concatenate(sides[True])
    print(json.dumps({"step_p50_skewed_s": float(np.median(skewed)), "step_p50_spread_s": float(np.median(spread_s)),
                      "ratio": float(np.median(spread_s) / np.median(skewed)), "plans_applied": result.plans_applied,
                      "pairs_lost": result.pairs_lost, "cpu_binding": result.cpu_binding}))


if __name__ == "__main__":
    main()
