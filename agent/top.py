"""`moewatch top`: a running agent's per-layer view, refreshed in the terminal (reads /status)."""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import click

from moewatch.ledger import whose_policy
from moewatch.vocabulary import TERMINAL_COLOURS


class TopError(Exception):
    pass


def fetch_status(url: str, timeout: float = 5.0) -> dict[str, Any]:
    target = url.rstrip("/") + "/status"
    try:
        with urllib.request.urlopen(target, timeout=timeout) as resp:
            return json.loads(resp.read())
    except (urllib.error.URLError, OSError) as exc:
        raise TopError(f"{target}: cannot reach the agent ({getattr(exc, 'reason', exc)})") from None
    except json.JSONDecodeError:
        raise TopError(f"{target}: not a moewatch agent (the answer is not JSON)") from None


def render(status: dict[str, Any], colour: bool) -> str:
    agent = status.get("agent", {})
    lines = [f"moewatch agent {agent.get('version', '?')}, mode {agent.get('mode', '?')}; "
             f"frames rejected: {sum(agent.get('frames_rejected', {}).values()):.0f}"]
    if not status.get("groups"):
        lines.append("no runtime has connected yet")
    for g in status.get("groups", []):
        sizes = g.get("sizes") or {}
        ctl = g.get("control", {})
        lines.append("")
        lines.append(f"{g['model']}/{g['ep_group']}: {'connected' if g['connected'] else 'DISCONNECTED'}, "
                     f"epoch {g['epoch_in_force']}, {g['windows_accepted']} windows, "
                     f"{sizes.get('world_size', '?')} ranks x {sizes.get('num_slots', '?')} slots, "
                     f"{ctl.get('plans_applied', 0)} plans applied, {ctl.get('rollbacks', 0)} rolled back")
        for key, label in (("in_flight", "in flight"), ("verifying", "verifying")):
            if ctl.get(key):
                f = ctl[key]
                lines.append(f"  {label}: epoch {f['epoch']} layers {f['layers']} ({', '.join(f['kinds'])})")
        slo_line = format_slo((g.get("summary") or {}).get("slo"))
        if slo_line:
            lines.append(f"  {slo_line}")
        for line in format_engine_rebalance(g.get("engine_rebalance"), colour):
            lines.append(f"  {line}")
        ledger_line = format_ledger(g.get("ledger"), colour)
        if ledger_line:
            lines.append(f"  {ledger_line}")
        shards_line = format_shards(g.get("shards"), colour)
        if shards_line:
            lines.append(f"  {shards_line}")
        lines.append(f"  {'layer':>5}  {'verdict':<16} {'cause':<12} {'balanced':>8} {'a2a':>5} "
                     f"{'max/mean':>8} {'ms/step':>8}  hot experts")
        for row in g.get("layers", []):
            verdict = f"{row['verdict']:<16}"
            if colour:
                verdict = click.style(verdict, fg=TERMINAL_COLOURS.get(row["verdict"]))
            ms = row["layer_seconds_per_step"]
            lines.append(f"  {row['layer']:>5}  {verdict} {row['cause'] or '-':<12} {_num(row['balancedness'], '>8.3f')} "
                         f"{_num(row['a2a_share'], '>5.0%')} {_num(row['rank_load_max_mean'], '>8.2f')} "
                         f"{_num(None if ms is None else ms * 1e3, '>8.2f')}  "
                         + ("?" if row["hot_experts"] is None else ",".join(map(str, row["hot_experts"][:6])) or "-"))
        for entry in ctl.get("recent", [])[-5:]:
            if entry.get("event") == "decision" and entry.get("result") == "skipped":
                continue
            lines.append(f"  {_clock(entry['time'])} {entry['event']}: "
                         f"{entry.get('reason', '')[:110]}")
    return "\n".join(lines)


def _clock(epoch_seconds: float | None) -> str:
    """A time of day as the view shows it (local time), `?` when unknown."""
    return "?" if epoch_seconds is None else time.strftime("%H:%M:%S", time.localtime(epoch_seconds))


def format_engine_rebalance(status: dict[str, Any] | None, colour: bool) -> list[str]:
    """The engine's own rebalances, by moewatch's policy inside or its own (the agent's status.engine_rebalance):
    what the latest call did, and how the next window judged it; no lines when there were none."""
    if not status:
        return []
    calls = status.get("calls", 0)
    own = status.get("engine_own", 0)
    whose = "moewatch's policy" if not own else "its own policy" if own == calls else "moewatch's and its own policy"
    head = (f"engine rebalance ({status.get('engine', '?')}, {whose}): {calls} call{'' if calls == 1 else 's'}, "
            f"{status.get('fallbacks', 0)} answered by the engine's own after an error")
    last = status.get("last")
    if last and last.get("policy") == "engine_own":
        head += (f"; latest {_clock(last.get('window_end'))} by its own policy: {_num(last.get('layers_moved'), '.0f')} "
                 f"layers changed, {_num(last.get('experts_moved'), '.0f')} slots, balancedness "
                 f"{_num(last.get('balancedness_before'), '.3f')} -> {_num(last.get('balancedness_after'), '.3f')} "
                 f"on the load it rebalanced")
    elif last:
        kept = ", ".join(f"{k} {v:.0f}" for k, v in sorted(last.get("layer_outcomes", {}).items())
                         if k.startswith("kept") and v)
        head += (f"; latest {_clock(last.get('window_end'))}: {_num(last.get('layers_moved'), '.0f')} layers moved, "
                 f"{_num(last.get('layers_kept'), '.0f')} kept{f' ({kept})' if kept else ''}, "
                 f"{_num(last.get('experts_moved'), '.0f')} slots, balancedness "
                 f"{_num(last.get('balancedness_before'), '.3f')} -> {_num(last.get('balancedness_after'), '.3f')} "
                 f"predicted, stall {_num(last.get('predicted_stall_seconds'), '.2f')} s, call "
                 f"{_num(None if last.get('solve_seconds') is None else last['solve_seconds'] * 1e3, '.1f')} ms")
    lines = [head]
    check = status.get("last_check")
    if check:
        worse = check.get("verdict") == "worse"
        verdict = (f"WORSE on layers {', '.join(map(str, check.get('layers_worse', [])))}" if worse else "not worse")
        if colour and worse:
            verdict = click.style(verdict, fg="red")
        lines.append(f"checked on the next window ({status.get('checks', 0)} so far, {status.get('worse', 0)} worse): "
                     f"latest {_clock(check.get('window_end'))} {verdict}")
    failed = status.get("last_fallback")
    if failed:
        lines.append(f"latest fallback {_clock(failed.get('window_end'))}: {failed.get('error', '')[:100]}")
    return lines


