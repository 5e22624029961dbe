"""`moewatch bench eplb`: moewatch's EPLB policy against vLLM's default policy and SGLang's `deepseek`
algorithm, each called through the engine's own function, on the same loads in one run.

Loads are production-shaped pair counts per rebalance window (61 layers x 256 experts, 320 slots,
64 ranks on 8 nodes by default): lognormal, Zipf and hot-expert popularity replayed unchanged
(`--steady-intervals` rebalances each: the first places, the later ones should move nothing), and a
drifting load over `--drift-intervals` rebalances (tools.synthetic.drifted). Each window holds
window_steps x pairs_per_step pairs per layer, multinomial over the popularity.

vLLM's part runs in vLLM's environment (--vllm-python: its DefaultEplbPolicy and moewatch's policy
behind the same interface, as vLLM would call it, each from its own previous map), SGLang's in
SGLang's (--sglang-python: eplb_algorithms.rebalance_experts with EplbAlgorithm.deepseek, which is
not given a map); each in a subprocess that writes its maps and call times. `--tolerances` adds
moewatch's policy at other MOEWATCH_EPLB_TOLERANCE values, for the trade between slots moved and
balancedness. The figures are computed here: balancedness after each rebalance on the load it was
solved for (and, drifting, on the next window's load), slots moved per rebalance, call seconds,
layers the gate kept. Goals (issues 17 and 32) are pass/fail keys under "goals", for the settings in force
and the run's shape.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_VLLM_PYTHON = ".venv-vllm/bin/python"
STEADY = ("lognormal", "zipf", "hot")
# moewatch's policy at the settings in force is "moewatch"; at another MOEWATCH_EPLB_TOLERANCE
# (--tolerances) it is this name with the tolerance appended. Goals are about "moewatch" alone.
TOLERANCE_POLICY = "moewatch_tolerance_"
MOVED_OVER_BOUND_GOAL = 1.25  # issue 32: slots moved at most this times the LP bound
LONGEST_PAUSE_GOAL = 0.005  # issue 32: seconds a Python thread stepping every 1 ms may wait
MOVED_SHARE_OF_ENGINE_GOAL = 0.25  # issue 32: slots moved at most this share of each engine's own


def tolerance_policy_name(tolerance: float) -> str:
    return f"{TOLERANCE_POLICY}{tolerance:g}"


def is_moewatch(policy: str) -> bool:
    return policy == "moewatch" or policy.startswith(TOLERANCE_POLICY)


def parse_tolerances(text: str) -> tuple[float, ...]:
    """"0.01,0.02" -> (0.01, 0.02); each a number in (0, 1). Raises ValueError naming the value."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"not a number: {part!r}") from None
        if not 0.0 < value < 1.0:
            raise ValueError(f"{part} is not in (0, 1)")
        out.append(value)
    return tuple(dict.fromkeys(out))


def scenario_loads(kind: str, intervals: int, layers: int, experts: int, pairs_per_window: int,
                   seed: int) -> np.ndarray:
    """[T, L, E] int64 pair counts, one per rebalance window: a steady kind replays one window;
    "drift" draws a fresh window from a popularity that drifts between windows."""
    from moewatch.tools import synthetic

    rng = np.random.default_rng(seed)
    if kind in STEADY:
        probabilities = synthetic.popularity(kind, layers, experts, rng)
        window = synthetic.sample_load(probabilities, pairs_per_window, rng)
        return np.repeat(window[None], intervals, axis=0)
    probabilities = synthetic.popularity("lognormal", layers, experts, rng)
    out = []
    for _ in range(intervals):
        out.append(synthetic.sample_load(probabilities, pairs_per_window, rng))
        probabilities = synthetic.drifted(probabilities, rng)
    return np.stack(out)


# --- inside an engine's environment -------------------------------------------------------------------

