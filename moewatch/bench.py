"""`moewatch bench`: benchmarks whose results are written down (docs/benchmarks/), never timed tests.

Subcommands live beside what they measure and load lazily: the planner's needs only numpy, the
probe's needs torch.
"""

from __future__ import annotations

import click

from .cli import LazyGroup

SUBCOMMANDS = {
    "planner": ("moewatch.planner.bench:planner", "Placement quality and speed against DeepSeek's EPLB."),
    "probe": ("moewatch.runtime.bench:probe", "The probe's overhead on the forward step (on over off)."),
    "agent": ("moewatch.agent.bench:agent", "An agent process's CPU, memory, scrape time and lag at a window size and rate."),
    "vllm": ("moewatch.runtime.engines.bench:vllm", "The vLLM plugin's cost: tokens/s active over inactive."),
    "loop": ("moewatch.agent.loopbench:loop", "Closed loop: step time before and after the agent acts, with a control."),
    "eplb": ("moewatch.runtime.engines.eplb_bench:eplb", "moewatch's EPLB policy against vLLM's and SGLang's own."),
}


@click.group(cls=LazyGroup, verbs=SUBCOMMANDS)
def bench() -> None:
    """Benchmarks: `planner` (against DeepSeek's EPLB), `probe` (overhead on the forward step), `agent`
    (one agent process at a window size and rate), `vllm` (the vLLM plugin's cost), `loop` (step time
    before and after the agent acts), `eplb` (moewatch's EPLB policy against vLLM's and SGLang's)."""