def format_ledger(status: dict[str, Any] | None, colour: bool) -> str:
    """The group's rebalance ledger (the agent's status.ledger): the latest settled rebalance, whose it
    was, whether it paid and its net, with the counts so far; empty before the first."""
    if not status or not status.get("last"):
        return ""
    last = status["last"]
    even = last.get("break_even_steps")
    outcome = {"paid": "paid", "did_not_pay": "DID NOT PAY", "unknown": "unknown"}.get(last.get("outcome"), "?")
    if colour and last.get("outcome") == "did_not_pay":
        outcome = click.style(outcome, fg="red")
    net = last.get("net_seconds")
    whose = whose_policy(last)
    return (f"ledger: last rebalance {_clock(last.get('rebalanced_at'))} by {whose}: {outcome}, net "
            f"{'?' if net is None else format(net, '+.3f')} s over {_num(last.get('horizon_steps'), '.0f')} steps "
            f"(stall {_num(last.get('stall_seconds'), '.3f')} s, gain "
            f"{_num(None if last.get('gain_seconds_per_step') is None else last['gain_seconds_per_step'] * 1e3, '.3f')}"
            f" ms/step, break-even {'never' if even is None and last.get('gain_seconds_per_step') is not None else _num(even, '.0f')}"
            f" steps); {status.get('entries', 0)} settled, {status.get('paid', 0)} paid, "
            f"{status.get('did_not_pay', 0)} did not")


def format_shards(status: dict[str, Any] | None, colour: bool) -> str:
    """A sharded group's merge (the agent's status.shards): windows merged, shards missing or refused,
    and what the latest sequence lacked; empty for a group that sends whole windows."""
    if not status:
        return ""
    windows = status.get("windows", {})
    refused = ", ".join(f"{reason} {n}" for reason, n in sorted(status.get("shards_refused", {}).items()) if n)
    line = (f"shards: {windows.get('complete', 0)} windows complete, {windows.get('partial', 0)} partial, "
            f"{status.get('shards_missing', 0)} shards missing" + (f", refused: {refused}" if refused else ""))
    latest = status.get("latest")
    if latest:
        lacking = latest.get("missing", []) + [r["index"] for r in latest.get("refused", [])]
        tail = (f"; latest sequence {latest['sequence']}: {len(latest.get('received', []))} of {latest['count']}"
                + (f", lacking {', '.join(map(str, sorted(lacking)))}" if lacking else ""))
        line += click.style(tail, fg="red") if colour and lacking else tail
    return line


def format_slo(slo: dict[str, Any] | None) -> str:
    """One line of the engine's SLO signals beside the MoE verdicts: p99s, requests, breaches and
    whether the MoE evidence explains them; empty when the group has none."""
    if not slo:
        return ""
    quantiles = slo.get("quantiles") or {}

    def p99(signal: str) -> str:
        value = (quantiles.get(signal) or {}).get("p99")
        return "?" if value is None else f"{value * 1e3:.1f} ms"

    gauges = slo.get("gauges") or {}
    text = (f"SLO ({slo.get('engine')}): TTFT p99 {p99('ttft')}, ITL p99 {p99('itl')}, TPOT p99 {p99('tpot')}; "
            f"running {_num(gauges.get('running'), '.0f')}, waiting {_num(gauges.get('waiting'), '.0f')}")
    breached = slo.get("breached") or []
    if not breached:
        return text + "; SLOs met"
    moe = slo.get("moe") or {}
    verdict = {True: "MoE explains it", False: "cause elsewhere", None: "MoE share unknown"}[moe.get("explains")]
    return text + f"; BREACHED: {', '.join(b['slo'] for b in breached)} ({verdict})"


def _num(value, spec: str) -> str:
    """A number in its column, or `?` there when the window did not measure it (absent evidence)."""
    width = int("".join(c for c in spec.split(".")[0] if c.isdigit()) or 0)
    return format(value, spec) if value is not None else "?".rjust(width)


def run_top(url: str, interval: float, once: bool, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(fetch_status(url), indent=1))
        return
    colour = sys.stdout.isatty()
    while True:
        text = render(fetch_status(url), colour)
        if not once and colour:
            click.echo("\x1b[2J\x1b[H", nl=False)
        click.echo(text)
        if once:
            return
        try:
            time.sleep(interval)
        except KeyboardInterrupt:
            return
