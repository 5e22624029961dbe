"""`moewatch bench render`: the benchmark tables in docs/benchmarks/*.md and the README's benchmark
figures, rendered from the result files in docs/benchmarks/results/ (never typed by hand).

A slot in a page is the text between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->`; NAME picks the
renderer (SLOTS). Every row names its run: the commit, the start time, and the other processes' CPU
while it ran, with busy runs marked busy. Numbers inside backticks are commands and commits, not
figures; every other number in a slot comes from a result file (tests/tools/bench/test_render.py holds
the docs to that).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

import click

from .record import REPO_ROOT, RESULTS_SUBDIR

SLOT = re.compile(r"(<!-- bench:(?P<name>[a-z0-9-]+) -->\n)(?P<body>.*?)(<!-- /bench:(?P=name) -->)", re.S)
def pages(root: Path) -> list[str]:
    """The README and every benchmark page: a new page's slots are rendered and checked without a list."""
    return ["README.md", *sorted(str(p.relative_to(root)) for p in (root / "docs" / "benchmarks").glob("*.md"))]
ROWS_PER_TABLE = 6  # the newest runs of a bench
EPLB_PORT = "this project's numpy port of DeepSeek's EPLB (`tools/eplb_reference.py`)"


def load_results(folder: Path) -> list[dict[str, Any]]:
    """Every result file in `folder`, oldest run first; each record gains its file name as `file`."""
    records = []
    for path in sorted(folder.glob("*.json")):
        record = json.loads(path.read_text())
        record["file"] = path.name
        records.append(record)
    return sorted(records, key=lambda r: (r["provenance"]["started_utc"], r["file"]))


def _of(records: list[dict[str, Any]], bench: str) -> list[dict[str, Any]]:
    return [r for r in records if r["bench"] == bench][-ROWS_PER_TABLE:]


