"""The core's verbs: `moewatch diagnose` and `moewatch examples` (numpy only, no torch, no agent)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from .cli_contract import PROG, OneLineCommand, fail_input
from .shards import merge_sequence
from .telemetry import Window, WindowError
from .thresholds import ConfigError, thresholds_from_cli, thresholds_options
from .triage import VERDICTS, WindowDiagnosis, diagnose as triage_window
from .vocabulary import TERMINAL_COLOURS

# Verdict order for --fail-on and the table's colour.


def require_extra(module: str, extra: str, needed_by: str) -> None:
    """Exit 2 with one line naming the extra to install when `module` (an optional dependency) is absent."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError:
        fail_input(f"{needed_by} needs {module}, which this install lacks: pip install 'moewatch[{extra}]'")


def load_window(source: str) -> Window:
    """A Window from a JSON or binary window file; exits 2 with one line on any problem."""
    path = Path(source)
    if not path.exists():
        fail_input(f"{source}: no such file")
    if path.is_dir() or path.suffix.lower() == ".pt":
        return _load_sglang_dump(path)
    try:
        blob = path.read_bytes()
    except OSError as exc:
        fail_input(f"{source}: cannot read ({exc.strerror})")
    try:
        if blob[:4] == b"MWW1":
            return Window.from_bytes(blob)
        if not blob.strip():
            fail_input(f"{source}: empty file")
        return Window.from_json(blob)
    except WindowError as exc:
        fail_input(f"{source}: invalid window: {exc}")
    raise AssertionError("unreachable")


def _load_sglang_dump(path: Path) -> Window:
    """SGLang's expert-distribution dump: a stat .pt, or a folder of dumps (its newest set)."""
    from .integrations.base import SourceError
    from .integrations.sglang.dump import load_source

    try:
        return load_source(path)
    except SourceError as exc:
        fail_input(f"invalid SGLang dump: {exc}")
    raise AssertionError("unreachable")


def _cell(value, spec: str) -> str:
    """A metric for the table; `?` when the window did not carry its evidence."""
    return "?" if value is None else format(value, spec)


def _gain(action) -> str:
    return "gain unknown" if action.predicted_gain is None else f"-{action.predicted_gain:.0%}"


def format_table(diagnosis: WindowDiagnosis, colour: bool) -> str:
    rows = []
    header = ("layer", "verdict", "cause", "ovfl", "a2a/wait", "rank max/mean", "expert cv", "cross/pred",
              "balanced", "missing", "first action")
    for d in diagnosis.worst_first():
        m = d.metrics
        first = d.actions[0] if d.actions else None
        ovfl = "?" if m["overflow_rate"] is None else (f"{m['overflow_rate']:.1%}" if d.overflow else "-")
        rows.append((
            str(d.layer), d.verdict, d.cause or ("?" if d.verdict != "healthy" else "-"), ovfl,
            f"{_cell(m['a2a_share'], '.0%')}/{_cell(m['a2a_wait_share'], '.0%')}", _cell(m["rank_load_max_mean"], ".2f"), _cell(m["expert_load_cv"], ".2f"),
            f"{_cell(m['cross_rank_ratio'], '.0%')}/{_cell(m['expected_cross_rank_ratio'], '.0%')}",
            _cell(m["balancedness"], ".3f"), ",".join(d.missing) or "-",
            f"{first.kind} ({_gain(first)}): {first.summary}" if first else "-"))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)) + "  " + header[-1]]
    for row in rows:
        cells = [c.ljust(w) for c, w in zip(row, widths)]
        if colour:
            cells[1] = click.style(cells[1], fg=TERMINAL_COLOURS[row[1]])
        lines.append("  ".join(cells) + "  " + row[-1])
    return "\n".join(lines)


def format_summary(diagnosis: WindowDiagnosis) -> str:
    s, ident = diagnosis.summary, diagnosis.identity
    counts = ", ".join(f"{n} {v}" for v, n in s["verdicts"].items())
    lines = [f"{ident['model']} / {ident['ep_group']} ({ident['runtime']}), epoch {ident['epoch']}: "
             f"{ident['num_layers']} layers, {ident['num_experts']} experts in {ident['num_slots']} slots "
             f"on {ident['world_size']} ranks, {ident['steps']} steps",
             f"verdicts: {counts}; mean balancedness "
             + ("unknown" if s["balancedness_mean"] is None else f"{s['balancedness_mean']:.3f}")]
    if s["missing"]:
        lines.append(f"evidence missing (those triage steps are unknown): {', '.join(s['missing'])}; "
                     f"absent fields: {', '.join(s['absent_fields'])}")
    slow = s["slowest_rank"]
    if slow["compute_share"] is not None:
        lines.append(f"slowest rank: {slow['rank']} ({slow['compute_share']:.0%} of expert compute time)")
    speed = s.get("rank_speed")
    if speed is not None and any(d.cause == "straggler" for d in diagnosis.layers):
        # A straggler is either too much load or a slow device: the speed per pair tells them apart.
        ranks = ", ".join(f"{r}: {rate:,.0f} pairs/s ({rel:.2f}x)" if rate is not None and rel is not None
                          else f"{r}: not measured" for r, (rate, rel)
                          in enumerate(zip(speed["pairs_per_second"], speed["relative"])))
        lines.append(f"rank speed (pairs per second of expert compute; x the median rank): {ranks}")
    if s["hot_experts_across_layers"]:
        hot = ", ".join(f"{h['expert']} in {h['layers']} layers" for h in s["hot_experts_across_layers"][:5])
        lines.append(f"experts hot across layers: {hot}")
    if s.get("a2a_step_share") is not None:
        lines.append(f"all-to-all: {s['a2a_step_share']:.0%} of step time (per step, all layers together)")
    lines += format_slo_section(s.get("slo"))
    if s["step_p99_seconds"] is not None:
        lines.append(f"step p50 {s['step_p50_seconds'] * 1e3:.2f} ms, p99 {s['step_p99_seconds'] * 1e3:.2f} ms")
    return "\n".join(lines)


