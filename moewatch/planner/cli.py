"""`moewatch plan` and `moewatch whatif`: the planner and the cost model from the command line.

Bad input of any kind (options, files, sizes) exits 2 with one line on stderr; `--json` prints
JSON only on stdout.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click
import numpy as np

from ..capacity import capacity_for_target
from ..cli_contract import NamedOneLineCommand, fail_input
from ..plan import Plan
from .affinity import transitions_from_trace
from .cost import CostModel, fit as fit_cost_model, sweep
from .files import PLAN_FORMATS, read_affinity, read_load, read_plan, write_plan
from .joint import even_origins, joint_prediction
from .placement_math import contiguous_placement
from .solve import solve_placement


class _IntList(click.ParamType):
    """Comma-separated positive integers."""

    name = "N,N,..."

    def convert(self, value: Any, param: Any, ctx: Any) -> list[int]:
        if isinstance(value, list):
            return value
        try:
            items = [int(v) for v in str(value).split(",") if v.strip()]
        except ValueError:
            self.fail(f"expected comma-separated integers, got {value!r}", param, ctx)
        if not items or any(v < 1 for v in items):
            self.fail(f"expected positive integers, got {value!r}", param, ctx)
        return items


# --- moewatch plan ------------------------------------------------------------------------------

@click.command("plan", cls=NamedOneLineCommand)
@click.option("--load", "load_path", required=True, type=click.Path(),
              help="Pairs per expert: recorded windows (a folder, e.g. an engine's MOEWATCH_WINDOW_DIR, or one "
                   "window file), .npy, .json ([L][E] or {logical_count}) or SGLang's .pt stat dump.")
@click.option("--gpus", type=click.IntRange(min=1), required=True, help="GPUs (EP ranks) W.")
@click.option("--nodes", type=click.IntRange(min=1), default=1, show_default=True,
              help="Nodes the GPUs sit in (topology-aware packing and cross-node share).")
@click.option("--slots", type=click.IntRange(min=1), default=None,
              help="Physical slots P, the engine's slot count (vLLM: experts + num_redundant_experts) "
                   "(default: the current plan's, else the recorded windows' when they all agree, else experts "
                   "rounded up to a multiple of W).")
@click.option("--affinity", "affinity_path", type=click.Path(dir_okay=False), default=None,
              help="Routing trace [tokens, L, k] or transition counts [L-1, E, E] (.npy, .npz, .json).")
@click.option("--current", "current_path", type=click.Path(dir_okay=False), default=None,
              help="Plan in force (moewatch or SGLang JSON): move as few experts as the tolerance allows.")
@click.option("--format", "fmt", type=click.Choice(PLAN_FORMATS), default="moewatch", show_default=True,
              help="Plan file: moewatch JSON or SGLang --init-expert-location JSON.")
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False), help="Plan file to write.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON only.")
@click.option("--balancedness-floor", type=click.FloatRange(0.0, 1.0, min_open=True), default=0.95,
              show_default=True, help="Affinity placement keeps every layer at least this balanced.")
@click.option("--tolerance", type=click.FloatRange(0.0, 1.0, max_open=True), default=0.005, show_default=True,
              help="With --current: balancedness may trail a from-scratch solve by this share.")
@click.option("--expert-bytes", type=click.FloatRange(min=0.0), default=None,
              help="Bytes of one expert's weights (reports bytes moved).")
@click.option("--capacity-target", type=click.FloatRange(0.0, 1.0, max_open=True), default=None,
              help="Set each layer's capacity factor to the smallest whose replayed overflow stays under "
                   "this share (needs per-step loads [S, L, E]).")
@click.option("--top-k", type=click.IntRange(min=1), default=1, show_default=True,
              help="Experts per token (to report tokens per step for the capacity factor).")
@click.option("--hidden-bytes", type=click.IntRange(min=1), default=None,
              help="Bytes one pair carries (reports the capacity buffer in bytes).")
@click.option("--discount", type=click.FloatRange(min=0.0), default=0.0, show_default=True,
              help="Affinity from a trace: subtract this from every transition count (drops pairs seen "
                   "once or twice, which overfit small traces).")
@click.option("--epoch", type=click.IntRange(min=0), default=None,
              help="Epoch of the new plan (default: the current plan's + 1, else 1).")
@click.option("--link-rate", "link_rate", type=click.FloatRange(min=0.0, min_open=True), default=None,
              help="Mbit/s each rank's link carries each way: report the predicted all-to-all time of the load "
                   "under each placement (before, plan) and schedule (none, aurora); needs --hidden-bytes.")
@click.option("--rank-speed", "rank_speed_arg", default=None, metavar="S,S,...|FILE",
              help="Speed of each GPU (any scale, e.g. pairs per second) as a comma list or a JSON file "
                   "(a list, or {\"rank_speed\": [...]}): balance each rank's time, load / speed.")
def plan(load_path: str, gpus: int, nodes: int, slots: int | None, affinity_path: str | None,
         current_path: str | None, fmt: str, out_path: str, as_json: bool, balancedness_floor: float,
         tolerance: float, expert_bytes: float | None, capacity_target: float | None, top_k: int,
         hidden_bytes: int | None, discount: float, epoch: int | None, rank_speed_arg: str | None,
         link_rate: float | None = None) -> None:
    """Solve an expert placement from a load file and write the plan."""
    out = Path(out_path)
    if not out.parent.is_dir():
        fail_input(f"--out: folder {str(out.parent)!r} does not exist")
    rank_speed = None if rank_speed_arg is None else _read_rank_speed(rank_speed_arg, gpus)
    loads = read_load(load_path)
    L, E = loads.load.shape
    current = read_plan(current_path) if current_path else None
    if current is not None and current.num_layers != L:
        fail_input(f"--current: plan has {current.num_layers} layers, the load has {L}")
    if current is not None and slots is not None and current.num_slots != slots:
        fail_input(f"--slots: {slots} differs from the current plan's {current.num_slots} slots")
    if slots is None and current is None and loads.num_slots is not None:
        slots = loads.num_slots  # the slot count the engine ran with when it recorded the windows
        if slots % gpus:
            fail_input(f"--slots: the recorded windows' {slots} slots do not divide over --gpus {gpus}; give --slots")
    transitions = None
    if affinity_path:
        kind, data = read_affinity(affinity_path, L, E)
        transitions = transitions_from_trace(data, E, discount) if kind == "trace" else data
    capacity = None
    if capacity_target is not None:
        if loads.steps is None:
            fail_input("--capacity-target: needs per-step loads [steps, layers, experts]; the load file has one [L, E]")
        capacity = capacity_for_target(loads.steps, top_k, capacity_target, hidden_bytes)

    result = solve_placement(loads.load, gpus, slots, nodes,
                             current=None if current is None else current.physical_to_logical_map,
                             affinity=transitions, balancedness_floor=balancedness_floor,
                             expert_bytes=expert_bytes, tolerance=tolerance, rank_speed=rank_speed)
    summary = result.summary()
    if loads.source == "windows":
        summary["windows"] = loads.windows
    if capacity is not None:
        factor = capacity.capacity_factor
        summary["capacity"] = capacity.to_dict()
    elif current is not None:
        factor = current.capacity_factor
    else:
        factor = np.zeros(L)
    if link_rate is not None:
        if hidden_bytes is None:
            fail_input("--link-rate: needs --hidden-bytes (the bytes one pair moves) to turn pairs into seconds")
        before = current.physical_to_logical_map if current is not None else contiguous_placement(
            L, E, result.physical_to_logical_map.shape[1])
        summary["a2a_prediction"] = a2a_prediction(loads.load, before, result.physical_to_logical_map, gpus,
                                                   hidden_bytes, link_rate)
    new_epoch = epoch if epoch is not None else (current.epoch + 1 if current is not None else 1)
    new_plan = Plan(new_epoch, result.physical_to_logical_map, factor,
                    reason=f"moewatch plan ({result.method}) from {Path(load_path).name}",
                    meta={"planner": summary})
    try:
        write_plan(out, new_plan, fmt)
    except OSError as exc:
        fail_input(f"--out: cannot write {out_path} ({exc.strerror or exc})")
    summary.update(epoch=new_epoch, out=str(out), format=fmt)
    if as_json:
        click.echo(json.dumps(summary))
        return
    click.echo(_plan_text(summary))


def a2a_prediction(load: np.ndarray, before: np.ndarray, after: np.ndarray, num_gpus: int, hidden_bytes: int,
                   link_rate_mbit: float) -> dict[str, Any]:
    """The plan report's all-to-all time of the load [L, E] (one pass, dispatch + combine, every layer)
    under the placement before and the plan, each unscheduled and with Aurora's order (joint.py)."""
    seconds = joint_prediction(even_origins(load, num_gpus), {"before": before, "plan": after}, float(hidden_bytes),
                               link_rate_mbit * 1e6 / 8)
    flat = {f"{name}+{schedule}": value for name, by in seconds.items() for schedule, value in by.items()}
    best = min(flat, key=flat.get)
    return {"link_rate_mbit": link_rate_mbit, "hidden_bytes": hidden_bytes, "seconds": flat, "best": best,
            "a2a_schedule": best.split("+")[1],
            "model": "tokens even over ranks; aurora at the bound, none by fair-share fluid sharing"}