def run_vllm_policies(loads: np.ndarray, shape: dict[str, Any], environ: dict[str, str]) -> dict[str, Any]:
    """vLLM's default policy and moewatch's (vllm_eplb, as installed by the plugin; also at each of
    shape["tolerances"]) over the windows, each from its own previous map;
    -> {policy: {"maps": [T, L, P], "seconds": [T], "decisions"}}."""
    import torch
    from vllm.distributed.eplb.policy import AbstractEplbPolicy
    from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

    from moewatch.planner import mending_compiled
    from moewatch.planner.placement_math import contiguous_placement
    from moewatch.planner.rebalance import RebalanceSettings
    from moewatch.runtime.engines import vllm_eplb

    settings = RebalanceSettings.from_env(environ)
    ours = vllm_eplb.make_policy(AbstractEplbPolicy, DefaultEplbPolicy, settings)
    swept = [(tolerance_policy_name(t), vllm_eplb.make_policy(AbstractEplbPolicy, DefaultEplbPolicy,
                                                               dataclasses.replace(settings, tolerance=t)))
             for t in shape.get("tolerances", [])]
    # As the plugin does at install: numba compiles (or reads its cache) before the first call.
    started = time.perf_counter()
    mending = {"loops": mending_compiled.warm_up(), "warm_up_seconds": time.perf_counter() - started}
    P, W, N, groups = shape["slots"], shape["ranks"], shape["nodes"], shape["groups"]
    out: dict[str, Any] = {}
    for name, policy in (("vllm_default", DefaultEplbPolicy), ("moewatch", ours), *swept):
        current = torch.from_numpy(contiguous_placement(loads.shape[1], loads.shape[2], P).astype(np.int64))
        maps, seconds, decisions = [], [], []
        fallbacks_before = vllm_eplb.fallbacks()  # the count is the process's: this policy's is the rise
        for window in loads:
            started = time.perf_counter()
            current = policy.rebalance_experts(torch.from_numpy(window), P, groups, N, W, current)
            seconds.append(time.perf_counter() - started)
            maps.append(current.numpy().copy())
            if is_moewatch(name):
                decision = vllm_eplb.last_decision()
                decisions.append(None if decision is None else decision.record())
        out[name] = {"maps": np.stack(maps), "seconds": seconds, "decisions": decisions,
                     "fallbacks": vllm_eplb.fallbacks() - fallbacks_before if is_moewatch(name) else 0}
        # The same calls again (each from the map it started from), with a Python thread stepping
        # beside them: apart from the timed ones, so the thread's steps do not count in the times.
        start = contiguous_placement(loads.shape[1], loads.shape[2], P).astype(np.int64)
        starts = [torch.from_numpy(m) for m in (start, *maps[:-1])]
        out[name]["pause"] = stepping_pauses(
            lambda t: policy.rebalance_experts(torch.from_numpy(loads[t]), P, groups, N, W, starts[t]), len(loads))
    out["moewatch"]["mending"] = mending
    return out


def run_sglang_deepseek(loads: np.ndarray, shape: dict[str, int]) -> dict[str, Any]:
    """SGLang's `deepseek` algorithm through eplb_algorithms.rebalance_experts, one call per window."""
    # The calls moewatch replay makes.
    from moewatch.runtime.engines.eplb_policy_driver import sglang_deepseek, sglang_deepseek_call

    maps, seconds = sglang_deepseek(loads, np.zeros((loads.shape[1], shape["slots"]), dtype=np.int64), shape)
    pause = stepping_pauses(lambda t: sglang_deepseek_call(loads[t], shape), len(loads))
    return {"sglang_deepseek": {"maps": maps, "seconds": seconds, "decisions": [], "fallbacks": 0,
                                "pause": pause}}


def stepping_pauses(call, calls: int) -> dict[str, Any]:
    """call(t) for t in range(calls), each with a Python thread stepping every 1 ms beside it ->
    pause_figures over every gap between its steps during the calls (tools/bench/stepping.py)."""
    from moewatch.tools.bench.stepping import SteppingThread, pause_figures

    gaps: list[float] = []
    for t in range(calls):
        with SteppingThread() as stepper:
            call(t)
        gaps += stepper.gaps
    return pause_figures(gaps)


