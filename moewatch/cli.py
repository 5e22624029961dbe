"""The `moewatch` command. Verbs load lazily so `moewatch diagnose` never imports torch or the agent.

Each verb lives beside the code it drives and is registered here by "module:attribute":
the core's verbs in moewatch/commands.py, the planner's in moewatch/planner/cli.py, the agent's in
agent/cli.py, the runtime's in runtime/cli.py; the demo and the benchmarks in tools/ (moewatch.tools), which
the sidecar itself never imports.
"""

from __future__ import annotations

import importlib

import click

from . import __version__

VERBS: dict[str, tuple[str, str]] = {
    "diagnose": ("moewatch.commands:diagnose", "Triage a window: which layers are comm-bound or imbalance-bound, and why."),
    "examples": ("moewatch.commands:examples", "Write the example windows (one per verdict) into a folder."),
    "plan": ("moewatch.planner.cli:plan", "Solve an expert placement (replicas, packing, affinity) from a load file."),
    "whatif": ("moewatch.planner.cli:whatif", "Sweep the cost model over experts, ranks and batch size."),
    "runtime": ("moewatch.runtime.cli:runtime", "Launch the reference EP runtime on this machine."),
    "agent": ("moewatch.agent.cli:agent", "Run the sidecar agent (the daemon)."),
    "demo": ("moewatch.tools.demo:demo", "Run the reference runtime and the agent together, wired through a socket."),
    "top": ("moewatch.agent.cli:top", "Live per-layer view of a running agent."),
    "ledger": ("moewatch.ledger_cli:ledger", "Every rebalance in recorded windows or an audit log: stall, gain, net, paid or not."),
    "replay": ("moewatch.replay.cli:replay_command", "Replay recorded windows through the rebalancing policies; recommend EPLB settings."),
    "report": ("moewatch.report:report", "Draw a window as one picture (PNG): time split, rank and expert load, traffic."),
    "bench": ("moewatch.tools.bench:bench", "Benchmarks: planner, probe, agent, vLLM, closed loop."),
}


class LazyGroup(click.Group):
    """A click group whose commands import on first use, from {name: ("module:attr", help)}."""

    def __init__(self, *args, verbs: dict[str, tuple[str, str]], **kwargs):
        super().__init__(*args, **kwargs)
        self.verbs = verbs

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(self.verbs)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in self.verbs:
            return None
        module_name, attr = self.verbs[name][0].split(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            return _unavailable(name, f"{ctx.command_path} {name}", f"{exc} (install the extra that provides it, e.g. pip install 'moewatch[runtime]')")
        return getattr(module, attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Listing help must not import every verb's dependencies.
        with formatter.section("Commands"):
            formatter.write_dl([(name, self.verbs[name][1]) for name in sorted(self.verbs)])


def _unavailable(name: str, path: str, why: str) -> click.Command:
    @click.command(name=name, context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
    def missing() -> None:
        raise click.ClickException(f"`{path}` is unavailable here: {why}")

    return missing


@click.group(cls=LazyGroup, verbs=VERBS)
@click.version_option(__version__, prog_name="moewatch")
def main() -> None:
    """moewatch: observe, diagnose and tune Mixture-of-Experts inference with expert parallelism."""


if __name__ == "__main__":
    main()
