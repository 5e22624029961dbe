"""`moewatch ledger SOURCE...`: every rebalance of the recorded windows or of an agent's audit log, one
line each (or `--json`): what it stalled, what it gained per step, its net seconds, break-even, and
whether it paid (moewatch/ledger.py).

A SOURCE is an agent's audit log (a JSON-lines file: its "rebalance_ledger" lines, the entries the
agent settled), a folder of windows (an engine plugin's MOEWATCH_WINDOW_DIR), or window files. Windows
are fed to the ledger in time order per EP group, the shards of one window merged first, through the
same Ledger the agent runs; a rebalance whose `after` windows the recording ends before is printed
as open.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from .cli_contract import OneLineCommand, fail_input
from .commands import load_window
from .ledger import DEFAULT_WINDOWS, Ledger, add_window_of, format_entry
from .planner.files import window_files
from .shards import merge_recorded
from .telemetry import Window

AUDIT_EVENT = "rebalance_ledger"


def is_audit_log(path: Path) -> bool:
    """A JSON-lines file whose first line is an audit record (an object with `event`)."""
    try:
        with open(path, encoding="utf-8") as fh:
            first = fh.readline()
    except (OSError, UnicodeDecodeError):
        return False
    try:
        record = json.loads(first)
    except json.JSONDecodeError:
        return False
    return isinstance(record, dict) and "event" in record and "schema" not in record


def audit_entries(path: Path) -> list[dict[str, Any]]:
    """The ledger entries an audit log holds; exits 2 naming the line of a malformed one."""
    out = []
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                fail_input(f"{path}:{number}: not a JSON line ({exc.msg})")
            if not isinstance(record, dict):
                fail_input(f"{path}:{number}: not an audit record (a JSON object)")
            if record.get("event") == AUDIT_EVENT:
                entry = {k: v for k, v in record.items() if k not in ("event", "time")}
                entry["audited_at"] = record.get("time")
                out.append(entry)
    return out


def windows_in(path: Path) -> list[Path]:
    """A window file as it is; a folder's window files (a writer's temporary files left out)."""
    if path.is_dir():
        files = window_files(path)  # an unreadable file: an InputError, one line (OneLineCommand)
        if not files:
            fail_input(f"{path}: no window files (*.json) in this folder")
        return files
    return [path]


def whole_windows(windows: list[tuple[Path, Window]]) -> list[Window]:
    """Whole windows: each as it is, the shards of one sequence merged as the agent merges them."""
    try:
        return merge_recorded([w for _, w in windows])[0]
    except ValueError as exc:
        fail_input(str(exc))


def ledger_of_windows(windows: list[Window], per_window: int) -> list[dict[str, Any]]:
    """Every rebalance of the windows, per EP group in time order: settled entries, then the open ones."""
    groups: dict[tuple[str, str], list[Window]] = {}
    for w in windows:
        groups.setdefault((w.model, w.ep_group), []).append(w)
    out = []
    for (model, group), ws in sorted(groups.items()):
        ledger = Ledger(per_window)
        entries = []
        for w in sorted(ws, key=lambda w: (w.end_time, w.start_time)):
            entries += add_window_of(ledger, w)
        entries += ledger.finish()
        out += [{"model": model, "ep_group": group, **e} for e in entries]
    return out


@click.command(cls=OneLineCommand)
@click.argument("sources", nargs=-1, required=True, metavar="SOURCE...")
@click.option("--json", "as_json", is_flag=True, help="Print only the entries, as a JSON list.")
@click.option("--windows", "per_window", type=click.IntRange(min=1), default=DEFAULT_WINDOWS, show_default=True,
              help="Windows measured before and after each rebalance (recorded windows only).")
def ledger(sources: tuple[str, ...], as_json: bool, per_window: int) -> None:
    """Every rebalance in an agent's audit log or in recorded windows: stall, gain, net, break-even, paid or not."""
    entries: list[dict[str, Any]] = []
    windows: list[tuple[Path, Window]] = []
    for source in sources:
        path = Path(source)
        if not path.exists():
            fail_input(f"{source}: no such file or folder")
        if path.is_file() and is_audit_log(path):
            entries += audit_entries(path)
            continue
        windows += [(f, load_window(str(f))) for f in windows_in(path)]
    entries += ledger_of_windows(whole_windows(windows), per_window)
    if as_json:
        click.echo(json.dumps(entries, allow_nan=False))
        return
    if not entries:
        click.echo(f"no rebalance in {len(windows)} windows" if windows else "no rebalance_ledger entry in the audit log")
        return
    for entry in entries:
        click.echo(format_entry(entry))
