"""`moewatch bench probe`: what the probe costs the forward step, measured on the runtime itself.

One spawned EP group, one model. Steps (or short blocks of them) run alternately with the probe
attached and detached (ABBA order, so a drift in machine load hits both sides alike); both sides of a
pair replay the same batch, one right after the other. The probe-on steps of a window (its flush included: the all_reduce, building and
validating the Window, handing it over) are compared with the probe-off steps interleaved with them.
A step's time is that of its slowest rank. overhead_ratio = the median over windows of (probe-on
time / probe-off time); the ratio of the overall means is reported beside it, and so is the time
spent inside the probe's own calls per step over the probe-off step time (self_time_ratio): a
second, low-noise figure on the CPU, where all the probe's work is host work.
"""

from __future__ import annotations

import json
import os
import platform
import time

import click
import numpy as np
import torch

from moewatch.cli_contract import OneLineCommand, fail_input
from moewatch.runtime.cli import execution_options
from moewatch.runtime.config import ConfigError, RuntimeConfig, validate


class _SelfTimedProbe:
    """Forwards to the probe and sums the time spent inside its calls: the probe's own work is host
    work on the CPU, so this is a low-noise second figure for what it adds to a step."""

    def __init__(self, probe):
        self.probe = probe
        self.seconds = 0.0

    def _timed(self, method, *args):
        t0 = time.perf_counter()
        out = method(*args)
        self.seconds += time.perf_counter() - t0
        return out

    def begin_step(self, num_tokens):
        return self._timed(self.probe.begin_step, num_tokens)

    def mark(self, layer, mark):
        return self._timed(self.probe.mark, layer, mark)

    def record_layer(self, *args):
        return self._timed(self.probe.record_layer, *args)

    def end_step(self):
        return self._timed(self.probe.end_step)


