"""`moewatch bench`: benchmarks whose results are written down (docs/benchmarks/), never timed tests.

Subcommands live beside what they measure and load lazily: the planner's needs only numpy, the
probe's needs torch.
"""

from __future__ import annotations

import importlib

import click

SUBCOMMANDS = {
    "planner": "moewatch.planner.bench:planner",
    "probe": "moewatch.runtime.bench:probe",
}


class _LazyBench(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in SUBCOMMANDS:
            return None
        module_name, attr = SUBCOMMANDS[name].split(":")
        try:
            return getattr(importlib.import_module(module_name), attr)
        except ImportError as exc:
            raise click.ClickException(f"`moewatch bench {name}` is unavailable here: {exc}") from None


@click.group(cls=_LazyBench)
def bench() -> None:
    """Benchmarks: `planner` (against DeepSeek's EPLB), `probe` (overhead on the forward step)."""