def _read_rank_speed(value: str, num_gpus: int) -> list[float]:
    """--rank-speed: "1,1,0.5", or a JSON file holding a list or {"rank_speed": [...]}, checked
    against --gpus (one line naming the flag otherwise)."""
    from .placement_math import PlacementShapeError, normalised_rank_speed

    path = Path(value)
    if path.is_file():
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            fail_input(f"--rank-speed: cannot read {value} ({exc.strerror or exc})")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            fail_input(f"--rank-speed: {value} is not valid JSON ({exc})")
        if isinstance(data, dict):
            if "rank_speed" not in data:
                fail_input(f"--rank-speed: {value} has no \"rank_speed\" key")
            data = data["rank_speed"]
        if not isinstance(data, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                 for v in data):
            fail_input(f"--rank-speed: {value} must hold a list of numbers")
        speeds = [float(v) for v in data]
    else:
        try:
            speeds = [float(v) for v in value.split(",")]
        except ValueError:
            fail_input(f"--rank-speed: expected comma-separated numbers or a JSON file, got {value!r}")
    try:
        normalised_rank_speed(speeds, num_gpus)
    except PlacementShapeError as exc:
        fail_input(f"--rank-speed: {str(exc).removeprefix('rank_speed: ')} (--gpus {num_gpus})")
    return speeds


