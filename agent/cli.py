"""The agent's verbs: `moewatch agent` (the daemon) and `moewatch top` (live per-layer view of a running agent)."""

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