def worker(engine: str, folder: str) -> None:
    """Entry in the engine's environment: reads loads.npz and shape.json from `folder`, writes
    <engine>.npz (maps) and <engine>.json (seconds, decisions)."""
    base = Path(folder)
    shape = json.loads((base / "shape.json").read_text())
    with np.load(base / "loads.npz") as data:
        scenarios = {name: data[name] for name in data.files}
    maps: dict[str, np.ndarray] = {}
    facts: dict[str, Any] = {}
    for scenario, loads in scenarios.items():
        result = (run_vllm_policies(loads, shape, dict(os.environ)) if engine == "vllm"
                  else run_sglang_deepseek(loads, shape))
        for policy, got in result.items():
            maps[f"{scenario}/{policy}"] = got.pop("maps")
            facts[f"{scenario}/{policy}"] = got
    np.savez(base / f"{engine}.npz", **maps)
    (base / f"{engine}.json").write_text(json.dumps(facts))


# --- here: the figures -------------------------------------------------------------------------------

def policy_figures(loads: np.ndarray, maps: np.ndarray, seconds: list[float], decisions: list, ranks: int,
                   slots: int) -> dict[str, Any]:
    """[T, L, E] loads, [T, L, P] maps after each rebalance -> per-rebalance figures."""
    from moewatch.planner.placement_math import placement_balancedness, contiguous_placement

    T, L, E = loads.shape
    before = np.concatenate([contiguous_placement(L, E, slots)[None], maps[:-1]])
    bal = [float(placement_balancedness(loads[t], maps[t], ranks).mean()) for t in range(T)]
    bal_next = [float(placement_balancedness(loads[t + 1], maps[t], ranks).mean()) for t in range(T - 1)]
    moved = [int((maps[t] != before[t]).sum()) for t in range(T)]
    kept_by_gate = [int((d or {}).get("layer_outcomes", {}).get("kept_not_paying", 0)) for d in decisions]
    moved_less = [int((d or {}).get("layer_outcomes", {}).get("moved_less", 0)) for d in decisions]
    return {
        "balancedness_after": bal,
        "balancedness_proposed": [d.get("balancedness_proposed") for d in decisions if d] or None,
        "balancedness_on_next_window": bal_next,
        "experts_moved": moved,
        "experts_moved_total": int(sum(moved)),
        "solve_seconds": seconds,
        "solve_seconds_median": float(np.median(seconds)),
        "layers_kept_by_gate": kept_by_gate,
        "layers_moved_less_by_gate": moved_less,
        "rebalances_skipped_by_gate": int(sum(1 for d, m in zip(decisions, moved)
                                              if d and m == 0 and d.get("layer_outcomes", {}).get("kept_not_paying"))),
    }


def policy_targets(loads: np.ndarray, slots: int, ranks: int, tolerance: float) -> np.ndarray:
    """[T, L, E] loads -> [T, L] the busiest GPU load moewatch's mending aims for at `tolerance`."""
    from moewatch.planner.incremental import best_busiest_bound

    return np.stack([best_busiest_bound(window.astype(np.float64), slots, ranks) for window in loads]) / (1.0 - tolerance)