def fmt(value: Any, digits: int = 3) -> str:
    """A recorded number as a table shows it (None: n/a)."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 10 ** digits else f"{value:.0f}"
    return str(value)


def machine_state(prov: dict[str, Any]) -> str:
    """How loaded the machine was: `busy` when other processes held a tenth of a core or more."""
    others = prov.get("other_cpu_cores")
    shown = "unknown" if others is None else f"{fmt(others)} cores"
    return f"**busy** (others {shown})" if prov.get("busy", True) else f"others {shown}"


def _run_cells(record: dict[str, Any]) -> list[str]:
    prov = record["provenance"]
    return [f"`{prov['command']}`", f"`{prov['commit'][:12]}`", f"`{prov['started_utc']}`", machine_state(prov)]


RUN_HEADER = ["command", "commit", "started (UTC)", "machine during the run"]


def _table(records: list[dict[str, Any]], columns: list[tuple[str, Callable[[dict[str, Any]], Any]]],
           bench: str, hint: str) -> str:
    if not records:
        return (f"_No recorded `bench {bench}` result yet: run `{hint}`, then `moewatch bench render`._\n")
    header = RUN_HEADER + [name for name, _ in columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for record in records:
        result = record["result"]
        lines.append("| " + " | ".join(_run_cells(record) + [fmt(get(result)) for _, get in columns]) + " |")
    lines.append("")
    files = ", ".join(f"`{r['file']}`" for r in records)
    lines.append(f"From {files} in {RESULTS_SUBDIR}/.")
    return "\n".join(lines) + "\n"


def _key(name: str) -> Callable[[dict[str, Any]], Any]:
    return lambda result: result.get(name)


def render_agent(records: list[dict[str, Any]]) -> str:
    cols = [(k, _key(k)) for k in ("cpu_per_window_s", "cpu_share", "rss_mb", "scrape_ms_p50", "scrape_ms_p90",
                                   "scrape_ms_p99", "triage_ms", "triage_cpu_ms", "windows_lagging",
                                   "lag_max_windows")]
    cols.insert(0, ("rate (windows/s)", lambda r: (r.get("config") or {}).get("rate")))
    table = _table(_of(records, "agent"), cols, "agent", "moewatch bench agent --json")
    phased = [r for r in _of(records, "agent") if r["result"].get("phase_cpu_ms")]
    if not phased:
        return table
    phases = list(phased[-1]["result"]["phase_cpu_ms"])
    # CPU ms per window by phase, in the bench process on the same windows (where the time goes).
    return table + "\nCPU ms per window, by phase (in-process, full evidence):\n\n" + _table(
        phased, [(p, lambda r, p=p: r["phase_cpu_ms"].get(p)) for p in phases], "agent",
        "moewatch bench agent --json")


def render_probe(records: list[dict[str, Any]]) -> str:
    cols = [(k, _key(k)) for k in ("overhead_ratio", "overhead_ratio_of_means", "self_time_ratio",
                                   "step_mean_s_probe_on", "step_mean_s_probe_off", "steps_measured")]
    return _table(_of(records, "probe"), cols, "probe", "moewatch bench probe --json")


def render_vllm(records: list[dict[str, Any]]) -> str:
    cols = [(k, _key(k)) for k in ("mode", "overhead_ratio", "overhead_ratio_cpu_time", "tokens_per_second_inactive",
                                   "tokens_per_second_active", "plugin_seconds_per_step", "rounds")]
    return _table(_of(records, "vllm"), cols, "vllm", "moewatch bench vllm --json")


def _loop_value(result: dict[str, Any], key: str) -> Any:
    return result.get(f"{key}_median", result.get(key))


def _slow_rank(result: dict[str, Any]) -> dict[str, Any] | None:
    """The slow-rank setup of a `bench loop --slow-rank` result (None: the hot-expert loop)."""
    return result.get("speed_aware_optimum")


def render_loop(records: list[dict[str, Any]]) -> str:
    def workload(r: dict[str, Any]) -> str:
        slow = _slow_rank(r)
        return "hot experts" if slow is None else f"rank {slow['slow_rank']} at {fmt(slow['slow_factor'])}x"

    def time_balancedness(r: dict[str, Any]) -> str:
        runs = r.get("runs", [r])
        before = [x["time_balancedness_before"] for x in runs if x.get("time_balancedness_before") is not None]
        after = [x["time_balancedness_after"] for x in runs if x.get("time_balancedness_after") is not None]
        if not before or not after:
            return "n/a"

        def span(values: list[float]) -> str:  # each figure as a run recorded it
            return fmt(values[0]) if len(values) == 1 else f"{fmt(min(values))}-{fmt(max(values))}"

        return f"{span(before)} -> {span(after)}"

    cols = [("workload", workload), ("runs", lambda r: r.get("repeat", 1)),
            ("step p50 ratio (median)", lambda r: _loop_value(r, "step_p50_ratio")),
            ("windows to fix (median)", lambda r: _loop_value(r, "windows_to_fix")),
            ("step p50 ratio (worst run)", lambda r: r.get("step_p50_ratio_max", r.get("step_p50_ratio"))),
            ("balancedness by time, before -> after (runs)", time_balancedness),
            ("false rollbacks", _key("false_rollbacks")), ("pairs lost", _key("pairs_lost"))]
    return _table(_of(records, "loop"), cols, "loop", "moewatch bench loop --json --repeat 20")


def render_planner(records: list[dict[str, Any]]) -> str:
    mine = _of(records, "planner")
    if not mine:
        return _table([], [], "planner", "moewatch bench planner --json")
    from .planner import render_markdown

    latest = mine[-1]
    prov = latest["provenance"]
    return (f"Run: `{prov['command']}` at `{prov['commit'][:12]}`, `{prov['started_utc']}`, "
            f"machine during the run: {machine_state(prov)}; from `{latest['file']}` in {RESULTS_SUBDIR}/. "
            f"EPLB here is {EPLB_PORT} at that commit.\n\n"
            + render_markdown(latest["result"], prov["command"], heading=False) + "\n")


def render_readme_loop(records: list[dict[str, Any]]) -> str:
    # The README's line is the hot-expert loop; a slow-rank run is on the loop page.
    repeated = [r for r in _of(records, "loop") if r["result"].get("repeat", 1) > 1 and _slow_rank(r["result"]) is None]
    if not repeated:
        return "_No recorded repeated `bench loop` run yet: run `moewatch bench loop --json --repeat 20`._\n"
    record = repeated[-1]
    r = record["result"]
    ratios = [run["step_p50_ratio"] for run in r["runs"] if run["step_p50_ratio"] is not None]
    span = f"{fmt(min(ratios))}-{fmt(max(ratios))} " if ratios else ""
    return (f"`{record['provenance']['command']}` (`{record['file']}`, machine during the run: "
            f"{machine_state(record['provenance'])}): step p50 ratio {span}(median "
            f"{fmt(r['step_p50_ratio_median'])}), {r['false_rollbacks']} false rollbacks in {r['repeat']} runs, "
            f"{r['pairs_lost']} pairs lost.\n")


def render_readme_demo(records: list[dict[str, Any]]) -> str:
    mine = _of(records, "demo")
    if not mine:
        return "_No recorded demo yet: run `moewatch demo --record`, then `moewatch bench render`._\n"
    from moewatch.tools.demo import summary_lines

    record = mine[-1]
    prov = record["provenance"]
    # The temporary folder's paths say nothing to a reader.
    lines = [line for line in summary_lines(record["result"]) if not line.startswith(("  audit log", "  metrics"))]
    return (f"`{prov['command']}` at `{prov['commit'][:12]}`, `{prov['started_utc']}`, {prov['cores']} cores, "
            f"machine during the run: {machine_state(prov)} (`{record['file']}`):\n\n```\n" + "\n".join(lines)
            + "\n```\n")


def _load_averages(prov: dict[str, Any]) -> str:
    if "load_average_before" not in prov or "load_average_after" not in prov:
        return ""
    return (f", load average {fmt(prov['load_average_before'][0])} before and "
            f"{fmt(prov['load_average_after'][0])} after")


def render_eplb(records: list[dict[str, Any]]) -> str:
    """The latest `bench eplb` run: per load and policy, the lowest balancedness after a rebalance, the
    slots moved (in all, and at the first rebalance), the slots moved over the LP bound on the
    rebalances bounded, the median call time, the longest and 99th-percentile wait of a Python thread
    stepping every 1 ms beside the calls, and the most layers the gate kept in one rebalance; the
    integer programs of the sampled layers; then the goals. Every figure is one the result file holds."""
    mine = _of(records, "eplb")
    if not mine:
        return _table([], [], "eplb", "moewatch bench eplb --json")
    latest = mine[-1]
    prov, result = latest["provenance"], latest["result"]
    shape = result["shape"]
    lines = [f"Run: `{prov['command']}` at `{prov['commit'][:12]}`, `{prov['started_utc']}`, machine during the "
             f"run: {machine_state(prov)}{_load_averages(prov)}; from `{latest['file']}` in {RESULTS_SUBDIR}/.", "",
             f"Shape: {shape['layers']} layers x {shape['experts']} experts, {shape['slots']} slots, "
             f"{shape['ranks']} GPUs, {shape['nodes']} nodes.", ""]
    has_bound = any(f.get("bound") for policies in result["results"].values() for f in policies.values())
    has_pause = any(f.get("pause") for policies in result["results"].values() for f in policies.values())
    header = ["load", "policy", "balancedness after (lowest)", "slots moved (in all; first rebalance)"]
    if has_bound:
        header += ["rebalances bounded", "slots moved on them / LP bound", "moved over LP bound", "slack bound",
                   "moved over slack bound"]
    header += ["median call (s)"]
    if has_pause:
        header += ["longest pause (ms)", "p99 pause (ms)"]
    header += ["most layers kept by the gate"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for load, policies in result["results"].items():
        for policy, f in policies.items():
            kept = f.get("layers_kept_by_gate") or [0]
            cells = [load, policy, fmt(min(f["balancedness_after"])),
                     f"{fmt(f['experts_moved_total'])}; {fmt(f['experts_moved'][0])}"]
            bound = f.get("bound")
            if has_bound:
                cells += ["n/a"] * 5 if not bound else [
                    ", ".join(fmt(t) for t in bound["rebalances"]),
                    f"{fmt(bound['slots_moved'])} / {fmt(bound['lp_bound'])}", fmt(bound["moved_over_lp_bound"]),
                    fmt(bound.get("slack_bound")), fmt(bound.get("moved_over_slack_bound"))]
            cells.append(fmt(f["solve_seconds_median"]))
            pause = f.get("pause")
            if has_pause:
                cells += ["n/a", "n/a"] if not pause else [
                    fmt(None if pause["pause_max_seconds"] is None else pause["pause_max_seconds"] * 1e3),
                    fmt(None if pause["pause_p99_seconds"] is None else pause["pause_p99_seconds"] * 1e3)]
            cells.append(fmt(max(kept)))
            lines.append("| " + " | ".join(cells) + " |")
    samples = [(load, policy, o) for load, policies in result["results"].items() for policy, f in policies.items()
               for o in (f.get("bound") or {}).get("integer_program", [])]
    if samples:
        lines += ["", f"The integer program on sampled layers of each load's first rebalance (time limit "
                      f"{fmt(shape['optimum_seconds'])} s each; its bound is the LP's, or HiGHS's own when it "
                      f"stopped at the limit with a better one; the whole reference took "
                      f"{fmt(result['bound_seconds'])} s):", "",
                  "| load | policy | layer | status | slots rewritten (best found) | no placement rewrites fewer than |"
                  " LP bound | the policy's slots moved | seconds |", "|---|---|---|---|---|---|---|---|---|"]
        for load, policy, o in samples:
            lines.append(f"| {load} | {policy} | {fmt(o['layer'])} | {o['status']} | "
                         f"{fmt(o['slots_rewritten'])} | {fmt(o['slots_rewritten_bound'])} | {fmt(o['lp_bound'])} | "
                         f"{fmt(o['slots_moved'])} | {fmt(o['seconds'])} |")
    lines += ["", "Goals: " + ", ".join(f"{k} **{'pass' if v else 'fail'}**" for k, v in result["goals"].items())
              + "."]
    return "\n".join(lines) + "\n"


A2A_ARMS = ("contiguous+none", "contiguous+aurora", "affinity+none", "affinity+aurora")
A2A_COLOURS = ("#9e9e9e", "#616161", "#64b5f6", "#1565c0")


def render_a2a(records: list[dict[str, Any]]) -> str:
    """The latest `bench a2a` run: per traffic and arm, all-to-all time per step, its bound, time over
    bound (whole step, and the worst layer), step time; the links' measured rates; the goals with
    their margins. The picture (a2a.svg) is drawn from the same run."""
    mine = _of(records, "a2a")
    if not mine:
        return _table([], [], "a2a", "moewatch bench a2a --json")
    latest = mine[-1]
    prov, result = latest["provenance"], latest["result"]
    links = result["links"]
    rates = ", ".join(fmt(v * 8 / 1e6) for v in links["link_bytes_per_second"])
    lines = [f"Run: `{prov['command']}` at `{prov['commit'][:12]}`, `{prov['started_utc']}`, machine during the "
             f"run: {machine_state(prov)}; from `{latest['file']}` in {RESULTS_SUBDIR}/.", "",
             f"Links: {fmt(result['link_rate_mbit'])} Mbit/s asked, measured per rank {rates} Mbit/s. "
             f"Whole bench: {fmt(result['wall_seconds'])} s.", "",
             "![all-to-all time per step by traffic and arm, with its bound](a2a.svg)", "",
             "| traffic | arm | all-to-all per step (ms) | bound (ms) | over bound | worst layer over bound | "
             "step (ms) |", "|---|---|---|---|---|---|---|"]
    for kind, traffic in result["traffics"].items():
        for arm in A2A_ARMS:
            a = traffic["arms"][arm]
            lines.append(f"| {kind} | {arm} | {fmt(a['a2a_seconds_per_step'] * 1e3)} | "
                         f"{fmt(a['bound_seconds_per_step'] * 1e3)} | {fmt(a['over_bound'])} | "
                         f"{fmt(max(a['over_bound_per_layer']))} | {fmt(a['step_mean_s'] * 1e3)} |")
    lines += ["", "| traffic | affinity + aurora over contiguous + none | aurora over none (contiguous) | "
              "aurora over none (affinity) | bound cut by the affinity placement | outputs identical across "
              "schedules | across placements (max abs diff) |", "|---|---|---|---|---|---|---|"]
    for kind, t in result["traffics"].items():
        lines.append(f"| {kind} | {fmt(t['speedup_affinity_aurora_over_contiguous_none'])}x | "
                     f"{fmt(t['speedup_aurora_over_none_contiguous'])}x | {fmt(t['speedup_aurora_over_none_affinity'])}x | "
                     f"{fmt(t['bound_cut_affinity_over_contiguous'])} | {fmt(t['outputs_identical_across_schedules'])} | "
                     f"{fmt(t['outputs_identical_across_placements'])} "
                     f"({fmt(t['arms']['affinity+none']['max_abs_diff_vs_contiguous_none'])}) |")
    m = result["margins"]
    lines += ["", "Goals: " + ", ".join(f"{k} **{'pass' if v else 'fail'}**" for k, v in result["goals"].items())
              + f". Margins: aurora's worst layer {fmt(m['aurora_worst_layer_over_bound'])}x its bound (goal "
              f"{fmt(m['goal_over_bound'])}x); affinity + aurora {fmt(m['affinity_speedup'])}x faster than contiguous + "
              f"none on the affinity traffic (goal {fmt(m['goal_speedup'])}x); {fmt(m['wall_seconds'])} s (goal "
              f"{fmt(m['goal_seconds'])} s)."]
    return "\n".join(lines) + "\n"


def figure_a2a(records: list[dict[str, Any]]) -> str | None:
    """docs/benchmarks/a2a.svg: all-to-all ms per step, a bar per arm in each traffic, a tick at each
    arm's bound; from the latest `bench a2a` run (None: no run yet)."""
    mine = _of(records, "a2a")
    if not mine:
        return None
    result = mine[-1]["result"]
    traffics = list(result["traffics"])
    values = [[result["traffics"][k]["arms"][a] for a in A2A_ARMS] for k in traffics]
    top = max(max(a["a2a_seconds_per_step"], a["bound_seconds_per_step"]) for row in values for a in row) * 1e3
    width, height, left, bottom, plot_h = 640, 300, 60, 250, 210
    group_w = (width - left - 20) / len(traffics)
    bar_w = group_w / (len(A2A_ARMS) + 1.5)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           'font-size="11">', f'<line x1="{left}" y1="{bottom}" x2="{width - 10}" y2="{bottom}" stroke="#000"/>',
           f'<line x1="{left}" y1="{bottom}" x2="{left}" y2="{bottom - plot_h}" stroke="#000"/>',
           f'<text x="12" y="{bottom - plot_h / 2}" transform="rotate(-90 12 {bottom - plot_h / 2})" '
           'text-anchor="middle">all-to-all ms per step</text>']
    for tick in range(5):
        v = top * tick / 4
        y = bottom - plot_h * tick / 4
        out.append(f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end">{v:.0f}</text>')
    for g, kind in enumerate(traffics):
        x0 = left + g * group_w + bar_w * 0.75
        for i, arm in enumerate(values[g]):
            h = plot_h * arm["a2a_seconds_per_step"] * 1e3 / top
            x = x0 + i * bar_w
            out.append(f'<rect x="{x:.1f}" y="{bottom - h:.1f}" width="{bar_w * 0.9:.1f}" height="{h:.1f}" '
                       f'fill="{A2A_COLOURS[i]}"/>')
            yb = bottom - plot_h * arm["bound_seconds_per_step"] * 1e3 / top
            out.append(f'<line x1="{x:.1f}" y1="{yb:.1f}" x2="{x + bar_w * 0.9:.1f}" y2="{yb:.1f}" stroke="#d32f2f" '
                       'stroke-width="2"/>')
        out.append(f'<text x="{x0 + 2 * bar_w:.1f}" y="{bottom + 16}" text-anchor="middle">{kind}</text>')
    for i, arm in enumerate(A2A_ARMS):
        out.append(f'<rect x="{left + 10 + i * 135}" y="{height - 18}" width="10" height="10" fill="{A2A_COLOURS[i]}"/>')
        out.append(f'<text x="{left + 24 + i * 135}" y="{height - 9}">{arm}</text>')
    out.append(f'<text x="{width - 12}" y="16" text-anchor="end" fill="#d32f2f">red tick: the bound</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


# Pictures drawn from the results: path in the repository -> drawer (None: nothing to draw yet).
FIGURES: dict[str, Callable[[list[dict[str, Any]]], str | None]] = {
    "docs/benchmarks/a2a.svg": figure_a2a,
}


SLOTS: dict[str, Callable[[list[dict[str, Any]]], str]] = {
    "a2a": render_a2a,
    "eplb": render_eplb, "agent": render_agent, "probe": render_probe, "vllm": render_vllm, "loop": render_loop,
    "planner": render_planner, "readme-loop": render_readme_loop, "readme-demo": render_readme_demo,
}


def render_text(text: str, records: list[dict[str, Any]]) -> str:
    """`text` with every slot's body rendered afresh from `records`."""
    def fill(m: re.Match) -> str:
        name = m["name"]
        if name not in SLOTS:
            raise click.ClickException(f"unknown slot bench:{name} (known: {', '.join(sorted(SLOTS))})")
        return m.group(1) + SLOTS[name](records) + m.group(4)

    return SLOT.sub(fill, text)


def slots(text: str) -> list[tuple[str, str]]:
    """(name, body) of every slot in `text`."""
    return [(m["name"], m["body"]) for m in SLOT.finditer(text)]


def render_pages(root: Path, results: Path, check: bool = False) -> list[str]:
    """Render every page's slots; returns the pages that changed (with check, writes nothing)."""
    records = load_results(results) if results.is_dir() else []
    changed = []
    for page in pages(root):
        path = root / page
        text = path.read_text()
        new = render_text(text, records)
        if new != text:
            changed.append(page)
            if not check:
                path.write_text(new)
    for page, draw in FIGURES.items():
        drawn = draw(records)
        path = root / page
        if drawn is not None and (not path.exists() or path.read_text() != drawn):
            changed.append(page)
            if not check:
                path.write_text(drawn)
    return changed


@click.command("render")
@click.option("--results-dir", type=click.Path(file_okay=False), default=None,
              help=f"Result files [default: {RESULTS_SUBDIR} in the repository].")
@click.option("--check", is_flag=True, help="Write nothing; exit 1 when a page would change.")
def render(results_dir: str | None, check: bool) -> None:
    """Render docs/benchmarks/*.md's tables and the README's figures from the recorded results."""
    if not (REPO_ROOT / ".git").exists():
        raise click.ClickException(f"{REPO_ROOT} is not a checkout of the repository: render runs inside one")
    results = Path(results_dir) if results_dir else REPO_ROOT / RESULTS_SUBDIR
    changed = render_pages(REPO_ROOT, results, check=check)
    for page in changed:
        click.echo(f"{'would change' if check else 'rendered'} {page}")
    if check and changed:
        raise SystemExit(1)


NUMBER = re.compile(r"(?<![\w.])-?\d+(?:,\d{3})*(?:\.\d+)?(?:e[-+]?\d+)?")
CODE_SPAN = re.compile(r"`[^`\n]*`")
# As recorded; a percentage; milli-, microunits; bytes in MiB; bytes per second in Mbit/s (link rates).
SCALES = (1.0, 100.0, 1000.0, 1e6, 2.0 ** -20, 8e-6)


def _numbers(text: str) -> list[str]:
    return NUMBER.findall(CODE_SPAN.sub(" ", text))


def recorded_numbers(records: list[dict[str, Any]]) -> list[float]:
    """Every number a result file holds: its numeric values and the numbers inside its strings."""
    found: list[float] = []

    def walk(value: Any) -> None:
        if isinstance(value, bool):
            return
        if isinstance(value, (int, float)):
            found.append(float(value))
        elif isinstance(value, str):
            found.extend(float(n.replace(",", "")) for n in NUMBER.findall(value))
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    for record in records:
        walk(record)
    return found


def _shown_as(value: float, token: str) -> bool:
    """Whether `token` (as a table prints it) can be `value` rounded."""
    shown = float(token.replace(",", ""))
    if "e" in token:
        return abs(value - shown) <= 0.01 * abs(shown)
    decimals = len(token.split(".")[1]) if "." in token else 0
    return abs(value - shown) <= 0.5 * 10 ** -decimals + 1e-9


def figures_without_result(text: str, records: list[dict[str, Any]]) -> list[str]:
    """Numbers in `text`'s slots that no result file in `records` holds (commands and commits in
    backticks aside): a figure typed by hand, or one whose result file is gone."""
    values = recorded_numbers(records)
    missing = []
    for name, body in slots(text):
        for token in _numbers(body):
            if not any(_shown_as(v * scale, token.lstrip("-")) or _shown_as(v * scale, token)
                       for v in values for scale in SCALES):
                missing.append(f"bench:{name}: {token}")
    return missing
