"""`moewatch bench loop`: does acting make the step faster? The closed loop, measured end to end.

One run is two sessions back to back on the same traffic (the reference runtime with two hot experts
carrying most pairs, started on rank 0, each rank on its own core): the agent in act mode, then the
agent in observe mode as the control. From the act session: step p50/p99 on steady-state windows
(no migration in progress) before the first plan and after it, their ratio, the windows from the
first imbalance-bound verdict to the first window with every layer at max/mean rank load <= 1.15,
the migration stall (total and per plan, never mixed into the step figures), pairs lost, and the
rollbacks (every plan here is good: the traffic does not move, so a rollback is a false one). From
the control: the same step figures with no plan, so "before" can be told from the machine's noise.
`--repeat N` runs it N times and counts the false rollbacks.

`--slow-rank R --slow-factor F`: balanced routing (no hot experts) and rank R's expert compute F times
as slow (the runtime's slowdown): the agent has to measure the rank's speed and place for it. A window
is then fixed when every layer's balancedness by time (mean/max of the ranks' expert compute) is at
least FIXED_TIME_BALANCEDNESS; `time_balancedness_before/after` are the layer means of the steady
windows before the first plan and after it. With 2 ranks the planner can shift load only through
padding (the slow rank holding fewer distinct experts in its slots), so the shape needs spare slots:
the default 8 experts in 12 slots allows a 5.5 / 2.5 split of the 8 experts' pairs for F = 2, whose
slowest rank computes 5.5 units against 8 before (0.6875 of the expert time); the result's
`speed_aware_optimum` is the planner's figure for the shape and factor asked.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import click
import numpy as np

from moewatch import telemetry as tm
from moewatch.agent.store import TriagedWindow
from moewatch.cli_contract import OneLineCommand
from moewatch.tools.demo import (DEMO_RUNTIME, DEMO_RUNTIME_GPU, DemoError, Recorder, agent_settings,
                                 mean_time_balancedness, percentile, run_session, scheduler_warnings_muted,
                                 step_figures, step_times)

FIXED_MAX_MEAN = 1.15  # a window whose every layer is at or under this max/mean rank load is fixed
FIXED_TIME_BALANCEDNESS = 0.85  # --slow-rank: a window whose every layer's balancedness by time is at least this
# --slow-rank on CPU ranks: experts four times as wide as the demo's, so expert compute is most of the
# step (with FFN 512 the two all-to-alls held a quarter of it, which no placement shrinks), half the
# tokens and 8-step windows, so a window still takes seconds, not tens of them.
SLOW_RANK_SHAPE = {"ffn": 2048, "batch-tokens": 512, "window-steps": 8}


def load_fixed(t: TriagedWindow) -> bool:
    return max(d.metrics["rank_load_max_mean"] for d in t.diagnosis.layers) <= FIXED_MAX_MEAN


def time_fixed(t: TriagedWindow) -> bool:
    balanced = tm.time_balancedness(t.window)
    return balanced is not None and float(balanced.min()) >= FIXED_TIME_BALANCEDNESS


def windows_to_fix(windows: list[TriagedWindow], fixed: Callable[[TriagedWindow], bool] | None = None) -> int | None:
    """Windows from the first with an imbalance-bound layer to the first after it whose every layer
    has max/mean rank load <= FIXED_MAX_MEAN (None: never imbalanced, or never fixed). With `fixed`
    (a slow rank: time_fixed), from the first window that is not fixed to the first after it that is."""
    if fixed is None:
        first = next((i for i, t in enumerate(windows)
                      if any(d.verdict == "imbalance-bound" for d in t.diagnosis.layers)), None)
        fixed = load_fixed
    else:
        first = next((i for i, t in enumerate(windows) if not fixed(t)), None)
    if first is None:
        return None
    for i in range(first + 1, len(windows)):
        if fixed(windows[i]):
            return i - first
    return None


def windows_from_plan_to_fix(windows: list[TriagedWindow], events: list[dict[str, Any]],
                             fixed: Callable[[TriagedWindow], bool]) -> int | None:
    """Windows from the one during which the first plan was sent to the first fixed window of a later
    epoch (1: the first window after the plan took effect); None without a plan or a fix."""
    sent = next((e["time"] for e in events if e["event"] == "plan_sent"), None)
    if sent is None or not windows:
        return None
    start_epoch = windows[0].window.epoch
    at = next((i for i, t in enumerate(windows) if t.window.end_time > sent), None)
    if at is None:
        return None
    for i in range(at + 1, len(windows)):
        if windows[i].window.epoch > start_epoch and fixed(windows[i]):
            return i - at
    return None


def speed_aware_optimum(flags: dict[str, Any], ranks: int, slow_rank: int, slow_factor: float) -> dict[str, Any]:
    """The planner's best placement for balanced routing on this shape with one rank `slow_factor` times
    as slow: the slowest rank's expert work after over before (the expert-time ratio a perfect loop
    reaches; the step also holds the router, the all-to-all and the rest, which do not shrink)."""
    from moewatch.agent.rank_speed import rank_seconds
    from moewatch.planner import placement_math as pm
    from moewatch.planner.solve import solve_placement

    layers, experts, slots = int(flags["layers"]), int(flags["experts"]), int(flags["slots"])
    load = np.ones((layers, experts))
    speed = np.ones(ranks)
    speed[slow_rank] = 1.0 / slow_factor
    speed = speed / np.median(speed)
    before = pm.contiguous_placement(layers, experts, slots)
    after = solve_placement(load, ranks, slots, rank_speed=speed.tolist()).physical_to_logical_map
    work_before = rank_seconds(pm.gpu_load(load, before, ranks), speed).max(axis=1)
    work_after = rank_seconds(pm.gpu_load(load, np.asarray(after), ranks), speed).max(axis=1)
    return {"experts": experts, "slots": slots, "ranks": ranks, "slow_rank": slow_rank, "slow_factor": slow_factor,
            "slowest_rank_work_ratio": float((work_after / work_before).mean()),
            "pairs_share_of_slow_rank": float((pm.gpu_load(load, np.asarray(after), ranks)[:, slow_rank]
                                               / load.sum(axis=1)).mean())}


def _control_figures(windows: list[TriagedWindow], split: int, warmup_steps: int) -> dict[str, Any]:
    """The observe-mode session's step figures: over all its steps (warm-up left out), and split at
    the act session's first after-window index, for a like-for-like look."""
    body = windows[1:]
    steps = step_times(windows)[warmup_steps:]
    head, tail = step_times(windows[:split])[warmup_steps:], step_times(windows[split:])
    return {
        "windows": len(windows),
        "step_p50_s": percentile(steps, 50), "step_p99_s": percentile(steps, 99),
        "step_p50_first_part_s": percentile(head, 50), "step_p50_second_part_s": percentile(tail, 50),
        "balancedness": float(np.mean([[d.metrics["balancedness"] for d in t.diagnosis.layers] for t in body]))
        if body else None,
        "time_balancedness": mean_time_balancedness(body),
        "plans": 0,
    }


