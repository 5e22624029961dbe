"""`moewatch replay WINDOWS...`: replay recorded windows through the rebalancing policies and recommend.

Exit status: 0 with a recommendation; 3 when the recording cannot carry one (too few windows, too few
rebalances at every interval, or a gain that cannot be priced: one line on stderr says which, and the
figures and result file are still written); 2 on bad input (one line, moewatch/cli_contract.py).
"""

from __future__ import annotations

import datetime as dt
import json
import shlex
import sys
from pathlib import Path
from typing import Any

import click
import numpy as np

from .. import __version__
from ..cli_contract import NamedOneLineCommand, PROG
from ..errors import InputError
from ..machine_load import load_between, sample
from ..planner.placement_math import check_sizes, contiguous_placement
from .cost_fit import busiest_pairs_per_step, fit_step_cost, migration_cost, operator_step_cost
from .engine_policies import ENGINE_POLICIES, PolicySizes, run_engine_policy
from .intervals import Interval, default_intervals, parse_intervals
from .recommend import DEFAULT_MIN_GAIN, ENGINE_OWN, PLACEMENT_FILE, alternatives, insufficient, recommend
from .replay import MOEWATCH, OFF, POLICIES, STATIC, Geometry, Recording, replay
from ..numpy_json import numpy_default
from .report import RESULT_SCHEMA, render_text, write_result
from .svg import picture
from .trace import read_trace

NO_RECOMMENDATION_EXIT = 3