def format_slo_section(slo: dict | None) -> list[str]:
    """The diagnosis' SLO section in words: the engine's p99s, each breached SLO with how long and its
    recommendation, and whether the MoE evidence explains it."""
    if not slo:
        return []
    q = slo["quantiles"]
    shown = ", ".join(f"{signal} p99 {qs['p99'] * 1e3:.1f} ms" for signal, qs in q.items() if qs.get("p99") is not None)
    lines = [f"SLO ({slo['engine']}): {shown or 'no latency observed'}"]
    if not slo["breached"]:
        lines.append("  SLOs met (TTFT p99 <= {:.0f} ms, TPOT p99 <= {:.0f} ms)".format(
            slo["targets"]["ttft_p99_seconds"] * 1e3, slo["targets"]["tpot_p99_seconds"] * 1e3))
    for b in slo["breached"]:
        lasting = "" if b["breached_for_seconds"] is None else f" for {b['breached_for_seconds']:.0f} s"
        lines.append(f"  {b['slo']} BREACHED{lasting}: {b['value_seconds'] * 1e3:.1f} ms over "
                     f"{b['target_seconds'] * 1e3:.0f} ms. {b['recommendation']}")
    if slo["moe"] is not None:
        lines.append(f"  {slo['moe']['text']}")
    return lines


def _with_nccl_a2a(window, path: str, communicator: str | None, calls_per_step: int | None):
    """The window with the all-to-all time NCCL Inspector measured (moewatch/integrations/nccl/)."""
    from pathlib import Path

    from .integrations.base import SourceError
    from .integrations.nccl import a2a, inspector

    try:
        if Path(path).is_dir():
            log = inspector.read_dump_dir(path)
            measured = a2a.match_records(log.collectives, window.num_layers, window.world_size, window.steps,
                                         communicator)
        else:
            means = inspector.prom_collective_means(Path(path).read_text(), where=path)
            measured = a2a.from_prom_means(means, calls_per_step or 2 * window.num_layers, window.steps,
                                           communicator)
        return a2a.attach(window, measured)
    except (SourceError, OSError) as exc:
        fail_input(f"--nccl-inspector: {exc}")


def _with_engine_slo(window, where: str):
    """The window stamped with the engine's SLO signals of one scrape (since the engine started)."""
    import time
    from pathlib import Path

    from .integrations.base import SourceError
    from .integrations.slo.scrape import _http_get, interval, parse_exposition
    from .slo import SLO_KEY, SloTargets

    try:
        text = _http_get(where, 5.0) if where.startswith(("http://", "https://")) else Path(where).read_text()
        signals = interval(None, parse_exposition(text, time.time(), where=where))
    except (SourceError, OSError) as exc:
        fail_input(f"--engine-metrics: {exc}")
    return window.replace(extra={**window.extra, SLO_KEY: {**signals, "targets": SloTargets().to_dict(),
                                                           "breached_since": {}}})


def _parse_fail_on(value: str | None) -> set[str]:
    if not value:
        return set()
    wanted = {v.strip() for v in value.split(",") if v.strip()}
    unknown = wanted - set(VERDICTS)
    if unknown:
        raise click.BadParameter(f"unknown verdict(s) {', '.join(sorted(unknown))}; choose from {', '.join(VERDICTS)}",
                                 param_hint="--fail-on")
    return wanted


