"""`moewatch bench planner`: the planner against DeepSeek's EPLB (eplb_reference.py), side by side
in one process, on 58 layers x 256 experts, 288 slots, 32 GPUs. Prints what it measured and, with
--write, writes docs/benchmarks/planner.md from the same run. Nothing is hard-coded: every figure
and every pass/fail in the page comes from this run.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import click
import numpy as np

from moewatch.cli_contract import OneLineCommand
from moewatch.numpy_json import numpy_default
from moewatch.planner.affinity import load_from_trace, transitions_from_trace
from moewatch.planner.movement import align_to_current
from moewatch.planner.placement_math import (contiguous_placement, dispatch_cross_shares, placement_balancedness,
                                             transition_cross_shares)
from moewatch.planner.solve import solve_placement
from moewatch.tools import eplb_reference as eplb
from moewatch.tools.synthetic import LOAD_KINDS, affinity_trace, drifted, popularity, sample_load

LAYERS, EXPERTS, SLOTS, GPUS, NODES = 58, 256, 288, 32, 4
EPLB_GROUPS = 8  # DeepSeek-V3's expert groups: the hierarchical policy packs groups onto nodes
PAIRS_PER_LAYER = 16384 * 8  # 16k tokens, top-8
SOLVE_BUDGET_SECONDS = 0.050
DRIFT_MOVE_SHARE = 0.5
DRIFT_TOLERANCE = 0.005
AFFINITY_CUT = 0.25
AFFINITY_FLOOR = 0.95
TOPICS, TOP_K = 32, 8


def _median_time(fn, repeats: int) -> tuple[Any, dict[str, float]]:
    walls, cpus, out = [], [], None
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    return out, {"median": statistics.median(walls), "min": min(walls), "max": max(walls),
                 "cpu_median": statistics.median(cpus), "runs": repeats}


def bench_balance(repeats: int, seed: int) -> list[dict[str, Any]]:
    rows = []
    for k, kind in enumerate(LOAD_KINDS):
        rng = np.random.default_rng(seed + k)
        load = sample_load(popularity(kind, LAYERS, EXPERTS, rng), PAIRS_PER_LAYER, rng).astype(np.float64)
        for nodes in (1, NODES):
            # solve_seconds is the solve alone (replicas + packing), timed inside solve_placement
            results = [solve_placement(load, GPUS, SLOTS, nodes) for _ in range(repeats)]
            ours = results[-1]
            solve = [r.solve_seconds for r in results]
            eplb_rows = {}
            for policy, fn in (("global", lambda: eplb.rebalance_global(load, SLOTS, GPUS)),
                               ("hierarchical", lambda: eplb.rebalance_hierarchical(load, SLOTS, EPLB_GROUPS,
                                                                                     nodes, GPUS))):
                emap, t = _median_time(fn, max(1, repeats // 3))
                eplb_rows[policy] = {
                    "balancedness": float(placement_balancedness(load, emap, GPUS).mean()),
                    "balancedness_min": float(placement_balancedness(load, emap, GPUS).min()),
                    "cross_node_share": float(dispatch_cross_shares(load, emap, GPUS, nodes)[1].mean()),
                    "cross_gpu_share": float(dispatch_cross_shares(load, emap, GPUS, nodes)[0].mean()),
                    "seconds": t["median"],
                }
            best_eplb = max(v["balancedness"] for v in eplb_rows.values())
            row = {
                "load": kind, "nodes": nodes,
                "ours": {
                    "balancedness": float(ours.balancedness_after.mean()),
                    "balancedness_min": float(ours.balancedness_after.min()),
                    "cross_node_share": float(ours.cross_node_share_after.mean()),
                    "cross_gpu_share": float(ours.cross_gpu_share_after.mean()),
                    "solve_seconds_median": statistics.median(solve),
                    "solve_seconds_min": min(solve),
                    "solve_seconds_max": max(solve),
                    "runs": repeats,
                },
                "eplb": eplb_rows,
                "best_eplb_balancedness": best_eplb,
            }
            row["pass_balance"] = row["ours"]["balancedness"] >= best_eplb
            row["pass_time"] = row["ours"]["solve_seconds_median"] <= SOLVE_BUDGET_SECONDS
            rows.append(row)
    return rows


def bench_drift(seed: int) -> list[dict[str, Any]]:
    rows = []
    for k, kind in enumerate(LOAD_KINDS):
        for nodes in (1, NODES):
            rng = np.random.default_rng(seed + 100 + k)
            prob = popularity(kind, LAYERS, EXPERTS, rng)
            before = sample_load(prob, PAIRS_PER_LAYER, rng).astype(np.float64)
            after = sample_load(drifted(prob, rng, sigma=0.3, new_hot=1), PAIRS_PER_LAYER, rng).astype(np.float64)
            in_force = solve_placement(before, GPUS, SLOTS, nodes).physical_to_logical_map
            scratch = solve_placement(after, GPUS, SLOTS, nodes)
            renamed = align_to_current(scratch.physical_to_logical_map, in_force, GPUS, nodes)
            moved = solve_placement(after, GPUS, SLOTS, nodes, current=in_force, tolerance=DRIFT_TOLERANCE)
            scratch_moves = int((scratch.physical_to_logical_map != in_force).sum())
            row = {
                "load": kind, "nodes": nodes,
                "balancedness_in_force": float(placement_balancedness(after, in_force, GPUS).mean()),
                "scratch": {"balancedness": float(scratch.balancedness_after.mean()), "experts_moved": scratch_moves},
                "scratch_renamed": {"experts_moved": int((renamed != in_force).sum())},
                "ours": {"balancedness": float(moved.balancedness_after.mean()),
                         "experts_moved": int(moved.experts_moved.sum()),
                         "solve_seconds": moved.solve_seconds,
                         "layers": dict(zip(*np.unique(moved.layer_methods, return_counts=True)))},
            }
            row["ours"]["layers"] = {str(a): int(b) for a, b in row["ours"]["layers"].items()}
            row["move_share"] = row["ours"]["experts_moved"] / max(scratch_moves, 1)
            row["balancedness_gap"] = 1.0 - row["ours"]["balancedness"] / row["scratch"]["balancedness"]
            row["pass"] = row["move_share"] <= DRIFT_MOVE_SHARE and row["balancedness_gap"] <= DRIFT_TOLERANCE
            rows.append(row)
    return rows


def bench_affinity(tokens: int, seed: int) -> list[dict[str, Any]]:
    trace, topics = affinity_trace(tokens, LAYERS, EXPERTS, TOP_K, TOPICS, seed=seed, with_topics=True)
    half = tokens // 2
    fit, held = trace[:half], trace[half:]
    load_fit, load_held = load_from_trace(fit, EXPERTS), load_from_trace(held, EXPERTS)
    t_fit, t_held = transitions_from_trace(fit, EXPERTS), transitions_from_trace(held, EXPERTS)
    contiguous = contiguous_placement(LAYERS, EXPERTS, SLOTS)
    planted = _planted_placement(topics, load_fit)
    rows = []
    for nodes in (1, NODES):
        balanced = solve_placement(load_fit, GPUS, SLOTS, nodes)
        ours = solve_placement(load_fit, GPUS, SLOTS, nodes, affinity=t_fit, balancedness_floor=AFFINITY_FLOOR)
        row: dict[str, Any] = {"nodes": nodes, "tokens": tokens, "tokens_fit": half, "tokens_held_out": tokens - half,
                               "solve_seconds": ours.solve_seconds}
        for name, pmap in (("contiguous", contiguous), ("balanced", balanced.physical_to_logical_map),
                           ("ours", ours.physical_to_logical_map), ("planted", planted)):
            gpu_fit, node_fit = transition_cross_shares(t_fit, pmap, GPUS, nodes)
            gpu_held, node_held = transition_cross_shares(t_held, pmap, GPUS, nodes)
            row[name] = {
                "cross_gpu_fit": gpu_fit, "cross_gpu_held_out": gpu_held,
                "cross_node_fit": node_fit, "cross_node_held_out": node_held,
                "balancedness_fit": float(placement_balancedness(load_fit, pmap, GPUS).mean()),
                "balancedness_fit_min": float(placement_balancedness(load_fit, pmap, GPUS).min()),
                "balancedness_held_out": float(placement_balancedness(load_held, pmap, GPUS).mean()),
            }
        base = row["contiguous"]["cross_gpu_held_out"]
        row["cut_held_out"] = 1.0 - row["ours"]["cross_gpu_held_out"] / base
        row["cut_fit"] = 1.0 - row["ours"]["cross_gpu_fit"] / row["contiguous"]["cross_gpu_fit"]
        row["planted_cut_held_out"] = 1.0 - row["planted"]["cross_gpu_held_out"] / base
        row["pass"] = row["cut_held_out"] >= AFFINITY_CUT and row["ours"]["balancedness_fit_min"] >= AFFINITY_FLOOR
        rows.append(row)
    return rows


def bench_small_trace(seed: int, tokens: int = 577, discounts: tuple[float, ...] = (0.0, 1.0)) -> list[dict[str, Any]]:
    """Fit on half of a trace as small as the 577-token Mixtral one the issue cites: how much of
    the cut survives on the other half, with and without discounting rare pairs."""
    trace = affinity_trace(tokens, LAYERS, EXPERTS, TOP_K, TOPICS, seed=seed + 1)
    half = tokens // 2
    fit, held = trace[:half], trace[half:]
    t_fit, t_held = transitions_from_trace(fit, EXPERTS), transitions_from_trace(held, EXPERTS)
    contiguous = contiguous_placement(LAYERS, EXPERTS, SLOTS)
    base_fit = transition_cross_shares(t_fit, contiguous, GPUS)[0]
    base_held = transition_cross_shares(t_held, contiguous, GPUS)[0]
    rows = []
    for discount in discounts:
        ours = solve_placement(load_from_trace(fit, EXPERTS), GPUS, SLOTS,
                               affinity=transitions_from_trace(fit, EXPERTS, discount),
                               balancedness_floor=AFFINITY_FLOOR)
        pmap = ours.physical_to_logical_map
        rows.append({"tokens": tokens, "tokens_fit": half, "tokens_held_out": tokens - half, "discount": discount,
                     "cut_fit": 1.0 - transition_cross_shares(t_fit, pmap, GPUS)[0] / base_fit,
                     "cut_held_out": 1.0 - transition_cross_shares(t_held, pmap, GPUS)[0] / base_held})
    return rows


def _planted_placement(topics: np.ndarray, load: np.ndarray) -> np.ndarray:
    """[L, Z, E/Z] planted topic sets -> [L, P] topic z's experts on GPU z in every layer, the spare
    slot holding a second replica of the topic's busiest expert (the ceiling, ignoring balance)."""
    L, Z, per = topics.shape
    spare = SLOTS // GPUS - per
    rows = np.empty((L, SLOTS), dtype=np.int64)
    for layer in range(L):
        parts = []
        for z in range(Z):
            members = topics[layer, z]
            busiest = members[np.argsort(-load[layer, members])][:spare]
            parts.append(np.concatenate([members, busiest]))
        rows[layer] = np.concatenate(parts)
    return rows


