"""`moewatch report WINDOW --out FILE.png`: one picture of a window, the way an operator looks at it.

Four panels: per-layer time split (dispatch, compute, combine) coloured by verdict; rank load per
layer over the mean (the straggler shows as a hot cell); expert load per layer over the mean (hot
experts); cross-rank ratio against the placement's prediction.
"""

from __future__ import annotations

from pathlib import Path

import click
import numpy as np

from . import telemetry as tm
from .cli_contract import OneLineCommand, fail_input
from .commands import load_window, require_extra
from .telemetry import Window
from .thresholds import ConfigError, thresholds_from_cli, thresholds_options
from .triage import WindowDiagnosis, diagnose
from .vocabulary import HEX_COLOURS



def draw(window: Window, result: WindowDiagnosis, out: Path) -> Path:
    """Write the four-panel picture to `out` (PNG) and return it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L = window.num_layers
    steps = max(window.steps, 1)
    layers = np.arange(L)
    fig, axes = plt.subplots(2, 2, figsize=(14, 9), constrained_layout=True)
    ident = result.identity
    fig.suptitle(f"{ident['model']} / {ident['ep_group']}  epoch {ident['epoch']}  "
                 f"{ident['num_experts']} experts, {ident['num_slots']} slots, {ident['world_size']} ranks, "
                 f"{ident['steps']} steps", fontsize=12)

    ax = axes[0, 0]
    if window.has("dispatch_seconds", "compute_seconds", "combine_seconds"):
        dispatch = window.dispatch_seconds.max(axis=1) / steps * 1e3
        compute = window.compute_seconds.max(axis=1) / steps * 1e3
        combine = window.combine_seconds.max(axis=1) / steps * 1e3
        ax.bar(layers, dispatch, label="dispatch", color="#5b8def")
        ax.bar(layers, compute, bottom=dispatch, label="expert compute", color="#9e9e9e")
        ax.bar(layers, combine, bottom=dispatch + compute, label="combine (incl. wait)", color="#90caf9")
        tops = dispatch + compute + combine
        ax.legend(fontsize=8)
    else:
        tops = np.zeros(L)
        _not_measured(ax, "dispatch, compute and combine times")
    for d in result.layers:
        ax.annotate(d.verdict.split("-")[0] + (f"\n{d.cause}" if d.cause else ""),
                    (d.layer, tops[d.layer]), ha="center", va="bottom", fontsize=7,
                    color=HEX_COLOURS[d.verdict])
    ax.set_title("Per-step time by layer (slowest rank), verdict above")
    ax.set_xlabel("layer")
    ax.set_ylabel("ms per step")

    ax = axes[0, 1]
    load = tm.rank_load(window)
    if load is not None:
        load = load.astype(np.float64)
        mean = load.mean(axis=1, keepdims=True)
        ratio = np.divide(load, mean, out=np.ones_like(load), where=mean > 0)
        im = ax.imshow(ratio.T, aspect="auto", cmap="RdBu_r", vmin=0, vmax=2, origin="lower")
        fig.colorbar(im, ax=ax, label="rank load / mean")
    else:
        _not_measured(ax, "rank load (slot_tokens, local + received or rank_tokens)")
    ax.set_title("Rank load over the mean (red: straggler)")
    ax.set_xlabel("layer")
    ax.set_ylabel("rank")

    ax = axes[1, 0]
    if window.expert_tokens is not None:
        experts = window.expert_tokens.astype(np.float64)
        emean = experts.mean(axis=1, keepdims=True)
        eratio = np.divide(experts, emean, out=np.ones_like(experts), where=emean > 0)
        im = ax.imshow(eratio.T, aspect="auto", cmap="magma", vmin=0, vmax=max(3.0, float(eratio.max())),
                       origin="lower", interpolation="nearest")
        fig.colorbar(im, ax=ax, label="expert load / mean")
    else:
        _not_measured(ax, "expert load (expert_tokens; the window carries per-rank totals)")
    ax.set_title("Expert load over the mean (bright: hot experts)")
    ax.set_xlabel("layer")
    ax.set_ylabel("logical expert")

    ax = axes[1, 1]
    # Absent evidence is left off the plot (and out of the legend), never drawn as zero.
    for values, style, label in ((tm.cross_rank_ratio(window), "o-", "measured"),
                                 (tm.expected_cross_rank_ratio(window), "s--", "placement predicts"),
                                 (tm.a2a_share(window), "^:", "all-to-all share of layer time"),
                                 (tm.balancedness(window), "d-.", "balancedness (mean/max)")):
        if values is not None:
            ax.plot(layers, values, style, label=label)
    ax.axhline(0.5, color="#999", lw=0.8)
    ax.set_ylim(0, 1.05)
    ax.set_title("Cross-rank ratio, all-to-all share, balancedness")
    ax.set_xlabel("layer")
    ax.legend(fontsize=8)

    from matplotlib.ticker import MaxNLocator

    for ax in axes.flat:  # layers, ranks and experts are whole numbers
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (axes[0, 1], axes[1, 0]):
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _not_measured(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"not measured in this window:\n{what}", ha="center", va="center",
            transform=ax.transAxes, color="#777")


@click.command(cls=OneLineCommand)
@click.argument("source")
@click.option("--out", "out_path", type=click.Path(dir_okay=False), required=True, help="PNG file to write.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="YAML file of thresholds.")
@thresholds_options
def report(source: str, out_path: str, config_path: str | None, **threshold_flags) -> None:
    """Draw SOURCE (a window file) as one picture: time split, rank and expert load, traffic."""
    require_extra("matplotlib", "report", "`moewatch report`")
    try:
        thresholds = thresholds_from_cli(config_path, **threshold_flags)
    except ConfigError as exc:
        fail_input(str(exc))
    window = load_window(source)
    path = draw(window, diagnose(window, thresholds), Path(out_path))
    click.echo(str(path))