def _bench_rank(rank: int, world_size: int, cfg: RuntimeConfig, windows_measured: int, block: int, window: int,
                warmup: int) -> dict:
    from moewatch.runtime.ep_rank import EPEngine
    from moewatch.runtime.launcher import build_probe
    from moewatch.runtime.model import input_batch
    from moewatch.runtime.workload import Workload

    device = torch.device("cuda", rank % torch.cuda.device_count()) if cfg.backend == "nccl" else torch.device("cpu")
    windows = []
    probe = build_probe(cfg.replace(window_steps=window, window_seconds=None), rank, world_size, device,
                        sinks=[lambda w: windows.append(w.steps)])
    engine = EPEngine(cfg, rank, world_size, device=device, probe=probe)
    probe.set_placement(engine.epoch, engine.placement, engine.capacity)
    workload = Workload(cfg, rank)
    timed = _SelfTimedProbe(probe)

    def run_block(with_probe: bool, first_step: int) -> list[float]:
        engine.probe = timed if with_probe else None
        times = []
        for step in range(first_step, first_step + block):
            batch = workload.batch(step)
            x = input_batch(cfg.seed, step, rank, cfg.batch_tokens, cfg.hidden)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            if with_probe:
                timed.begin_step(batch.num_tokens)
            engine.forward(x, batch.valid, batch.expert_ids)
            if with_probe:
                timed.end_step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        return times

    for i in range(max(1, -(-warmup // block))):
        run_block(True, i * block)
        run_block(False, i * block)
    while probe.steps_pending:  # start measuring on a window boundary
        run_block(True, 0)
    timed.seconds = 0.0
    on: list[list[float]] = []
    off: list[list[float]] = []
    for i in range(windows_measured * (window // block)):
        # Both blocks of a pair replay the same batches; ABBA order cancels a drift in machine load.
        order = (True, False) if i % 2 == 0 else (False, True)
        for with_probe in order:
            (on if with_probe else off).append(run_block(with_probe, (i + 1000) * block))
    return {"on": on, "off": off, "windows": len(windows), "invalid": probe.windows_invalid,
            "probe_seconds": timed.seconds}


def measure(cfg: RuntimeConfig, windows: int, block: int, window: int, warmup: int) -> dict:
    from moewatch.runtime.launcher import run_group

    per_rank = run_group(cfg.ranks, _bench_rank, (cfg, windows, block, window, warmup), backend=cfg.backend,
                         threads_per_rank=cfg.threads_per_rank, timeout_s=cfg.collective_timeout_s)
    # [windows, steps per window] step times of the slowest rank, with and without the probe.
    on = np.max(np.array([r["on"] for r in per_rank]), axis=0).reshape(windows, window)
    off = np.max(np.array([r["off"] for r in per_rank]), axis=0).reshape(windows, window)
    window_ratios = on.sum(axis=1) / off.sum(axis=1)
    return {
        # Per window's worth of steps (its flush included once), probe-on time over the probe-off time
        # of the same batches interleaved with them; the median over windows shrugs off other
        # processes' bursts on a shared machine, the ratio of means does not.
        "overhead_ratio": float(np.median(window_ratios)),
        "overhead_ratio_of_means": float(on.mean() / off.mean()),
        "overhead_ratio_p10_p90": [float(np.percentile(window_ratios, 10)), float(np.percentile(window_ratios, 90))],
        # Time inside the probe's calls per probe-on step (the busiest rank), over the probe-off step.
        "probe_seconds_per_step": max(r["probe_seconds"] for r in per_rank) / on.size,
        "self_time_ratio": 1.0 + max(r["probe_seconds"] for r in per_rank) / on.size / float(off.mean()),
        "step_mean_s_probe_on": float(on.mean()),
        "step_mean_s_probe_off": float(off.mean()),
        "step_p50_s_probe_on": float(np.median(on)),
        "step_p50_s_probe_off": float(np.median(off)),
        "windows": windows, "window_steps": window, "block_steps": block, "steps_measured": int(on.size + off.size),
        "windows_built": per_rank[0]["windows"], "windows_invalid": per_rank[0]["invalid"],
        "config": {k: v for k, v in cfg.to_dict().items()
                   if k in ("ranks", "layers", "experts", "slots", "top_k", "hidden", "ffn", "batch_tokens",
                            "capacity_factor", "overflow", "zipf", "kernel", "backend", "dtype", "seed")},
        "machine": {"device": torch.cuda.get_device_name(0) if cfg.backend == "nccl" else platform.processor() or "cpu",
                    "cpus": os.cpu_count(), "torch": torch.__version__},
    }


@click.command("probe", cls=OneLineCommand)
@click.option("--ranks", type=int, default=2, show_default=True)
@click.option("--layers", type=int, default=8, show_default=True)
@click.option("--experts", type=int, default=32, show_default=True)
@click.option("--top-k", "top_k", type=int, default=2, show_default=True)
@click.option("--hidden", type=int, default=128, show_default=True)
@click.option("--ffn", type=int, default=256, show_default=True)
@click.option("--batch-tokens", "batch_tokens", type=int, default=256, show_default=True)
@click.option("--capacity-factor", "capacity_factor", type=float, default=0.0, show_default=True)
@click.option("--overflow", type=click.Choice(["drop", "reroute"]), default="drop", show_default=True)
@click.option("--zipf", type=float, default=1.0, show_default=True)
@click.option("--windows", type=int, default=12, show_default=True, help="Windows' worth of steps measured each way.")
@click.option("--window-steps", "window_steps", type=int, default=50, show_default=True,
              help="Steps per Window (the runtime's default is 50).")
@click.option("--block-steps", "block_steps", type=int, default=1, show_default=True,
              help="Steps run in a row before switching the probe on or off (divides --window-steps).")
@click.option("--warmup-steps", "warmup_steps", type=int, default=20, show_default=True)
@execution_options
def probe(windows, window_steps, block_steps, warmup_steps, as_json, **options) -> dict:
    """Probe overhead: step time with the probe on over step time with it off, alternating in one run."""
    cfg = RuntimeConfig(**options)
    try:
        validate(cfg)
        if windows < 1 or block_steps < 1 or warmup_steps < 0:
            raise ConfigError("windows", "--windows and --block-steps must be positive, --warmup-steps >= 0")
        if window_steps % block_steps:
            raise ConfigError("block_steps", f"{block_steps} does not divide --window-steps {window_steps}")
    except ConfigError as exc:
        fail_input(f"bench probe: --{exc.field.replace('_', '-')}: {str(exc).split(': ', 1)[1]}")
    if cfg.backend == "nccl" and not torch.cuda.is_available():
        fail_input("bench probe: --backend nccl needs CUDA GPUs; none is visible")
    steps = warmup_steps + 2 * windows * window_steps
    click.echo(f"moewatch bench probe: {cfg.ranks} {cfg.backend} ranks, {warmup_steps} warm-up steps, then "
               f"{2 * windows * window_steps} steps alternating the probe on and off "
               f"({steps} in all)", err=True)
    result = measure(cfg, windows, block_steps, window_steps, warmup_steps)
    if as_json:
        click.echo(json.dumps(result))
        return result
    click.echo(f"probe overhead ratio {result['overhead_ratio']:.4f} (median of {windows} windows; ratio of means "
               f"{result['overhead_ratio_of_means']:.4f}); step mean {result['step_mean_s_probe_on'] * 1e3:.2f} ms "
               f"on vs {result['step_mean_s_probe_off'] * 1e3:.2f} ms off over {result['steps_measured']} steps")
    return result