def run_once(seconds: float, control_seconds: float, ranks: int, runtime_flags: dict[str, Any],
             folder: Path, progress: bool, label: str = "") -> dict[str, Any]:
    """One act session and its observe-mode control; with "slow-rank" in runtime_flags a window is
    fixed by time (time_fixed), else by rank load (load_fixed)."""
    slow = "slow-rank" in runtime_flags
    fixed = time_fixed if slow else load_fixed
    started = time.monotonic()
    act_rec = Recorder(progress, started, err=True, prefix=f"{label}act ")
    act = run_session(folder / "act", runtime_flags, agent_settings(runtime_flags), seconds, ranks, recorder=act_rec)
    ctl_rec = Recorder(progress, started, err=True, prefix=f"{label}control ")
    control = run_session(folder / "control", runtime_flags, agent_settings(runtime_flags, {"policy.mode": "observe"}),
                          control_seconds, ranks, recorder=ctl_rec)
    figures = step_figures(act.windows, act.events, int(runtime_flags["warmup-steps"]))
    start_epoch = act.windows[0].window.epoch if act.windows else 0
    first_after = next((i for i, t in enumerate(act.windows) if t.window.epoch > start_epoch), len(act.windows))
    stall = figures["migration_stall_s"]
    p50_before, p50_after = figures["step_p50_before_s"], figures["step_p50_after_s"]
    control_figures = _control_figures(control.windows, first_after, int(runtime_flags["warmup-steps"]))
    rollbacks = sum(1 for e in act.events if e["event"] == "rolled_back")
    return {
        "step_p50_before_s": p50_before, "step_p50_after_s": p50_after,
        "step_p99_before_s": figures["step_p99_before_s"], "step_p99_after_s": figures["step_p99_after_s"],
        "step_p50_ratio": p50_after / p50_before if p50_before and p50_after else None,
        "windows_to_fix": windows_to_fix(act.windows, time_fixed if slow else None),
        "windows_from_plan_to_fix": windows_from_plan_to_fix(act.windows, act.events, fixed),
        "migration_stall_s": {**stall, "max_per_plan": max(stall["per_plan"], default=0.0)},
        "pairs_lost": act.runtime["pairs_lost"] + control.runtime["pairs_lost"],
        "pairs_routed": act.runtime["pairs_routed"] + control.runtime["pairs_routed"],
        "plans_applied": sum(1 for e in act.events if e["event"] == "plan_applied"),
        "plans_verified": sum(1 for e in act.events if e["event"] == "verified"),
        # The traffic never moves, so every plan the agent makes here is a good one: a rollback is false.
        "rollbacks": rollbacks, "false_rollbacks": rollbacks,
        "balancedness_before": figures["balancedness_before"], "balancedness_after": figures["balancedness_after"],
        "time_balancedness_before": figures["time_balancedness_before"],
        "time_balancedness_after": figures["time_balancedness_after"],
        # The agent's own account of the ranks: when it counted one slow, and how fast it measured it.
        "rank_events": [{k: e.get(k) for k in ("event", "rank", "relative_speed", "pairs_per_second", "time")}
                        for e in act.events if e["event"] in ("rank_slow", "rank_recovered")],
        "windows_before": figures["windows_before"], "windows_after": figures["windows_after"],
        "control": control_figures,
        "control_p50_over_before": (control_figures["step_p50_s"] / p50_before
                                    if p50_before and control_figures["step_p50_s"] else None),
        "cpu_binding": act.runtime.get("cpu_binding"),
        "wall_seconds": time.monotonic() - started,
        "folder": str(folder),
    }