def _plan_text(s: dict[str, Any]) -> str:
    lines = [
        f"{s['method']} plan, epoch {s['epoch']}: {s['num_layers']} layers, {s['num_slots']} slots on "
        f"{s['num_gpus']} GPUs in {s['num_nodes']} node(s), solved in {s['solve_seconds'] * 1e3:.1f} ms",
        f"balancedness {s['balancedness_before']:.4f} -> {s['balancedness_after']:.4f} "
        f"(worst layer {s['balancedness_after_min']:.4f})",
        f"time balancedness {s['time_balancedness_before']:.4f} -> {s['time_balancedness_after']:.4f}"
        + (" (load / rank speed)" if "rank_speed" in s else " (equal rank speeds)"),
        f"experts moved {s['experts_moved']} in {s['layers_changed']} layers"
        + (f" ({s['bytes_moved'] / 2**30:.2f} GiB)" if s.get("bytes_moved") is not None else ""),
        f"cross-GPU share {s['cross_gpu_share_before']:.3f} -> {s['cross_gpu_share_after']:.3f}, "
        f"cross-node share {s['cross_node_share_before']:.3f} -> {s['cross_node_share_after']:.3f}",
    ]
    if "transition_cross_gpu_share_after" in s:
        lines.append(f"consecutive-layer pairs across GPUs {s['transition_cross_gpu_share_before']:.3f} -> "
                     f"{s['transition_cross_gpu_share_after']:.3f}, across nodes "
                     f"{s['transition_cross_node_share_before']:.3f} -> {s['transition_cross_node_share_after']:.3f}")
    if "capacity" in s:
        cap = s["capacity"]["capacity_factor"]
        lines.append(f"capacity factor {min(cap):.3f}-{max(cap):.3f} for overflow <= {s['capacity']['target']:.1%}")
    if "a2a_prediction" in s:
        p = s["a2a_prediction"]
        cells = ", ".join(f"{name} {seconds * 1e3:.2f} ms" for name, seconds in p["seconds"].items())
        lines.append(f"all-to-all per pass of the load at {p['link_rate_mbit']:g} Mbit/s ({p['model']}): {cells}; "
                     f"best {p['best']}")
    lines.append(f"wrote {s['out']} ({s['format']})")
    return "\n".join(lines)


# --- moewatch whatif ----------------------------------------------------------------------------

@click.command("whatif", cls=NamedOneLineCommand)
@click.option("--experts", type=_IntList(), default="2,4,8,16,32,64,128,256,512", show_default=True,
              help="Expert counts to sweep.")
@click.option("--ranks", type=_IntList(), default=None,
              help="Rank counts to sweep (each that divides the expert count); default: experts / --experts-per-rank.")
@click.option("--experts-per-rank", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--tokens", type=_IntList(), default="256,1024,4096", show_default=True,
              help="Batch sizes (tokens per step) to sweep.")
@click.option("--top-k", type=click.IntRange(min=1), default=2, show_default=True,
              help="Experts per token (expert counts below it are skipped).")
@click.option("--hidden-bytes", type=click.IntRange(min=1), default=7168 * 2, show_default=True,
              help="Bytes one pair moves each way (hidden size x element size).")
@click.option("--ranks-per-node", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--model", "model_path", type=click.Path(dir_okay=False), default=None,
              help="Cost model parameters as JSON (see docs/planner.md).")
@click.option("--fit", "fit_paths", type=click.Path(dir_okay=False), multiple=True,
              help="Window file(s) to fit the cost model to (repeatable).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Draw predicted layer time against expert count into this PNG.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON only.")
