"""The agent's verbs: `moewatch agent` (the daemon), `moewatch demo` (runtime + agent wired together),
`moewatch top` (live per-layer view of a running agent)."""

from __future__ import annotations

import json
import logging
import sys

import click

from moewatch.cli_contract import OneLineCommand, fail_input
from moewatch.thresholds import ConfigError

from .config import build_config, config_options


@click.command(cls=OneLineCommand)
@click.option("--config", "config_path", default=None, metavar="FILE",
              help="YAML configuration: one mapping per section (server:, policy:, thresholds:, ...).")
@click.option("--print-config", is_flag=True, help="Print the resolved configuration as JSON and exit.")
@config_options
def agent(config_path: str | None, print_config: bool, **flags) -> None:
    """Run the sidecar agent: receive windows on a unix socket, triage, export, and (in act mode) act.

    Every setting comes from, lowest first: defaults, --config FILE, MOEWATCH_<SECTION>__<FIELD> variables,
    --<section>.<field> flags (--mode, --socket and --listen are short for --policy.mode, --server.socket
    and --server.listen).
    """
    try:
        cfg = build_config(config_path, flags=flags)
    except ConfigError as exc:
        fail_input(str(exc))
    if print_config:
        click.echo(json.dumps(cfg.to_dict(), indent=1))
        return
    logging.basicConfig(level=cfg.log.level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if cfg.log.level != "debug":  # APScheduler logs every run at INFO: twice a second is noise
        logging.getLogger("apscheduler").setLevel(logging.WARNING)
    from .daemon import Daemon, StartupError

    try:
        code = Daemon(cfg).run_forever()
    except StartupError as exc:
        # Startup problems an operator fixes (socket in use, port taken, unwritable paths): one line.
        fail_input(str(exc))
    sys.exit(code)


@click.command(cls=OneLineCommand)
@click.option("--seconds", type=click.FloatRange(5, 3600), default=45.0, show_default=True,
              help="How long the runtime serves (startup and the summary add about 15 s).")
@click.option("--json", "as_json", is_flag=True, help="Print only the summary object as JSON.")
@click.option("--ranks", type=click.IntRange(1, 8), default=None,
              help="EP ranks (default: one per GPU with NCCL, else one per core, 2 to 4, with gloo).")
@click.option("--keep", type=click.Path(file_okay=False), default=None,
              help="Folder for the socket, audit log and windows (default: a temporary folder).")
@click.option("--listen", default="127.0.0.1:0", show_default=True, help="HOST:PORT for the agent's /metrics.")
def demo(seconds: float, as_json: bool, ranks: int, keep: str | None, listen: str) -> None:
    """Run the reference runtime (a workload whose hot experts drift) and the agent in act mode,
    wired through a socket in a temporary folder; show live verdicts and actions, then a summary."""
    from .demo import DemoError, run_demo

    try:
        summary = run_demo(seconds=seconds, ranks=ranks, folder=keep, listen=listen, live=not as_json)
    except ConfigError as exc:
        fail_input(str(exc))
    except DemoError as exc:
        click.echo(f"moewatch: demo failed: {exc}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("moewatch: demo interrupted", err=True)
        sys.exit(130)
    if as_json:
        click.echo(json.dumps(summary, indent=1, allow_nan=False))


@click.command(cls=OneLineCommand)
@click.option("--url", default="http://127.0.0.1:9477", show_default=True, help="The agent's HTTP address.")
@click.option("--interval", type=click.FloatRange(0.2, 3600), default=2.0, show_default=True,
              help="Seconds between refreshes.")
@click.option("--once", is_flag=True, help="Print one view and exit.")
@click.option("--json", "as_json", is_flag=True, help="Print the agent's /status once, as JSON.")
def top(url: str, interval: float, once: bool, as_json: bool) -> None:
    """Live per-layer view of a running agent: verdicts, balancedness, plans in flight."""
    from .top import TopError, run_top

    try:
        run_top(url, interval, once or as_json, as_json)
    except TopError as exc:
        fail_input(str(exc))