def load_shards_or_window(sources: tuple[str, ...]) -> Window:
    """One whole window: a single source as it is, or the shards of one window (files an engine
    adapter wrote per DP rank, docs/telemetry.md "Shards") merged as the agent merges them, the shards
    not given named missing; a refused shard is said on stderr. Exits 2 on sources that are not
    shards of one window."""
    windows = [load_window(source) for source in sources]
    if len(windows) == 1 and windows[0].shard is None:
        return windows[0]
    for source, window in zip(sources, windows):
        if window.shard is None:
            fail_input(f"{source}: a whole window, not a shard: give one whole window, or shards of one window")
    first = windows[0]
    for source, window in zip(sources, windows):
        identity = (window.model, window.ep_group, window.shard.sequence)
        if identity != (first.model, first.ep_group, first.shard.sequence):
            fail_input(f"{source}: shard of {window.model}/{window.ep_group} sequence {window.shard.sequence}, not of "
                       f"{first.model}/{first.ep_group} sequence {first.shard.sequence}")
    indices = [w.shard.index for w in windows]
    if len(set(indices)) != len(indices):
        fail_input(f"shard {max(set(indices), key=indices.count)} given twice")
    try:
        merged, refused = merge_sequence(windows)
    except (WindowError, ValueError) as exc:
        fail_input(f"the shards do not merge into a valid window: {exc}")
    for window, reason in refused:
        click.echo(f"{PROG}: shard {window.shard.index} left out ({reason})", err=True)
    return merged


@click.command(cls=OneLineCommand)
@click.argument("sources", nargs=-1, required=True, metavar="SOURCE...")
@click.option("--json", "as_json", is_flag=True, help="Print only the diagnosis as JSON.")
@click.option("--fail-on", default=None, metavar="VERDICTS",
              help="Comma-separated verdicts; exit 1 when any layer has one (e.g. comm-bound,imbalance-bound).")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="YAML file of thresholds (a mapping, optionally under `thresholds:`).")
@click.option("--explain/--no-explain", default=False, help="Print each unhealthy layer's evidence in full.")
@click.option("--nccl-inspector", "nccl_inspector", default=None, metavar="PATH",
              help="NCCL Inspector output of the window's steps: a folder of JSON-lines *.log files, or a "
                   "Prometheus textfile (.prom); fills the all-to-all time (docs/telemetry.md).")
@click.option("--nccl-communicator", default=None, metavar="NAME",
              help="The EP group's communicator in the Inspector output (its id or comm_name).")
@click.option("--a2a-calls-per-step", type=int, default=None, metavar="N",
              help="All-to-alls one step issues, for the textfile form (default: 2 per MoE layer).")
@click.option("--engine-metrics", default=None, metavar="FILE|URL",
              help="The engine's /metrics (vLLM or SGLang; a saved scrape or its URL): the SLO section, "
                   "over everything since the engine started, judged by the default targets.")
@thresholds_options
def diagnose(sources: tuple[str, ...], as_json: bool, fail_on: str | None, config_path: str | None,
             explain: bool, nccl_inspector: str | None, nccl_communicator: str | None, a2a_calls_per_step: int | None,
             engine_metrics: str | None, **threshold_flags) -> None:
    """Triage SOURCE (a window file, JSON or binary; an SGLang expert-distribution dump .pt or a folder
    of per-rank dumps) layer by layer, in the documented order. Several SOURCEs: the shards of one
    window (one file per DP rank), merged as the agent merges them; shards not given are named missing."""
    verdicts_failing = _parse_fail_on(fail_on)
    try:
        thresholds = thresholds_from_cli(config_path, **threshold_flags)
    except ConfigError as exc:
        fail_input(str(exc))
    window = load_shards_or_window(sources)
    if nccl_inspector is not None:
        window = _with_nccl_a2a(window, nccl_inspector, nccl_communicator, a2a_calls_per_step)
    if engine_metrics is not None:
        window = _with_engine_slo(window, engine_metrics)
    result = triage_window(window, thresholds)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=1, allow_nan=False))
    else:
        colour = sys.stdout.isatty()
        click.echo(format_summary(result))
        click.echo()
        click.echo(format_table(result, colour))
        if explain:
            for d in result.worst_first():
                if d.verdict == "healthy" and not d.overflow and not d.missing:
                    continue
                click.echo(f"\nlayer {d.layer}: {d.verdict}" + (f" ({d.cause})" if d.cause else "")
                           + (f" [missing: {', '.join(d.missing)}]" if d.missing else ""))
                for line in d.evidence:
                    click.echo(f"  - {line}")
                for a in d.actions:
                    gain = ("gain unknown: rank-level evidence missing" if a.predicted_gain is None
                            else f"predicted -{a.predicted_gain:.0%} layer time")
                    click.echo(f"  -> {a.kind}: {a.summary} ({gain})")
    if verdicts_failing and any(d.verdict in verdicts_failing for d in result.layers):
        sys.exit(1)


@click.command(cls=OneLineCommand)
@click.argument("folder", default="examples")
@click.option("--seed", type=int, default=None, help="Random seed (default: the documented EXAMPLE_SEED).")
def examples(folder: str, seed: int | None) -> None:
    """Write one simulated window per verdict into FOLDER (default examples/)."""
    from moewatch.tools.examples import EXAMPLE_SEED, write_examples

    for path in write_examples(folder, EXAMPLE_SEED if seed is None else seed):
        click.echo(str(path))