def summarise_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """--repeat N: every run, and the counts and medians over them."""
    def median(key: str) -> float | None:
        values = [r[key] for r in runs if r[key] is not None]
        return float(np.median(values)) if values else None

    def worst(key: str) -> float | None:
        values = [r.get(key) for r in runs]
        return None if not values or any(v is None for v in values) else float(max(values))

    return {"runs": runs, "repeat": len(runs), "false_rollbacks": sum(r["false_rollbacks"] for r in runs),
            # The goals hold in every run, not on the median: the worst run's figures (None: a run had none).
            "step_p50_ratio_max": worst("step_p50_ratio"),
            "windows_from_plan_to_fix_max": worst("windows_from_plan_to_fix"),
            "runs_with_false_rollback": sum(1 for r in runs if r["false_rollbacks"]),
            "pairs_lost": sum(r["pairs_lost"] for r in runs),
            "step_p50_ratio_median": median("step_p50_ratio"), "windows_to_fix_median": median("windows_to_fix"),
            "runs_fixed": sum(1 for r in runs if r["windows_to_fix"] is not None)}


@click.command("loop", cls=OneLineCommand)
@click.option("--seconds", type=click.FloatRange(2, 3600), default=None,
              help="How long the act session's runtime serves (startup adds about 5 s) [30; --slow-rank 45].")
@click.option("--control-seconds", type=click.FloatRange(2, 3600), default=None,
              help="How long the observe-mode control's runtime serves [20; --slow-rank 30].")
@click.option("--ranks", type=click.IntRange(2, 64), default=2, show_default=True,
              help="EP ranks: at most the cores (gloo) so each rank has its own, or one per GPU (nccl).")
@click.option("--backend", type=click.Choice(["gloo", "nccl"]), default="gloo", show_default=True,
              help="gloo: CPU ranks; nccl: one rank per GPU, on the demo's GPU shape.")
@click.option("--batch-tokens", "batch_tokens", type=click.IntRange(16, 65536), default=None,
              help=f"Token slots per rank per step [gloo {DEMO_RUNTIME['batch-tokens']}, "
                   f"nccl {DEMO_RUNTIME_GPU['batch-tokens']}].")
@click.option("--hidden", type=click.IntRange(16, 16384), default=None,
              help=f"[gloo {DEMO_RUNTIME['hidden']}, nccl {DEMO_RUNTIME_GPU['hidden']}]")
@click.option("--ffn", type=click.IntRange(16, 65536), default=None,
              help=f"[gloo {DEMO_RUNTIME['ffn']}, nccl {DEMO_RUNTIME_GPU['ffn']}]")
@click.option("--window-steps", "window_steps", type=click.IntRange(2, 1000), default=None,
              help=f"Steps per window [gloo {DEMO_RUNTIME['window-steps']}, nccl {DEMO_RUNTIME_GPU['window-steps']}].")
@click.option("--repeat", type=click.IntRange(1, 1000), default=1, show_default=True,
              help="Run it this many times and count the false rollbacks.")
@click.option("--keep", type=click.Path(file_okay=False), default=None,
              help="Folder for the sockets, audit logs and runtime logs (default: a temporary folder).")
@click.option("--slow-rank", "slow_rank", type=click.IntRange(0, 63), default=None,
              help="Balanced routing, and this rank's expert compute --slow-factor times as slow: the agent "
                   "has to place for the ranks' measured speeds.")
@click.option("--slow-factor", "slow_factor", type=click.FloatRange(1.0, 100.0), default=2.0, show_default=True,
              help="How many times as long the slow rank's expert compute takes (with --slow-rank).")
