"""The replay's picture, drawn as SVG text (no plotting dependency): net seconds per hour (top) and
balancedness (bottom) against the rebalance interval, one line per rebalancing policy; "off" and
"static" (no interval) as dashed horizontal lines. Intervals are spaced evenly in the order of their
steps, labelled with their steps."""

from __future__ import annotations

import math
from html import escape
from typing import Any

COLOURS = {"off": "#616161", "static": "#2e7d32", "vllm_default": "#1565c0", "sglang_deepseek": "#ef6c00",
           "moewatch": "#c62828"}
WIDTH, PANEL_H, LEFT, RIGHT, TOP = 680, 190, 70, 150, 30


def picture(result: dict[str, Any]) -> str:
    """The SVG text of a replay result (replay.replay's output with its intervals)."""
    intervals = sorted(result["intervals"], key=lambda i: i["steps"])
    panels = [("net seconds per hour of serving", "net_seconds_per_hour"), ("balancedness (mean / max GPU load)",
                                                                             "balancedness")]
    height = TOP + len(panels) * (PANEL_H + 50) + 10
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" font-family="sans-serif" '
           'font-size="11">']
    for p, (title, key) in enumerate(panels):
        top = TOP + p * (PANEL_H + 50)
        out += _panel(result, intervals, key, title, top)
    legend_y = TOP
    for policy in result["policies"]:
        dash = ' stroke-dasharray="5 3"' if policy in ("off", "static") else ""
        out.append(f'<line x1="{WIDTH - RIGHT + 15}" y1="{legend_y}" x2="{WIDTH - RIGHT + 35}" y2="{legend_y}" '
                   f'stroke="{COLOURS.get(policy, "#000")}" stroke-width="2"{dash}/>')
        out.append(f'<text x="{WIDTH - RIGHT + 40}" y="{legend_y + 4}">{escape(policy)}</text>')
        legend_y += 16
    out.append("</svg>")
    return "\n".join(out) + "\n"


def round_ticks(lo: float, hi: float, most: int = 6) -> list[float]:
    """Values for an axis from lo to hi (lo < hi) at a round step (1, 2 or 5 times a power of ten), at most
    `most` of them, so a reader reads 0 and the figures between at a glance."""
    span = hi - lo
    power = 10.0 ** math.floor(math.log10(span / most))
    step = next(power * f for f in (1, 2, 5, 10) if span / (power * f) <= most)
    first = math.ceil(lo / step)
    return [round(k * step, 12) for k in range(first, math.floor(hi / step) + 1)]


def _panel(result: dict[str, Any], intervals: list[dict[str, Any]], key: str, title: str, top: int) -> list[str]:
    right = WIDTH - RIGHT
    bottom = top + PANEL_H
    values = [f[key] for figures in result["policies"].values() for f in figures.values() if f[key] is not None]
    lo, hi = (min(values + [0.0]), max(values + [0.0])) if key != "balancedness" else (
        min(values, default=0.0), max(values, default=1.0))
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5 if key != "balancedness" else lo - 0.01, hi + 0.5 if key != "balancedness" else hi + 0.01
    pad = (hi - lo) * 0.08
    lo, hi = lo - pad, hi + pad

    def y(v: float) -> float:
        return bottom - (v - lo) / (hi - lo) * PANEL_H

    def x(i: int) -> float:
        return LEFT + (right - LEFT) * (i + 0.5) / max(len(intervals), 1)

    out = [f'<text x="{LEFT}" y="{top - 8}" font-weight="bold">{escape(title)}</text>',
           f'<line x1="{LEFT}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="#000"/>',
           f'<line x1="{LEFT}" y1="{top}" x2="{LEFT}" y2="{bottom}" stroke="#000"/>']
    for v in round_ticks(lo, hi):
        out.append(f'<line x1="{LEFT - 3}" y1="{y(v):.1f}" x2="{LEFT}" y2="{y(v):.1f}" stroke="#000"/>')
        out.append(f'<text x="{LEFT - 5}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.6g}</text>')
    if lo < 0 < hi:
        out.append(f'<line x1="{LEFT}" y1="{y(0):.1f}" x2="{right}" y2="{y(0):.1f}" stroke="#bdbdbd"/>')
    for i, interval in enumerate(intervals):
        out.append(f'<text x="{x(i):.1f}" y="{bottom + 14}" text-anchor="middle">{interval["steps"]}</text>')
    out.append(f'<text x="{(LEFT + right) / 2:.0f}" y="{bottom + 30}" text-anchor="middle">rebalance interval '
               '(steps)</text>')
    for policy, figures in result["policies"].items():
        colour = COLOURS.get(policy, "#000")
        if "-" in figures:
            v = figures["-"][key]
            if v is not None:
                out.append(f'<line x1="{LEFT}" y1="{y(v):.1f}" x2="{right}" y2="{y(v):.1f}" stroke="{colour}" '
                           'stroke-width="2" stroke-dasharray="5 3"/>')
            continue
        points = [(x(i), y(figures[iv["label"]][key])) for i, iv in enumerate(intervals)
                  if iv["label"] in figures and figures[iv["label"]][key] is not None]
        if points:
            out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="'
                       + " ".join(f"{px:.1f},{py:.1f}" for px, py in points) + '"/>')
            out += [f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3" fill="{colour}"/>' for px, py in points]
    return out