def whatif(experts: list[int], ranks: list[int] | None, experts_per_rank: int, tokens: list[int], top_k: int,
           hidden_bytes: int, ranks_per_node: int, model_path: str | None, fit_paths: tuple[str, ...],
           plot_path: str | None, as_json: bool) -> None:
    """Sweep the cost model over experts, ranks and batch size: predicted time of one MoE layer."""
    model = _read_model(model_path) if model_path else CostModel()
    report = None
    if fit_paths:
        model, report = fit_cost_model([_read_window(p) for p in fit_paths], model)
    if plot_path and not Path(plot_path).parent.is_dir():
        fail_input(f"--plot: folder {str(Path(plot_path).parent)!r} does not exist")
    if plot_path:
        from ..commands import require_extra

        require_extra("matplotlib", "report", "`moewatch whatif --plot`")
    rows = sweep(model, experts, ranks, tokens, top_k, hidden_bytes, ranks_per_node, experts_per_rank)
    if not rows:
        fail_input("nothing to sweep: every expert count is below --top-k or no listed rank count divides it")
    best = []
    for n in tokens:
        mine = [r for r in rows if r["tokens"] == n]
        if mine:
            top = min(mine, key=lambda r: r["total"])
            best.append({"tokens": n, "experts": top["experts"], "ranks": top["ranks"], "total": top["total"]})
    if plot_path:
        _plot(rows, tokens, plot_path)
    out = {"model": model.to_dict(), "fit": None if report is None else report.to_dict(), "rows": rows,
           "fastest": best, "plot": plot_path}
    if as_json:
        click.echo(json.dumps(out))
        return
    click.echo(f"{'experts':>7} {'ranks':>5} {'tokens':>6} {'compute us':>10} {'a2a us':>9} {'layer us':>9}")
    for r in rows:
        click.echo(f"{r['experts']:>7} {r['ranks']:>5} {r['tokens']:>6} {r['compute'] * 1e6:>10.1f} "
                   f"{r['a2a'] * 1e6:>9.1f} {r['total'] * 1e6:>9.1f}")
    for b in best:
        click.echo(f"fastest at {b['tokens']} tokens: {b['experts']} experts on {b['ranks']} ranks, "
                   f"{b['total'] * 1e6:.1f} us per layer")
    if report is not None:
        click.echo(f"fitted {', '.join(report.fitted) or 'nothing'} from {report.samples_a2a} layer samples "
                   f"(r2 compute {report.r2_compute:.2f}, all-to-all {report.r2_a2a:.2f})")
    if plot_path:
        click.echo(f"wrote {plot_path}")


def _read_model(path: str) -> CostModel:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        fail_input(f"--model: cannot read {path} ({exc.strerror or exc})")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        fail_input(f"--model: {path} is not valid JSON ({exc})")
    if not isinstance(data, dict):
        fail_input(f"--model: {path} must hold an object of parameters")
    try:
        return CostModel.from_dict(data)
    except ValueError as exc:
        fail_input(f"--model: {path}: {exc}")
    raise AssertionError("unreachable")


def _read_window(path: str) -> Any:
    from ..telemetry import Window, WindowError

    try:
        blob = Path(path).read_bytes()
    except OSError as exc:
        fail_input(f"--fit: cannot read {path} ({exc.strerror or exc})")
    try:
        return Window.from_bytes(blob) if blob[:4] == b"MWW1" else Window.from_json(blob)
    except WindowError as exc:
        fail_input(f"--fit: {path}: invalid window: {exc}")
    raise AssertionError("unreachable")


def _plot(rows: list[dict[str, Any]], tokens: list[int], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n in tokens:
        mine = sorted((r for r in rows if r["tokens"] == n), key=lambda r: (r["experts"], r["ranks"]))
        if not mine:
            continue
        # one line per batch size: the fastest rank count at each expert count
        by_e: dict[int, dict[str, Any]] = {}
        for r in mine:
            if r["experts"] not in by_e or r["total"] < by_e[r["experts"]]["total"]:
                by_e[r["experts"]] = r
        xs = sorted(by_e)
        line, = ax.plot(xs, [by_e[x]["total"] * 1e6 for x in xs], marker="o", label=f"{n} tokens")
        ax.plot(xs, [by_e[x]["compute"] * 1e6 for x in xs], linestyle=":", color=line.get_color())
        low = min(xs, key=lambda x: by_e[x]["total"])
        ax.annotate("min", (low, by_e[low]["total"] * 1e6), textcoords="offset points", xytext=(0, 8),
                    ha="center", color=line.get_color())
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("experts")
    ax.set_ylabel("predicted layer time per step (us)")
    ax.set_title("MoE layer time against expert count (solid: total, dotted: expert compute)")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(plan())
