"""`moewatch bench`: benchmarks whose results are written down (docs/benchmarks/), never timed tests.

Subcommands load lazily: the planner's needs only numpy, the
probe's needs torch.
"""

from __future__ import annotations

import click

from moewatch.cli import LazyGroup

from .record import recorded

SUBCOMMANDS = {
    "planner": ("moewatch.tools.bench.planner:planner", "Placement quality and speed against DeepSeek's EPLB."),
    "probe": ("moewatch.tools.bench.probe:probe", "The probe's overhead on the forward step (on over off)."),
    "agent": ("moewatch.tools.bench.agent:agent", "An agent process's CPU, memory, scrape time and lag at a window size and rate."),
    "vllm": ("moewatch.tools.bench.vllm:vllm", "The vLLM plugin's cost: tokens/s active over inactive."),
    "loop": ("moewatch.tools.bench.loop:loop", "Closed loop: step time before and after the agent acts, with a control."),
    "eplb": ("moewatch.tools.bench.eplb:eplb", "moewatch's EPLB policy against vLLM's and SGLang's own."),
    "a2a": ("moewatch.tools.bench.a2a:a2a", "All-to-all time against Aurora's bound on emulated links, placement x schedule."),
}
# Verbs that measure nothing (no result file).
TOOLS = {
    "render": ("moewatch.tools.bench.render:render", "Render the benchmark docs' tables from the recorded results."),
}


class BenchGroup(LazyGroup):
    """The bench verbs: every measuring one goes through `recorded` (a result file with provenance)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["moewatch.bench.args"] = list(args)  # the command line a result file repeats
        return super().parse_args(ctx, args)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        command = super().get_command(ctx, name)
        if command is None or name not in SUBCOMMANDS:
            return command
        return recorded(name, command)


@click.group(cls=BenchGroup, verbs={**SUBCOMMANDS, **TOOLS})
def bench() -> None:
    """Benchmarks: `planner` (against DeepSeek's EPLB), `probe` (overhead on the forward step), `agent`
    (one agent process at a window size and rate), `vllm` (the vLLM plugin's cost), `loop` (step time
    before and after the agent acts), `eplb` (moewatch's EPLB policy against vLLM's and SGLang's), `a2a`
    (the all-to-all against its bound on emulated links, placement x schedule);
    `render` writes their tables into the docs from the recorded results.
    Each measuring verb writes its result with provenance into docs/benchmarks/results/ (--results-dir, --no-record).
    """
