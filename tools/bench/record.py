"""Every `moewatch bench ...` run leaves a result file with its provenance, so a published figure can be
traced to the run that measured it and to how loaded the machine was while it ran.

A bench command's callback returns its result (a JSON-able dict); `recorded` wraps the callback, samples
the machine before and after, and writes `<bench>-<UTC start>.json` into the results folder
(docs/benchmarks/results/ inside the repository). Other processes' CPU during the run is the machine's
busy CPU time (/proc/stat) less this process tree's own (this process and the children it waited for):
a run during which other processes held `BUSY_OTHER_CORES` of a core or more is marked busy, and the
rendered tables say so.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import click

from moewatch.numpy_json import numpy_default
# The machine's load is measured where `moewatch replay` measures it too (the product never imports tools/).
from moewatch.machine_load import MachineSample, load_between, sample

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS_SUBDIR = Path("docs") / "benchmarks" / "results"
RESULT_SCHEMA = "moewatch-bench-result/1"


def git_commit(root: Path = REPO_ROOT) -> str:
    """The checked-out commit ("unknown" outside a git checkout), with "-dirty" for uncommitted changes
    to tracked files."""
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10)
        if commit.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return commit.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def default_results_dir() -> Path | None:
    """docs/benchmarks/results/ of the repository this code runs from; None for an installed copy."""
    return REPO_ROOT / RESULTS_SUBDIR if (REPO_ROOT / ".git").exists() else None


def _utc(unix_time: float) -> str:
    return dt.datetime.fromtimestamp(unix_time, dt.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def provenance(command: str, before: MachineSample, after: MachineSample) -> dict[str, Any]:
    return {
        "commit": git_commit(),
        "command": command,
        "started_utc": _utc(before.unix_time),
        "ended_utc": _utc(after.unix_time),
        **load_between(before, after),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def write_result(results_dir: Path, bench: str, result: Any, prov: dict[str, Any]) -> Path:
    """Write one run's file; never overwrites an earlier run's (a suffix is added on a clash)."""
    results_dir.mkdir(parents=True, exist_ok=True)
    stamp = prov["started_utc"].replace("-", "").replace(":", "")
    record = {"schema": RESULT_SCHEMA, "bench": bench, "provenance": prov, "result": result}
    text = json.dumps(record, indent=1, allow_nan=False, default=numpy_default) + "\n"
    for n in range(1000):
        path = results_dir / (f"{bench}-{stamp}.json" if n == 0 else f"{bench}-{stamp}-{n}.json")
        try:
            with open(path, "x", encoding="utf-8") as fh:
                fh.write(text)
            return path
        except FileExistsError:
            continue
    raise click.ClickException(f"--results-dir: {results_dir}: no free name for {bench}-{stamp}")


def recorded(bench: str, command: click.Command, opt_in: bool = False) -> click.Command:
    """`command` with --results-dir and --no-record (`opt_in`: --record instead); its callback's returned
    result is written with the run's provenance. A run that exits early (bad input, a failure) returns
    nothing and writes nothing."""
    if getattr(command, "_moewatch_recorded", False):
        return command
    callback = command.callback

    @functools.wraps(callback)
    def run(*args, results_dir: str | None, no_record: bool = False, record: bool = True, **kwargs):
        ctx = click.get_current_context()
        group_path = ctx.parent.command_path if ctx.parent is not None else ctx.command_path
        # Under `moewatch bench` the group kept the arguments after it; elsewhere they are the process's own.
        typed = ctx.meta.get("moewatch.bench.args")
        line = shlex.join([*group_path.split(), *(sys.argv[1:] if typed is None else typed)])
        before = sample()
        result = callback(*args, **kwargs)
        after = sample()
        if result is None or no_record or not record:
            return result
        folder = Path(results_dir) if results_dir else default_results_dir()
        if folder is None:
            click.echo(f"{ctx.command_path}: not recorded (not inside the repository; pass --results-dir)", err=True)
            return result
        path = write_result(folder, bench, result, provenance(line, before, after))
        click.echo(f"{ctx.command_path}: result recorded in {path}", err=True)
        return result

    command.callback = run
    command.params += [
        click.Option(["--results-dir"], type=click.Path(file_okay=False), default=None,
                     help="Folder for this run's result file [default: docs/benchmarks/results in the repository]."),
        click.Option(["--record"], is_flag=True, help="Write a result file with this run's provenance.") if opt_in
        else click.Option(["--no-record"], is_flag=True, help="Do not write a result file."),
    ]
    command._moewatch_recorded = True
    return command
