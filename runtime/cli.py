"""`moewatch runtime`: spawn the reference EP runtime on this machine, drive a workload, report latency.

Flags map one to one onto RuntimeConfig fields (docs/runtime.md lists them). Bad input exits 2 with
one line; `--json` prints only the result object.
"""

from __future__ import annotations

import json
import os
import sys

import click

from moewatch.cli_contract import NamedOneLineCommand, fail_input

from .config import ConfigError, RuntimeConfig, validate


def _fail(message: str) -> None:
    fail_input(f"runtime: {message}")


def execution_options(command):
    """How the ranks run (kernel, backend, dtype, threads, seed) and --json: shared with `bench probe`."""
    for option in reversed([
        click.option("--kernel", type=click.Choice(["torch", "triton"]), default="torch", show_default=True),
        click.option("--backend", type=click.Choice(["gloo", "nccl"]), default="gloo", show_default=True),
        click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32",
                     show_default=True),
        click.option("--threads-per-rank", "threads_per_rank", type=int, default=None),
        click.option("--seed", type=int, default=0, show_default=True),
        click.option("--json", "as_json", is_flag=True, help="Print only the result as JSON."),
    ]):
        command = option(command)
    return command


@click.command("runtime", cls=NamedOneLineCommand)
@click.option("--ranks", type=int, default=4, show_default=True, help="EP ranks (processes) W.")
@click.option("--layers", type=int, default=8, show_default=True, help="MoE layers L.")
@click.option("--experts", type=int, default=32, show_default=True, help="Logical experts E per layer.")
@click.option("--slots", type=int, default=None, help="Physical slots P (>= E, divisible by W); default E.")
@click.option("--top-k", "top_k", type=int, default=2, show_default=True, help="Experts per token k.")
@click.option("--hidden", type=int, default=128, show_default=True, help="Hidden size d.")
@click.option("--ffn", type=int, default=256, show_default=True, help="Expert FFN size.")
@click.option("--ranks-per-node", "ranks_per_node", type=int, default=None, help="Ranks per node (default: all).")
@click.option("--score", type=click.Choice(["softmax", "sigmoid"]), default="softmax", show_default=True)
@click.option("--steps", type=int, default=200, show_default=True, help="Forward steps (0: run for --seconds).")
@click.option("--seconds", type=float, default=None, help="Stop after this many seconds.")
@click.option("--warmup-steps", "warmup_steps", type=int, default=2, show_default=True,
              help="Steps left out of the latency and throughput figures.")
@click.option("--batch-tokens", "batch_tokens", type=int, default=256, show_default=True,
              help="Token slots per rank per step.")
@click.option("--pad-fraction", "pad_fraction", type=float, default=0.0, show_default=True,
              help="Share of each batch that is padding (never counted).")
@click.option("--capacity-factor", "capacity_factor", type=float, default=0.0, show_default=True,
              help="C: capacity ceil(C*N*k/E) per expert; 0 is dropless.")
@click.option("--overflow", type=click.Choice(["drop", "reroute"]), default="drop", show_default=True)
@click.option("--workload", type=click.Choice(["zipf", "drift", "trace"]), default="zipf", show_default=True)
@click.option("--zipf", type=float, default=1.0, show_default=True, help="Zipf exponent of expert popularity.")
@click.option("--hot-experts", "hot_experts", type=int, default=0, show_default=True)
@click.option("--hot-share", "hot_share", type=float, default=0.5, show_default=True,
              help="Share of pairs the hot experts carry together.")
@click.option("--drift-every", "drift_every", type=int, default=50, show_default=True,
              help="Steps between moves of the hot set (--workload drift).")
@click.option("--affinity", type=float, default=0.0, show_default=True,
              help="Probability a token's next-layer expert follows its current one.")
@click.option("--trace", type=click.Path(dir_okay=False), default=None, help=".npy [tokens, layers, top_k] expert ids.")
@click.option("--router", type=click.Choice(["learned", "synthetic"]), default="synthetic", show_default=True)
@click.option("--placement", "placement_file", type=click.Path(dir_okay=False), default=None,
              help="JSON file with physical_to_logical_map [L][P] in force at start.")
@click.option("--hot-on-rank", "hot_on_rank", type=int, default=None,
              help="Start with each layer's hot experts on this rank (a skewed start for the agent to fix).")
@click.option("--migrate-layers-per-step", "migrate_layers_per_step", type=int, default=1, show_default=True)
@click.option("--socket", "socket_path", default=None, envvar="MOEWATCH_SOCKET",
              help="The agent's unix socket, or tcp://HOST:PORT of its TCP listener (the runtime connects to it).")
@click.option("--window-steps", "window_steps", type=int, default=None, help="Steps per Window (default 50).")
@click.option("--window-seconds", "window_seconds", type=float, default=None, help="About this many seconds per Window.")
@click.option("--windows-out", "windows_out", type=click.Path(dir_okay=False), default=None,
              help="Append every Window as a JSON line to this file.")
@click.option("--no-probe", "no_probe", is_flag=True, help="Run without the probe.")
@click.option("--slow-rank", "slow_rank", type=int, default=None,
              help="Emulate a slow device: this rank's expert compute takes --slow-factor times as long.")
@click.option("--slow-factor", "slow_factor", type=float, default=1.0, show_default=True,
              help="How many times as long the slow rank's expert compute takes (>= 1).")
