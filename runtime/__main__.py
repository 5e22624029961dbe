"""`python -m moewatch.runtime`: one rank of the reference runtime, started by torchrun (contract).

    torchrun --nnodes N --nproc-per-node G --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        -m moewatch.runtime [the flags of `moewatch runtime`]

torchrun does the spawning and the rendezvous; this module reads what it exports (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), takes the EP group's size from WORLD_SIZE and
ranks_per_node from LOCAL_WORLD_SIZE, joins the process group and runs the same per-rank step loop,
probe and control as `moewatch runtime` (launcher.run_rank). Global rank 0 builds the windows, talks
to the agent (`--socket PATH` or `--socket tcp://HOST:PORT`, also MOEWATCH_SOCKET) and, at the end,
prints the group's result exactly as `moewatch runtime` does.

A peer that dies or hangs past `--collective-timeout` (a node lost mid-run or mid-migration) ends this
rank with exit status 1 and one line on stderr naming the placement it kept; a plan in flight is
answered with a failed Ack first, so the agent never waits on it.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import click

from . import cli as runtime_cli
from .config import RuntimeConfig

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
EXIT_PEER_LOST = 1


def torchrun_environment(env=os.environ) -> dict[str, int | str]:
    """The rank layout torchrun exported; ValueError naming the first missing or bad variable."""
    out: dict[str, int | str] = {}
    for name in TORCHRUN_VARIABLES:
        value = env.get(name)
        if value is None or value == "":
            raise ValueError(f"{name} is not set: start this module with torchrun "
                             "(on one machine, `moewatch runtime` spawns the ranks itself)")
        if name != "MASTER_ADDR":
            if not value.isdigit():
                raise ValueError(f"{name}={value!r} is not a non-negative integer")
            value = int(value)
        out[name] = value
    if out["WORLD_SIZE"] < 1 or out["LOCAL_WORLD_SIZE"] < 1:
        raise ValueError("WORLD_SIZE and LOCAL_WORLD_SIZE must be positive")
    if out["RANK"] >= out["WORLD_SIZE"] or out["LOCAL_RANK"] >= out["LOCAL_WORLD_SIZE"]:
        raise ValueError(f"RANK {out['RANK']} / LOCAL_RANK {out['LOCAL_RANK']} out of range")
    if out["WORLD_SIZE"] % out["LOCAL_WORLD_SIZE"]:
        raise ValueError(f"WORLD_SIZE {out['WORLD_SIZE']} does not split into nodes of LOCAL_WORLD_SIZE "
                         f"{out['LOCAL_WORLD_SIZE']} (every node must run as many ranks)")
    return out


def _given(ctx: click.Context, name: str) -> bool:
    return ctx.get_parameter_source(name) not in (None, click.core.ParameterSource.DEFAULT)


def main(placement_file, no_probe, socket_path, as_json, collective_timeout, inject_migration_failure,
         **options) -> None:
    ctx = click.get_current_context()
    try:
        env = torchrun_environment()
    except ValueError as exc:
        runtime_cli._fail(str(exc))
    world, per_node = env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]
    # torchrun owns the layout: a flag that contradicts it is a mistake, not a preference.
    for flag, name, value in (("--ranks", "ranks", world), ("--ranks-per-node", "ranks_per_node", per_node)):
        if _given(ctx, name) and options[name] != value:
            runtime_cli._fail(f"{flag}: {options[name]} contradicts torchrun's layout ({value}); leave it out")
    options.update(ranks=world, ranks_per_node=per_node)
    if options.get("link_rate_mbit") is not None:
        # The emulated links put each rank in a namespace as the launcher spawns it; torchrun spawns here.
        runtime_cli._fail("--link-rate: emulated links need `moewatch runtime` to spawn the ranks, not torchrun")
    inject = None
    if inject_migration_failure:
        try:
            inject = json.loads(inject_migration_failure)
        except json.JSONDecodeError as exc:
            runtime_cli._fail(f"--inject-migration-failure: not valid JSON ({exc.msg})")
    placement = runtime_cli._read_placement(placement_file) if placement_file else None
    cfg = RuntimeConfig(placement=placement, probe=not no_probe, socket=socket_path,
                        collective_timeout_s=collective_timeout, inject_migration_failure=inject, **options)
    runtime_cli.check_config(cfg)
    from .launcher import with_start_placement
    # Each rank derives the same map from the config: --hot-on-rank works under torchrun as well.
    sys.exit(run(with_start_placement(cfg), env, as_json))


def run(cfg: RuntimeConfig, env: dict, as_json: bool) -> int:
    """Join torchrun's group, run this rank, gather every rank's accounting on rank 0 and print it."""
    import torch
    import torch.distributed as dist

    from .launcher import PeerLost, _merge, run_rank

    rank, world, local_rank = env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]
    torch.set_num_threads(cfg.threads_per_rank or max(1, (os.cpu_count() or 1) // env["LOCAL_WORLD_SIZE"]))
    if cfg.backend == "nccl":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    dist.init_process_group(cfg.backend, init_method="env://", rank=rank, world_size=world,
                            timeout=timedelta(seconds=cfg.collective_timeout_s))
    try:
        mine = run_rank(rank, world, cfg, local_rank=local_rank)
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
    except PeerLost as exc:
        click.echo(f"moewatch runtime: {exc}", err=True)
        sys.stderr.flush()
        sys.stdout.flush()
        # The group is gone: tearing it down would wait on the dead peer; leave at once.
        os._exit(EXIT_PEER_LOST)
    if rank == 0:
        runtime_cli.echo_result(_merge(cfg, gathered), cfg, as_json)
    dist.destroy_process_group()
    return 0


def _command() -> click.Command:
    """`moewatch runtime`'s flags, plus the group's collective timeout (and a hidden fault injector)."""
    params = list(runtime_cli.runtime.params) + [
        click.Option(["--collective-timeout", "collective_timeout"], type=float, default=120.0, show_default=True,
                     help="Seconds a collective may wait for a peer before this rank gives the group up."),
        click.Option(["--inject-migration-failure", "inject_migration_failure"], default=None, hidden=True,
                     help='Tests: JSON {"rank": r, "epoch": e, "stage": "prepare|transfer|stall", ...}.'),
    ]
    return click.Command("moewatch.runtime", params=params, callback=main,
                         help="One rank of the reference EP runtime under torchrun (see the module docstring).")


if __name__ == "__main__":
    _command()(prog_name="python -m moewatch.runtime")
