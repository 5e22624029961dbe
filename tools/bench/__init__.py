"""`moewatch bench`: benchmarks whose results are written down (docs/benchmarks/), never timed tests.

Subcommands load lazily: the planner's needs only numpy, the
probe's needs torch.
"""

from __future__ import annotations

import click

from moewatch.cli import LazyGroup

SUBCOMMANDS = {
    "planner": ("moewatch.tools.bench.planner:planner", "Placement quality and speed against DeepSeek's EPLB."),
    "probe": ("moewatch.tools.bench.probe:probe", "The probe's overhead on the forward step (on over off)."),
    "agent": ("moewatch.tools.bench.agent:agent", "An agent process's CPU, memory, scrape time and lag at a window size and rate."),
    "vllm": ("moewatch.tools.bench.vllm:vllm", "The vLLM plugin's cost: tokens/s active over inactive."),
    "loop": ("moewatch.tools.bench.loop:loop", "Closed loop: step time before and after the agent acts, with a control."),
}


@click.group(cls=LazyGroup, verbs=SUBCOMMANDS)
def bench() -> None:
    """Benchmarks: `planner` (against DeepSeek's EPLB), `probe` (overhead on the forward step), `agent`
    (one agent process at a window size and rate), `vllm` (the vLLM plugin's cost), `loop` (step time
    before and after the agent acts)."""