@click.option("--slowdown-file", "slowdown_file", type=click.Path(dir_okay=False), default=None,
              help='JSON {"<rank>": factor}, re-read live when it changes; overrides --slow-rank.')
@click.option("--a2a-schedule", "a2a_schedule", type=click.Choice(["none", "aurora"]), default="none",
              show_default=True,
              help="aurora: move the all-to-all's rows in rounds where each rank sends to one rank and receives "
                   "from one (Aurora's order); outputs unchanged.")
@click.option("--link-rate", "link_rate_mbit", type=float, default=None,
              help="Emulated links (root, ip and tc): each rank in its own network namespace, its link shaped "
                   "to this many Mbit/s each way; the measured rates give each layer's all-to-all bound.")
@click.option("--model-name", "model_name", default="moewatch-ref", show_default=True)
@click.option("--ep-group", "ep_group", default="ep0", show_default=True)
@execution_options
def runtime(placement_file, no_probe, socket_path, as_json, **options) -> None:
    """Launch the reference EP runtime on this machine and report step latency and throughput."""
    placement = None
    if placement_file:
        placement = _read_placement(placement_file)
    cfg = RuntimeConfig(placement=placement, probe=not no_probe, socket=socket_path, **options)
    check_config(cfg)
    from .launcher import GroupError, launch
    from .netlinks import LinkError
    try:
        result = launch(cfg)
    except ConfigError as exc:
        _fail(f"--{exc.field.replace('_', '-')}: {str(exc).split(': ', 1)[1]}")
    except LinkError as exc:
        _fail(f"--link-rate: {exc}")
    except GroupError as exc:
        click.echo(f"moewatch runtime: {exc}", err=True)
        sys.exit(1)
    echo_result(result, cfg, as_json)


def check_config(cfg: RuntimeConfig) -> None:
    """Exit 2 with one line naming the flag when the config cannot run here (also `python -m moewatch.runtime`)."""
    try:
        validate(cfg)
    except ConfigError as exc:
        _fail(f"--{exc.field.replace('_', '-')}: {str(exc).split(': ', 1)[1]}")
    if cfg.kernel == "triton" and cfg.backend != "nccl" and os.environ.get("TRITON_INTERPRET") != "1":
        _fail("--kernel triton needs a GPU (--backend nccl) or TRITON_INTERPRET=1")
    if cfg.backend == "nccl":
        import torch
        if not torch.cuda.is_available():
            _fail("--backend nccl needs CUDA GPUs; none is visible")
    if cfg.link_rate_mbit is not None:
        from .netlinks import LinkError, check_can_emulate
        try:
            check_can_emulate()
        except LinkError as exc:
            _fail(f"--link-rate: {exc}")


def echo_result(result, cfg: RuntimeConfig, as_json: bool) -> None:
    """The run's report on stdout: JSON only with --json, else a few lines (also `python -m moewatch.runtime`)."""
    from .launcher import result_json
    if as_json:
        click.echo(result_json(result))
        return
    click.echo(f"{result.steps} steps on {cfg.ranks} ranks ({result.measured_steps} measured): "
               f"step p50 {result.step_p50_s * 1e3:.2f} ms, p99 {result.step_p99_s * 1e3:.2f} ms, "
               f"{result.tokens_per_s:,.0f} tokens/s")
    click.echo(f"pairs: {result.pairs_routed} routed, {result.pairs_computed} computed, "
               f"{result.pairs_dropped} dropped, {result.pairs_rerouted} rerouted, {result.pairs_lost} lost")
    click.echo(f"epoch {result.epoch}; plans applied {result.plans_applied}, refused {result.plans_refused}, "
               f"failed {result.plans_failed}; windows {result.windows_built}")
    b = result.cpu_binding
    if b.get("pinned"):
        click.echo(f"cores: each rank pinned to its own ({b['rank_cores']}, by rank), {b['threads_per_rank']} thread(s) each")
    elif b:
        click.echo(f"cores: not pinned: {b['warning']}")
    if result.links is not None:
        measured = ", ".join(f"{v * 8 / 1e6:.0f}" for v in result.links["link_bytes_per_second"])
        click.echo(f"links: {result.links['rate_mbit']:g} Mbit/s asked, measured per rank {measured} Mbit/s")
    if result.a2a is not None and result.a2a["over_bound_per_layer"] is not None:
        over = ", ".join(f"{v:.2f}" for v in result.a2a["over_bound_per_layer"])
        click.echo(f"all-to-all ({result.a2a['schedule']}): time over bound per layer {over}")
    if result.sender is not None:
        s = result.sender
        click.echo(f"agent link: {s['frames_sent']} frames sent, {s['frames_dropped']} dropped, "
                   f"{s['connects']} connections, {s['plans_received']} plans received")


def _read_placement(path: str):
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except OSError as exc:
        _fail(f"--placement: {path}: cannot read ({exc.strerror})")
    except json.JSONDecodeError as exc:
        _fail(f"--placement: {path}: not valid JSON ({exc.msg})")
    pmap = data.get("physical_to_logical_map") if isinstance(data, dict) else data
    if not isinstance(pmap, list):
        _fail(f"--placement: {path}: expected physical_to_logical_map [L][P]")
    return pmap