def run(repeats: int = 9, tokens: int = 16384, seed: int = 0,
        progress: Callable[[str], None] = lambda message: None) -> dict[str, Any]:
    started = time.perf_counter()
    out: dict[str, Any] = {
        "setup": {"layers": LAYERS, "experts": EXPERTS, "slots": SLOTS, "gpus": GPUS, "nodes": [1, NODES],
                  "eplb_groups": EPLB_GROUPS, "pairs_per_layer": PAIRS_PER_LAYER, "seed": seed,
                  # Which EPLB ran: this project's port, at the commit the result file records.
                  "eplb_implementation": "moewatch's numpy port of DeepSeek's EPLB (tools/eplb_reference.py)"},
        "machine": _machine(),
    }
    sections = (("balance", "balance and solve time against EPLB", lambda: bench_balance(repeats, seed)),
                ("drift", "movement after a load drift", lambda: bench_drift(seed)),
                ("affinity", f"affinity on a {tokens}-token trace", lambda: bench_affinity(tokens, seed)),
                ("small_trace", "affinity on a 577-token trace", lambda: bench_small_trace(seed)))
    for i, (key, what, section) in enumerate(sections, 1):
        progress(f"[{i}/{len(sections)}] {what} ({time.perf_counter() - started:.0f} s so far)")
        out[key] = section()
    out["machine"]["load_average_after"] = list(os.getloadavg())
    out["seconds"] = time.perf_counter() - started
    out["pass"] = all(r["pass_balance"] and r["pass_time"] for r in out["balance"]) \
        and all(r["pass"] for r in out["drift"]) and all(r["pass"] for r in out["affinity"])
    return out


