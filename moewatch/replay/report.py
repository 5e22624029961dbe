"""The replay's text report (what the command prints, and what docs/eplb-advice.md shows, rendered from
a result file) and its result file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..numpy_json import numpy_default
RESULT_SCHEMA = "moewatch.replay/v1"
RESULT_FILE = "replay.json"
PICTURE_FILE = "replay.svg"


def _g(value: Any, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}g}"


def render_text(result: dict[str, Any]) -> str:
    """The report of a result file's content, the same on every rendering."""
    inputs, geo, cost, mig = result["inputs"], result["geometry"], result["step_cost"], result["migration"]
    rec = inputs["recorded"]
    lines = [f"replay of {inputs['windows']} windows ({inputs['steps']} steps, {inputs['runtime']} "
             f"{inputs['model']} {inputs['ep_group']}) at {geo['ranks']} ranks, {geo['slots']} slots, "
             f"{geo['nodes']} node(s) [recorded at {rec['ranks']} ranks, {rec['slots']} slots]; "
             f"engine {result['engine']}"]
    if cost["source"] == "unknown":
        lines.append(f"step cost: unknown ({cost['note']})")
    else:
        fitted = (f"a = {_g(cost['seconds_per_busiest_pair'])} s per busiest-GPU pair"
                  + (f", c = {_g(cost['seconds_per_token'])} s per token"
                     if cost["seconds_per_token"] is not None else "")
                  + (f", fixed = {_g(cost['fixed_seconds'])} s" if cost["fixed_seconds"] is not None else ""))
        fit = (f"{cost['samples']} windows, median |residual| {_g(cost['median_abs_residual_seconds'])} s, "
               f"R^2 {_g(cost['r2'])}" if cost["source"] == "fitted" else "given")
        lines.append(f"step cost ({cost['source']}: {fit}): {cost['model']}; {fitted}")
        if cost["note"]:
            lines.append(f"  note: {cost['note']}")
    lines.append(f"stall: {_g(mig['expert_bytes'])} bytes per slot moved ({mig['expert_bytes_source']}), "
                 f"{_g(mig['bytes_per_second'])} bytes/s ({mig['rate_source']})")
    lines.append(f"{'policy':16s} {'interval':>8s} {'rebal':>5s} {'balanced':>8s} {'slots':>6s} {'bytes':>9s} "
                 f"{'stall s':>9s} {'gain s':>9s} {'net s/h':>9s}")
    steps = {i["label"]: i for i in result["intervals"]}
    for policy, figures in result["policies"].items():
        for label, f in figures.items():
            shown = label if label == "-" else str(steps[label]["steps"])
            flag = "" if label == "-" or steps[label]["enough_rebalances"] else "  (too few rebalances)"
            lines.append(f"{policy:16s} {shown:>8s} {f['rebalances']:5d} {f['balancedness']:8.3f} "
                         f"{f['slots_moved']:6d} {_g(float(f['bytes_moved'])):>9s} {_g(f['stall_seconds']):>9s} "
                         f"{_g(f['gain_seconds']):>9s} {_g(f['net_seconds_per_hour']):>9s}{flag}")
    lines += [f"note: {note}" for note in result.get("notes", [])]
    rec_ = result["recommendation"]
    if rec_ is None:
        lines.append(f"no recommendation: {result['no_recommendation']}")
    else:
        lines.append(f"recommendation: {rec_['why']}")
        s = rec_["settings"]
        if s.get("plan"):
            lines.append(f"  placement: {s['plan']}")
        if s.get("args"):
            lines.append(f"  {result['engine']} flags: {s['args']}")
        if s.get("env"):
            lines.append(f"  environment: {s['env']}")
        if s.get("note"):
            lines.append(f"  {s['note']}")
        assumed = [flag for flag, source in (("--expert-bytes", mig["expert_bytes_source"]),
                                             ("--migration-rate", mig["rate_source"])) if source.startswith("assumed")]
        if assumed and rec_["choice"] != "off":
            lines.append(f"  (the stall is priced with an assumed figure above: give {' and '.join(assumed)})")
    lines.append(f"command: {result['command']}")
    m = result.get("machine")
    if m:
        others = "unknown" if m["other_cpu_cores"] is None else f"{m['other_cpu_cores']:.2f} cores"
        lines.append(f"run: {m['wall_seconds']:.0f} s on {m['cores_usable']} cores, other processes' CPU {others} "
                     f"({'busy' if m['busy'] else 'quiet'}); inputs sha256 {result['inputs']['digest'][:16]}")
    return "\n".join(lines) + "\n"


def write_result(out_dir: Path, result: dict[str, Any], picture: str) -> dict[str, str]:
    """Write replay.json and replay.svg into out_dir (each to a temporary name, then renamed)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, text in ((RESULT_FILE, json.dumps(result, indent=1, allow_nan=False, default=numpy_default) + "\n"),
                       (PICTURE_FILE, picture)):
        tmp = out_dir / (name + ".tmp")
        tmp.write_text(text)
        tmp.replace(out_dir / name)
        written[name] = str(out_dir / name)
    return written