class ReplayCommand(NamedOneLineCommand):
    """Keeps the arguments as given, for the result file's `command`."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["replay_args"] = list(args)
        return super().parse_args(ctx, args)


def parse_policies(text: str | None, engine: str) -> tuple[str, ...]:
    if text is None:
        return (OFF, STATIC, ENGINE_OWN[engine], MOEWATCH)
    out = []
    for name in (p.strip() for p in text.split(",")):
        if not name:
            continue
        if name not in POLICIES:
            raise InputError("--policies", f"unknown policy {name!r} (known: {', '.join(POLICIES)})")
        if name not in out:
            out.append(name)
    if not out:
        raise InputError("--policies", "no policy given")
    return tuple(out if OFF in out else [OFF, *out])  # every gain is measured against "off"


@click.command("replay", cls=ReplayCommand)
@click.argument("windows", nargs=-1, required=True, type=click.Path())
@click.option("--engine", type=click.Choice(sorted(ENGINE_OWN)), default=None,
              help="The engine to advise (its own policy is replayed, its settings printed) [default: the windows' "
                   "runtime when it is vllm or sglang, else vllm].")
@click.option("--policies", default=None, metavar="P[,P...]",
              help=f"Of {', '.join(POLICIES)} [default: off, static, the engine's own, moewatch]; off is always in.")
@click.option("--intervals", default=None, metavar="N[,N...]",
              help="Rebalance intervals: steps (3000) or windows (4w) [default: 1w, 2w, 4w, ... while each still "
                   "rebalances twice in the recording].")
@click.option("--ranks", type=click.IntRange(min=1), default=None, help="EP ranks W [default: the windows'].")
@click.option("--slots", type=click.IntRange(min=1), default=None,
              help="Physical slots P (experts + redundant) [default: the windows'].")
@click.option("--nodes", type=click.IntRange(min=1), default=None,
              help="Nodes the ranks sit in [default: the windows'].")
@click.option("--groups", type=click.IntRange(min=1), default=1, show_default=True,
              help="Expert groups (DeepSeek-V3's n_group), passed to the engines' policies.")
@click.option("--seconds-per-pair", type=click.FloatRange(min=0.0, min_open=True), default=None,
              help="Seconds a step saves per busiest-GPU pair it loses, instead of the fit to the windows.")
@click.option("--step-seconds", type=click.FloatRange(min=0.0, min_open=True), default=None,
              help="Mean seconds of a step, for windows without a step clock (SGLang's dumps): the serving time "
                   "net seconds are counted per hour of (never used in the fit).")
@click.option("--expert-bytes", type=click.FloatRange(min=0.0, min_open=True), default=None,
              help="Bytes of one expert's weights [default: measured from the windows' rebalance records, else "
                   "assumed].")
@click.option("--migration-rate", type=click.FloatRange(min=0.0, min_open=True), default=None,
              help="Bytes per second expert weights move at [default: measured in the windows, else assumed].")
@click.option("--min-gain", type=click.FloatRange(0.0, 1.0), default=DEFAULT_MIN_GAIN, show_default=True,
              help="Share of the serving time a rebalancing choice must buy to be recommended over EPLB off.")
@click.option("--vllm-python", default=sys.executable, show_default="this Python",
              help="A Python with vLLM and moewatch installed (vLLM's own policy runs there).")
@click.option("--sglang-python", default=sys.executable, show_default="this Python",
              help="A Python with SGLang and moewatch installed (SGLang's own algorithm runs there).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Folder for replay.json (the result), replay.svg (the picture) and the static placement file.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON only.")
@click.pass_context
def replay_command(ctx: click.Context, windows, engine, policies, intervals, ranks, slots, nodes, groups,
                   seconds_per_pair, step_seconds, expert_bytes, migration_rate, min_gain, vllm_python, sglang_python,
                   out_dir, as_json) -> None:
    """Replay recorded windows through the engines' own rebalancing and moewatch's, at several intervals, and
    recommend EPLB on or off, a policy and an interval, or a static placement."""
    before = sample()
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")

    def progress(message: str) -> None:
        click.echo(f"replay: {message}", err=True)

    trace = read_trace(windows)
    engine = engine or (trace.runtime if trace.runtime in ENGINE_OWN else "vllm")
    chosen = parse_policies(policies, engine)
    spans = parse_intervals(intervals) if intervals else default_intervals(trace.num_windows)
    configured = (trace.rebalancing or {}).get("interval_steps")
    if not intervals and isinstance(configured, int) and configured > 0 and Interval(configured, "steps") not in spans:
        spans = (*spans, Interval(configured, "steps"))  # the interval the engine ran with, when it says
    W = ranks or trace.world_size
    P = slots or trace.num_slots
    if nodes is not None:
        N = nodes
    else:  # the recording's nodes when its ranks are replayed, else one node
        N = max(1, trace.world_size // max(trace.ranks_per_node, 1)) if ranks is None else 1
    check_sizes(trace.num_experts, P, W, N)
    if trace.num_experts % groups:
        raise InputError("--groups", f"{groups} expert groups do not divide the windows' {trace.num_experts} experts")
    recorded_map = trace.maps[0]
    initial = (recorded_map if recorded_map.shape[1] == P
               else contiguous_placement(trace.num_layers, trace.num_experts, P))
    geometry = Geometry(P, W, N, groups, initial.astype(np.int64))
    progress(f"{trace.num_windows} windows, {trace.total_steps} steps; replaying at {W} ranks, {P} slots")

    # The cost model is fitted where the step times were measured: the recorded deployment and its maps.
    recorded_busiest = busiest_pairs_per_step(trace.loads, trace.maps, trace.steps, trace.world_size)
    step_cost = (operator_step_cost(seconds_per_pair) if seconds_per_pair is not None
                 else fit_step_cost(recorded_busiest, trace.step_tokens, trace.step_seconds))
    migration = migration_cost(trace.rebalance_records, trace.step_times, expert_bytes, migration_rate)
    pythons = {"vllm_default": vllm_python, "sglang_deepseek": sglang_python}
    sizes = PolicySizes(P, W, N, groups)

    def run_engine(policy: str, sequences: dict[str, np.ndarray]):
        progress(f"{policy}: calling {ENGINE_POLICIES[policy]}'s own function in {pythons[policy]}")
        return run_engine_policy(policy, pythons[policy], sequences, geometry.initial, sizes)

    serving = trace.step_seconds if step_seconds is None else np.where(np.isfinite(trace.step_seconds),
                                                                         trace.step_seconds, step_seconds)
    got = replay(Recording(trace.loads, trace.steps, serving), geometry, chosen, spans, step_cost, migration,
                 run_engine, progress)
    static_map = got.pop("static_map", None)
    serving_known = got["policies"][OFF]["-"]["serving_seconds"] is not None
    reason = insufficient(trace.num_windows, got, step_cost.known, serving_known)
    context = {"num_experts": trace.num_experts, "slots": P, "ranks": W, "nodes": N, "load_paths": list(windows),
               "seconds_per_pair": step_cost.seconds_per_busiest_pair, "expert_bytes": migration.expert_bytes,
               "bytes_per_second": migration.bytes_per_second}
    advice = None if reason else recommend(got, engine, context, min_gain)
    files: dict[str, str] = {}
    if out_dir is not None and static_map is not None:
        files["placement"] = _write_placement(Path(out_dir), engine, static_map, trace.num_layers)
    result: dict[str, Any] = {
        "schema": RESULT_SCHEMA,
        "command": shlex.join([PROG, "replay", *ctx.meta.get("replay_args", [])]),
        "moewatch_version": __version__,
        "started_utc": started,
        "engine": engine,
        "inputs": {"files": list(trace.files), "digest": trace.digest, "windows": trace.num_windows,
                   "steps": trace.total_steps, "runtime": trace.runtime, "model": trace.model,
                   "ep_group": trace.ep_group, "layers": trace.num_layers, "experts": trace.num_experts,
                   "recorded": {"ranks": trace.world_size, "slots": trace.num_slots,
                                "ranks_per_node": trace.ranks_per_node},
                   "engine_rebalancing": trace.rebalancing, "rebalance_records": len(trace.rebalance_records),
                   "refused_shards": trace.refused_shards},
        "geometry": {"ranks": W, "slots": P, "nodes": N, "groups": groups,
                     "initial": "recorded" if initial is recorded_map else "contiguous"},
        "step_cost": step_cost.to_dict(),
        "migration": migration.to_dict(),
        **got,
        "min_gain": min_gain,
        "notes": (["one rank: every placement balances the same; pass --ranks (and --slots) for the EP size you "
                   "plan"] if W == 1 else [])
        + ([f"{trace.refused_shards} shard(s) disagreed with the rest of their window and were left out, as the "
            "agent leaves them out"] if trace.refused_shards else []),
        "recommendation": None if advice is None else advice.to_dict(),
        "alternatives": {} if reason else alternatives(got, engine, context),
        "no_recommendation": reason,
    }
    result["machine"] = load_between(before, sample())
    if out_dir is not None:
        files.update(write_result(Path(out_dir), result, picture(result)))
    if as_json:
        click.echo(json.dumps(result, allow_nan=False, default=numpy_default))
    else:
        click.echo(render_text(result), nl=False)
        for name, path in files.items():
            click.echo(f"wrote {path}")
    if advice is None:
        click.echo(f"{PROG}: replay: no recommendation: {reason}", err=True)
        ctx.exit(NO_RECOMMENDATION_EXIT)


def _write_placement(out_dir: Path, engine: str, pmap: np.ndarray, num_layers: int) -> str:
    """The static placement as `moewatch plan` writes it (SGLang's --init-expert-location JSON for SGLang)."""
    from ..plan import Plan
    from ..planner.files import write_plan

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / PLACEMENT_FILE[engine]
    write_plan(path, Plan(1, pmap, np.zeros(num_layers), reason="moewatch replay: static placement from the windows"),
               "sglang" if engine == "sglang" else "moewatch")
    return str(path)