def _most_per_gpu(pmap: np.ndarray, num_experts: int, ranks: int) -> np.ndarray:
    """[L, P] placement -> [L, E] the most replicas of each expert on one GPU (at least 1)."""
    L, P = pmap.shape
    held = np.zeros((L, ranks, num_experts), dtype=np.int64)
    np.add.at(held, (np.arange(L)[:, None], np.repeat(np.arange(ranks), P // ranks)[None, :], pmap), 1)
    return np.maximum(1, held.max(axis=1))


def bound_rebalances(intervals: int, sample: int) -> list[int]:
    """The rebalances the LP bound is computed for: every one of a steady load's (`sample` 0), else
    `sample` evenly spaced ones, the first and the last among them."""
    if sample <= 0 or sample >= intervals:
        return list(range(intervals))
    return sorted({int(round(i)) for i in np.linspace(0, intervals - 1, sample)})


def moved_over_bound(loads: np.ndarray, maps: np.ndarray, ranks: int, targets: np.ndarray | None,
                     rebalances: list[int], optimum_layers: int, optimum_seconds: float) -> dict[str, Any]:
    """[T, L, E] loads, [T, L, P] a policy's maps, [T, L] its target busiest load (None: an engine's
    policy, held to the balancedness it reached) -> slots it moved against the fewest any placement
    with its replica counts at that balancedness rewrites (tools/eplb_optimum.py): the LP bound and
    the slack bound on every layer of `rebalances`, the integer program on `optimum_layers` layers of the first of them
    under a time limit of `optimum_seconds` each."""
    from moewatch.planner.placement_math import contiguous_placement, gpu_load, replica_counts_of
    from moewatch.tools.eplb_optimum import fewest_slots_rewritten, slack_bound

    T, L, E = loads.shape
    P = maps.shape[2]
    before = np.concatenate([contiguous_placement(L, E, P)[None], maps[:-1]])
    per_rebalance = []
    optimum = []
    started = time.perf_counter()
    for t in rebalances:
        window = loads[t].astype(np.float64)
        reached = gpu_load(window, maps[t], ranks).max(axis=1)
        limit = reached if targets is None else np.maximum(reached, targets[t])
        counts = replica_counts_of(maps[t], E)
        most = _most_per_gpu(maps[t], E, ranks)
        moved = (maps[t] != before[t]).sum(axis=1)
        bounds = [fewest_slots_rewritten(window[l], before[t, l], counts[l], ranks, float(limit[l]), integer=False,
                                         max_per_gpu=most[l]).slots_rewritten_bound for l in range(L)]
        # a layer the policy left alone needs nothing: its own placement is one that rewrites no slot
        slack = [slack_bound(window[l], before[t, l], counts[l], ranks, float(limit[l])) if moved[l] else 0
                 for l in range(L)]
        per_rebalance.append({"rebalance": t, "slots_moved": int(moved.sum()), "lp_bound": int(sum(bounds)),
                              "lp_bound_per_layer": bounds, "slack_bound": int(sum(slack)),
                              "slack_bound_per_layer": slack})
        if t == rebalances[0] and optimum_layers > 0:
            for l in sorted({int(round(i)) for i in np.linspace(0, L - 1, min(optimum_layers, L))}):
                found = fewest_slots_rewritten(window[l], before[t, l], counts[l], ranks, float(limit[l]),
                                               integer=True, time_limit=optimum_seconds, max_per_gpu=most[l])
                optimum.append({"rebalance": t, "layer": l, "slots_moved": int(moved[l]),
                                "lp_bound": bounds[l], **found.record()})
    moved_total = sum(r["slots_moved"] for r in per_rebalance)
    bound_total = sum(r["lp_bound"] for r in per_rebalance)
    slack_total = sum(r["slack_bound"] for r in per_rebalance)
    return {"rebalances": rebalances, "slots_moved": moved_total, "lp_bound": bound_total,
            "moved_over_lp_bound": moved_total / bound_total if bound_total else None,
            "slack_bound": slack_total, "moved_over_slack_bound": moved_total / slack_total if slack_total else None,
            "per_rebalance": per_rebalance, "integer_program": optimum,
            "integer_program_time_limit_seconds": optimum_seconds, "seconds": time.perf_counter() - started}


def goals(results: dict[str, dict[str, Any]]) -> dict[str, bool]:
    """Issue 17's goals, against each engine's own algorithm present in the run: balancedness at least
    its own after every rebalance, at most a third of its slots moved, at most half its median call
    time; and on a steady load, nothing moved after the first rebalance. Issue 32's, at the run's
    shape (a run per shape: --nodes 4, 8): at most a quarter of each engine's slots moved on every
    load, no call longer than the engine's median call on every load, and where the run measured them,
    slots moved at most 1.25x the LP bound and the longest pause of the stepping thread at most 5 ms."""
    out: dict[str, bool] = {"steady_load_moves_nothing_after_first": True}
    others = sorted({p for policies in results.values() for p in policies if not is_moewatch(p)})
    seconds: dict[str, list[float]] = {p: [] for p in ["moewatch", *others]}
    for other in others:
        out[f"balancedness_at_least_{other}_every_interval"] = True
        out[f"moved_at_most_a_third_of_{other}"] = True
        out[f"moved_at_most_a_quarter_of_{other}_every_load"] = True
        out[f"call_time_at_most_{other}_every_load"] = True
    for scenario, policies in results.items():
        ours = policies["moewatch"]
        seconds["moewatch"] += ours["solve_seconds"]
        for other in others:
            theirs = policies.get(other)
            if theirs is None:
                continue
            seconds[other] += theirs["solve_seconds"]
            if any(a < b - 1e-9 for a, b in zip(ours["balancedness_after"], theirs["balancedness_after"])):
                out[f"balancedness_at_least_{other}_every_interval"] = False
            if ours["experts_moved_total"] * 3 > theirs["experts_moved_total"]:
                out[f"moved_at_most_a_third_of_{other}"] = False
            if ours["experts_moved_total"] > MOVED_SHARE_OF_ENGINE_GOAL * theirs["experts_moved_total"]:
                out[f"moved_at_most_a_quarter_of_{other}_every_load"] = False
            # moewatch's slowest call against the engine's median: on a steady load only the first call
            # places anything (the later ones keep the map in milliseconds), so a median of ours would
            # hide it; the engine's calls all do the same work, and its median is its steady figure.
            if max(ours["solve_seconds"]) > np.median(theirs["solve_seconds"]):
                out[f"call_time_at_most_{other}_every_load"] = False
        if scenario in STEADY and any(ours["experts_moved"][1:]):
            out["steady_load_moves_nothing_after_first"] = False
    for other in others:
        out[f"solve_time_at_most_half_of_{other}"] = bool(
            np.median(seconds["moewatch"]) <= 0.5 * np.median(seconds[other]))
    # Issue 32: slots moved near the fewest a placement with its counts could rewrite, and the
    # engine's loop never waiting long on the policy (when the run measured them).
    ours = [policies["moewatch"] for policies in results.values()]
    if all(f.get("bound") for f in ours):
        out["moved_at_most_1.25x_lp_bound"] = all(
            f["bound"]["slots_moved"] <= MOVED_OVER_BOUND_GOAL * f["bound"]["lp_bound"] for f in ours)
    if all(f.get("pause") for f in ours):
        out["longest_pause_at_most_5_ms"] = all(
            f["pause"]["pause_max_seconds"] is not None and f["pause"]["pause_max_seconds"] <= LONGEST_PAUSE_GOAL
            for f in ours)
    return out


def run_bench(layers: int, experts: int, slots: int, ranks: int, nodes: int, groups: int, steady_intervals: int,
              drift_intervals: int, window_steps: int, pairs_per_step: int, seed: int, vllm_python: str,
              sglang_python: str, environ: dict[str, str], tolerances: tuple[float, ...] = (),
              bound_drift_rebalances: int = 3, optimum_layers: int = 1, optimum_seconds: float = 30.0) -> dict[str, Any]:
    shape = {"layers": layers, "experts": experts, "slots": slots, "ranks": ranks, "nodes": nodes, "groups": groups,
             "tolerances": list(tolerances)}
    pairs = window_steps * pairs_per_step
    scenarios = {kind: scenario_loads(kind, steady_intervals, layers, experts, pairs, seed + i)
                 for i, kind in enumerate(STEADY)}
    scenarios["drift"] = scenario_loads("drift", drift_intervals, layers, experts, pairs, seed + 10)
    env = {k: v for k, v in environ.items() if not k.startswith("MOEWATCH_EPLB")}
    env.update({k: v for k, v in environ.items() if k.startswith("MOEWATCH_EPLB_")})
    env["MOEWATCH_EPLB_WINDOW_STEPS"] = str(window_steps)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="moewatch-eplb-") as folder:
        base = Path(folder)
        (base / "shape.json").write_text(json.dumps(shape))
        np.savez(base / "loads.npz", **scenarios)
        for engine, python in (("vllm", vllm_python), ("sglang", sglang_python)):
            proc = subprocess.run([python, "-m", "moewatch.tools.bench.eplb", engine, folder], env=env,
                                  capture_output=True, text=True, timeout=3600)
            if proc.returncode != 0:
                raise RuntimeError(f"{engine}'s part failed ({python}): {proc.stderr[-3000:]}")
        maps: dict[str, np.ndarray] = {}
        facts: dict[str, Any] = {}
        for engine in ("vllm", "sglang"):
            with np.load(base / f"{engine}.npz") as data:
                maps.update({name: data[name] for name in data.files})
            facts.update(json.loads((base / f"{engine}.json").read_text()))
    results: dict[str, dict[str, Any]] = {}
    for key, pmaps in maps.items():
        scenario, policy = key.split("/")
        got = facts[key]
        figures = policy_figures(scenarios[scenario], pmaps, got["seconds"], got["decisions"], ranks, slots)
        figures["fallbacks"] = got["fallbacks"]
        figures["pause"] = got.get("pause")
        if "mending" in got:
            figures["mending"] = got["mending"]
        results.setdefault(scenario, {})[policy] = figures
    # The reference (tools/eplb_optimum.py): slots moved against the fewest a placement with the
    # policy's replica counts at its balancedness could rewrite; moewatch's at its own target.
    from moewatch.planner.rebalance import RebalanceSettings

    bound_started = time.perf_counter()
    default_tolerance = RebalanceSettings.from_env(env).tolerance
    for scenario, policies in results.items():
        loads = scenarios[scenario]
        rebalances = bound_rebalances(loads.shape[0], 0 if scenario in STEADY else bound_drift_rebalances)
        for policy, figures in policies.items():
            targets = None
            if is_moewatch(policy):
                tolerance = (default_tolerance if policy == "moewatch"
                             else float(policy[len(TOLERANCE_POLICY):]))
                targets = policy_targets(loads, slots, ranks, tolerance)
            figures["bound"] = moved_over_bound(loads, maps[f"{scenario}/{policy}"], ranks, targets, rebalances,
                                                optimum_layers, optimum_seconds)
    bound_seconds = time.perf_counter() - bound_started
    return {"shape": {**shape, "window_steps": window_steps, "pairs_per_step": pairs_per_step,
                      "steady_intervals": steady_intervals, "drift_intervals": drift_intervals,
                      "bound_drift_rebalances": bound_drift_rebalances, "optimum_layers": optimum_layers,
                      "optimum_seconds": optimum_seconds},
            "bound_seconds": bound_seconds,
            "settings": {k: v for k, v in env.items() if k.startswith("MOEWATCH_EPLB_")},
            "results": results, "goals": goals(results), "wall_seconds": time.perf_counter() - started,
            "load_average": list(os.getloadavg())}


def _ratio(bound: dict[str, Any], key: str = "moved_over_lp_bound") -> str:
    value = bound.get(key)
    return "n/a (bound 0)" if value is None else f"{value:.2f}"


def _eplb_command():
    import click

    from moewatch.cli_contract import OneLineCommand

    @click.command("eplb", cls=OneLineCommand)
    @click.option("--layers", type=click.IntRange(1), default=61, show_default=True)
    @click.option("--experts", type=click.IntRange(1), default=256, show_default=True)
    @click.option("--slots", type=click.IntRange(1), default=320, show_default=True)
    @click.option("--ranks", type=click.IntRange(1), default=64, show_default=True)
    @click.option("--nodes", type=click.IntRange(1), default=8, show_default=True)
    @click.option("--groups", type=click.IntRange(1), default=8, show_default=True,
                  help="expert groups (DeepSeek-V3's n_group), passed to the engines' policies")
    @click.option("--steady-intervals", type=click.IntRange(1), default=3, show_default=True)
    @click.option("--drift-intervals", type=click.IntRange(2), default=20, show_default=True)
    @click.option("--window-steps", type=click.IntRange(1), default=1000, show_default=True,
                  help="steps per rebalance window (vLLM's window_size)")
    @click.option("--pairs-per-step", type=click.IntRange(1), default=64 * 256 * 8, show_default=True,
                  help="pairs per layer per step over the EP group (64 ranks x 256 tokens x top-8)")
    @click.option("--seed", type=int, default=0, show_default=True)
    @click.option("--vllm-python", default=DEFAULT_VLLM_PYTHON, show_default=True)
    @click.option("--sglang-python", default=sys.executable, show_default=True,
                  help="a Python with SGLang installed (default: this one)")
    @click.option("--tolerances", default="", metavar="T[,T...]",
                  help="also run moewatch's policy at these MOEWATCH_EPLB_TOLERANCE values (slots moved "
                       "against balancedness); the goals stay those of the settings in force")
    @click.option("--bound-drift-rebalances", type=click.IntRange(0), default=3, show_default=True,
                  help="rebalances of the drifting load (evenly spaced, first and last among them; 0: all) whose "
                       "layers get the LP bound on slots moved; a steady load's all do")
    @click.option("--optimum-layers", type=click.IntRange(0), default=1, show_default=True,
                  help="layers (evenly spaced) of each load's first rebalance solved as an integer program, per policy")
    @click.option("--optimum-seconds", type=click.FloatRange(0.1), default=30.0, show_default=True,
                  help="time limit of each integer program")
    @click.option("--json", "as_json", is_flag=True, help="machine output only")
    def eplb(layers, experts, slots, ranks, nodes, groups, steady_intervals, drift_intervals, window_steps,
             pairs_per_step, seed, vllm_python, sglang_python, tolerances, bound_drift_rebalances, optimum_layers,
             optimum_seconds, as_json) -> None:
        """moewatch's EPLB policy against vLLM's default and SGLang's deepseek, through their own functions.
        Gate settings come from MOEWATCH_EPLB_* (docs/integrations.md)."""
        from moewatch.planner.placement_math import PlacementShapeError, check_sizes

        try:
            check_sizes(experts, slots, ranks, nodes)
        except PlacementShapeError as exc:
            raise click.BadParameter(str(exc)) from None
        try:
            swept = parse_tolerances(tolerances)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--tolerances") from None
        for python in (vllm_python, sglang_python):
            if not Path(python).is_file():
                raise click.ClickException(f"{python} is missing (`make vllm-env` builds vLLM's environment)")
        try:
            report = run_bench(layers, experts, slots, ranks, nodes, groups, steady_intervals, drift_intervals,
                               window_steps, pairs_per_step, seed, vllm_python, sglang_python, dict(os.environ),
                               swept, bound_drift_rebalances, optimum_layers, optimum_seconds)
        except RuntimeError as exc:
            raise click.ClickException(str(exc)) from None
        if as_json:
            click.echo(json.dumps(report))
            return report
        for scenario, policies in report["results"].items():
            for policy, f in policies.items():
                click.echo(f"{scenario:9s} {policy:26s} balancedness {min(f['balancedness_after']):.3f}-"
                           f"{max(f['balancedness_after']):.3f}  moved {f['experts_moved_total']:6d}  "
                           f"solve median {f['solve_seconds_median'] * 1e3:8.1f} ms  kept by gate "
                           f"{sum(f['layers_kept_by_gate'])}  over LP bound {_ratio(f['bound'])}"
                           f", over slack bound {_ratio(f['bound'], 'moved_over_slack_bound')}")
        click.echo("goals: " + ", ".join(f"{k} {'pass' if v else 'FAIL'}" for k, v in report["goals"].items()))
        return report

    return eplb


try:
    eplb = _eplb_command()
except ImportError:  # an engine's environment without click runs only the worker
    eplb = None


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