@click.option("--json", "as_json", is_flag=True, help="Print only the result as JSON.")
def loop(seconds, control_seconds, ranks, backend, batch_tokens, hidden, ffn, window_steps, repeat, keep,
         slow_rank, slow_factor, as_json) -> dict[str, Any]:
    """Closed loop: step time before and after the agent acts, against an observe-mode control."""
    import logging
    import os

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    cores = len(os.sched_getaffinity(0))
    if backend == "gloo" and ranks > cores:
        click.echo(f"moewatch bench loop: warning: {ranks} ranks on {cores} cores time-share them: the busiest "
                   "rank no longer sets the step, so the gain will not show", err=True)
    base = DEMO_RUNTIME_GPU if backend == "nccl" else DEMO_RUNTIME
    given = {"batch-tokens": batch_tokens, "hidden": hidden, "ffn": ffn, "window-steps": window_steps}
    if slow_rank is not None and backend == "gloo":
        base = {**base, **SLOW_RANK_SHAPE}
    flags = {**base, **{k: v for k, v in given.items() if v is not None}, "model-name": "bench-loop"}
    seconds = seconds or (45.0 if slow_rank is not None else 30.0)
    control_seconds = control_seconds or (30.0 if slow_rank is not None else 20.0)
    optimum = None
    if slow_rank is not None:
        if slow_rank >= ranks:
            raise click.BadParameter(f"rank {slow_rank} is not among the {ranks} ranks", param_hint="--slow-rank")
        # Balanced routing: the only imbalance is the slow device's.
        flags = {k: v for k, v in flags.items() if k not in ("hot-on-rank", "hot-share")}
        flags.update({"zipf": 0.0, "hot-experts": 0, "slow-rank": slow_rank, "slow-factor": slow_factor})
        optimum = speed_aware_optimum(flags, ranks, slow_rank, slow_factor)
    root = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="moewatch-loop-"))
    runs = []
    try:
        with scheduler_warnings_muted():
            for i in range(repeat):
                label = f"run {i + 1}/{repeat} " if repeat > 1 else ""
                click.echo(f"moewatch bench loop: {label}act session ({seconds:g} s), then the observe-mode control "
                           f"({control_seconds:g} s), {ranks} ranks", err=True)
                runs.append(run_once(seconds, control_seconds, ranks, flags, root / f"run{i}", True, label))
                r = runs[-1]
                click.echo(f"moewatch bench loop: {label}p50 ratio {r['step_p50_ratio']}, windows to fix "
                           f"{r['windows_to_fix']}, rollbacks {r['rollbacks']}, {r['wall_seconds']:.0f} s", err=True)
    except DemoError as exc:
        click.echo(f"moewatch bench loop: failed: {exc}", err=True)
        sys.exit(1)
    result = runs[0] if repeat == 1 else summarise_runs(runs)
    if optimum is not None:
        result = {**result, "speed_aware_optimum": optimum}
    if as_json:
        click.echo(json.dumps(result, allow_nan=False))
        return result
    if optimum is not None:
        click.echo(f"rank {slow_rank} at {slow_factor:g}x; {optimum['experts']} experts in {optimum['slots']} slots: the "
                   f"planner's best placement gives the slowest rank {optimum['slowest_rank_work_ratio']:.3f} of its "
                   f"expert work before (the step also holds work that does not shrink)")
    for r in runs:
        _print_run(r)
    if repeat > 1:
        click.echo(f"{repeat} runs: {result['false_rollbacks']} false rollbacks "
                   f"({result['runs_with_false_rollback']} runs), pairs lost {result['pairs_lost']}, "
                   f"median p50 ratio {result['step_p50_ratio_median']}")
    return result


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1e3:.1f} ms"


def _print_run(r: dict[str, Any]) -> None:
    ratio = "n/a" if r["step_p50_ratio"] is None else f"{r['step_p50_ratio']:.3f}"
    click.echo(f"step p50 {_ms(r['step_p50_before_s'])} -> {_ms(r['step_p50_after_s'])} (ratio {ratio}); "
               f"p99 {_ms(r['step_p99_before_s'])} -> {_ms(r['step_p99_after_s'])}")
    click.echo(f"windows to fix {r['windows_to_fix']}; migration stall {_ms(r['migration_stall_s']['total'])} "
               f"in {len(r['migration_stall_s']['per_plan'])} plan(s); pairs lost {r['pairs_lost']}; "
               f"rollbacks {r['rollbacks']}")
    c = r["control"]
    if r.get("time_balancedness_before") is not None and r.get("time_balancedness_after") is not None:
        click.echo(f"balancedness by time {r['time_balancedness_before']:.3f} -> {r['time_balancedness_after']:.3f}; "
                   f"windows from the first plan to the fix {r['windows_from_plan_to_fix']}")
    click.echo(f"control (observe mode): step p50 {_ms(c['step_p50_s'])}, p99 {_ms(c['step_p99_s'])}")