def _machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
            "platform": platform.platform(), "load_average_before": list(os.getloadavg()),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def _mark(ok: bool) -> str:
    return "yes" if ok else "**no**"


def render_markdown(r: dict[str, Any], command: str, heading: bool = True) -> str:
    """The results page of one run (`heading`: with its title, for --write)."""
    m = r["machine"]
    lines = [
        "# Planner benchmark: moewatch against DeepSeek's EPLB",
        "",
    ] if heading else []
    lines += [
        f"Written by `{command}` on {m['date']}; every figure below comes from that run "
        f"({r['seconds']:.0f} s in all).",
        "",
        f"Machine: {m['cpus']} CPUs, {m['platform']}, Python {m['python']}, numpy {m['numpy']}. "
        f"Load average (1, 5, 15 min) {', '.join(f'{x:.2f}' for x in m['load_average_before'])} before and "
        f"{', '.join(f'{x:.2f}' for x in m['load_average_after'])} after. Times are medians of several solves; "
        "on a shared machine they read high rather than low.",
        "",
        f"Setup: {r['setup']['layers']} layers x {r['setup']['experts']} experts, {r['setup']['slots']} slots, "
        f"{r['setup']['gpus']} GPUs, in 1 node and in {NODES} nodes; {r['setup']['pairs_per_layer']} pairs per "
        "layer drawn from the popularity of each load kind (lognormal(0, 1); Zipf, s = 1; `hot`: lognormal(0, 0.5) "
        "with 4 experts per layer at 8-20x the mean). EPLB is `tools/eplb_reference.py`, DeepSeek's "
        f"published greedy written here in numpy, run in the same process on the same loads; its hierarchical "
        f"policy uses {EPLB_GROUPS} expert groups (DeepSeek-V3). Balancedness is mean over max of per-GPU load, "
        "averaged over layers (worst layer in brackets). Cross-node share: pairs that leave their node when "
        "tokens start evenly over ranks and take a replica on their own rank, else own node, else any.",
        "",
        "## Balance and solve time",
        "",
        "| load | nodes | ours | EPLB global | EPLB hierarchical | ours >= best EPLB | ours solve (median, min-max) | "
        "<= 50 ms | EPLB time (global / hier.) | cross-node share: ours / global / hier. |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["balance"]:
        o, g, h = row["ours"], row["eplb"]["global"], row["eplb"]["hierarchical"]
        lines.append(
            f"| {row['load']} | {row['nodes']} | {o['balancedness']:.4f} ({o['balancedness_min']:.4f}) | "
            f"{g['balancedness']:.4f} ({g['balancedness_min']:.4f}) | {h['balancedness']:.4f} ({h['balancedness_min']:.4f}) | "
            f"{_mark(row['pass_balance'])} | {o['solve_seconds_median'] * 1e3:.1f} ms ({o['solve_seconds_min'] * 1e3:.1f}-"
            f"{o['solve_seconds_max'] * 1e3:.1f}, {o['runs']} runs) | {_mark(row['pass_time'])} | "
            f"{g['seconds'] * 1e3:.0f} / {h['seconds'] * 1e3:.0f} ms | "
            f"{o['cross_node_share']:.3f} / {g['cross_node_share']:.3f} / {h['cross_node_share']:.3f} |")
    lines += [
        "",
        "EPLB's times here are those of our numpy port, run in this process; [measured-eplb-torch] "
        "(docs/sources.md) measured DeepSeek's published "
        "torch code on a machine like this one, slower still (its loop over one-element tensors dominates). With "
        "one node the hierarchical policy is the global one with groups (it packs all groups onto the one node).",
        "",
        "## After a load drift: minimal movement",
        "",
        "The plan solved for one load stays in force; the load drifts (every expert's share x exp(N(0, 0.3)), and "
        "in each layer the hottest expert trades places with a random one). `From scratch` solves the new load "
        "ignoring the plan in force; `renamed` is that plan with its GPUs renamed to keep as many experts in place "
        "as possible (free, and what the movement planner falls back to); `ours` is `solve_placement(..., "
        f"current=...)` with tolerance {DRIFT_TOLERANCE:.1%}.",
        "",
        "| load | nodes | in force | from scratch: balancedness, moves | renamed: moves | ours: balancedness, moves | "
        "moves / scratch | balancedness gap | layers kept / repaired / renamed | pass |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["drift"]:
        o, s = row["ours"], row["scratch"]
        layers = o["layers"]
        lines.append(
            f"| {row['load']} | {row['nodes']} | {row['balancedness_in_force']:.4f} | {s['balancedness']:.4f}, "
            f"{s['experts_moved']} | {row['scratch_renamed']['experts_moved']} | {o['balancedness']:.4f}, "
            f"{o['experts_moved']} | {row['move_share']:.2f} | {row['balancedness_gap']:.2%} | "
            f"{layers.get('kept', 0)} / {layers.get('repaired', 0)} / {layers.get('renamed', 0)} | {_mark(row['pass'])} |")
    aff = r["affinity"]
    lines += [
        "",
        "## Affinity: consecutive-layer pairs kept on a GPU",
        "",
        f"Synthetic trace with a planted inter-layer affinity: {aff[0]['tokens']} "
        f"tokens, top-{TOP_K}, {TOPICS} hidden topics; each token's choices come with probability 0.7 from its "
        "topic's 8 experts of that layer (a different random partition per layer), popularity lognormal(0, 0.5). "
        "The placement is fitted on the first half of the tokens and scored on the second half (held out), so "
        "overfitting shows. A pair is (expert at layer l, expert at l + 1) over all k x k choices of a token; it "
        "crosses GPUs unless the GPU of the token's layer-l replica also holds the layer-(l+1) expert (ExFlow's "
        "execution, where a token stays on its expert's GPU between layers). `planted` puts each topic's experts "
        "on one GPU: the ceiling for this trace, ignoring balance.",
        "",
        "| nodes | placement | cross-GPU (fit / held out) | cross-node (fit / held out) | balancedness fit (worst) | "
        "balancedness held out |",
        "|---|---|---|---|---|---|",
    ]
    for row in aff:
        for name in ("contiguous", "balanced", "ours", "planted"):
            p = row[name]
            lines.append(f"| {row['nodes']} | {name} | {p['cross_gpu_fit']:.3f} / {p['cross_gpu_held_out']:.3f} | "
                         f"{p['cross_node_fit']:.3f} / {p['cross_node_held_out']:.3f} | {p['balancedness_fit']:.4f} "
                         f"({p['balancedness_fit_min']:.4f}) | {p['balancedness_held_out']:.4f} |")
    lines.append("")
    for row in aff:
        lines.append(
            f"- {row['nodes']} node(s): cross-GPU pairs {row['cut_held_out']:.1%} fewer than contiguous on held-out "
            f"tokens ({row['cut_fit']:.1%} on the fitted half; the planted ceiling {row['planted_cut_held_out']:.1%}), "
            f"worst-layer balancedness {row['ours']['balancedness_fit_min']:.4f} on the fitted load; solved in "
            f"{row['solve_seconds']:.2f} s. Target: >= {AFFINITY_CUT:.0%} fewer and >= {AFFINITY_FLOOR}: "
            f"{_mark(row['pass'])}.")
    lines += [
        "",
        "The floor holds on the load a plan was solved for (the fitted half). On the held-out half the plans "
        "solved on the fitted one lose balance, the balanced plan too "
        f"({aff[0]['balanced']['balancedness_fit']:.4f} -> {aff[0]['balanced']['balancedness_held_out']:.4f}; ours "
        f"{aff[0]['ours']['balancedness_fit']:.4f} -> {aff[0]['ours']['balancedness_held_out']:.4f}, 1 node): half "
        "the trace is a small sample of each expert's load, and a plan fitted to one sample is balanced for it.",
        "",
        f"A small trace: fitted on {r['small_trace'][0]['tokens_fit']} tokens of a "
        f"{r['small_trace'][0]['tokens']}-token trace of the same kind "
        "(the size of the Mixtral trace on which placements fitted on one half did worse on the other than "
        "ExFlow's), 1 node; the gap between the two columns is what fitting noise costs:",
        "",
        "| discount | cut on the fitted half | cut on the held-out half |",
        "|---|---|---|",
    ]
    for row in r["small_trace"]:
        lines.append(f"| {row['discount']:g} | {row['cut_fit']:.1%} | {row['cut_held_out']:.1%} |")
    lines += [
        "",
        "`discount` subtracts that many from every transition count before placing (`moewatch plan --discount`), "
        "dropping pairs seen only once.",
        "",
        f"All targets met: {_mark(r['pass'])}.",
        "",
    ]
    return "\n".join(lines)


@click.command("planner", cls=OneLineCommand)
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON only.")
@click.option("--write", "write_path", type=click.Path(dir_okay=False), default=None,
              help="Write the results page here too (docs/benchmarks/planner.md is rendered by `bench render`).")
@click.option("--repeats", type=click.IntRange(min=1), default=9, show_default=True,
              help="Solves per load for the median time.")
@click.option("--tokens", type=click.IntRange(min=4), default=16384, show_default=True,
              help="Tokens in the affinity trace (half fitted, half held out).")
@click.option("--seed", type=int, default=0, show_default=True)
def planner(as_json: bool, write_path: str | None, repeats: int, tokens: int, seed: int) -> dict[str, Any]:
    """Planner against DeepSeek's EPLB: balance, solve time, movement after drift, affinity."""
    results = run(repeats, tokens, seed, progress=lambda message: click.echo(message, err=True))
    command = f"moewatch bench planner --repeats {repeats} --tokens {tokens} --seed {seed}" + (
        f" --write {write_path}" if write_path else "")
    page = render_markdown(results, command)
    if write_path:
        Path(write_path).write_text(page)
    if as_json:
        click.echo(json.dumps(results, default=numpy_default))
    else:
        click.echo(page)
    return results


