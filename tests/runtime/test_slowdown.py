"""The emulated slow device (runtime/slowdown.py): the kernel really runs F times as long, outputs do
not change, the slow rank's compute_seconds say so in a real 2-rank gloo run, and the live file
changes the factor mid-run."""

from __future__ import annotations

import logging
import math
import os
import signal

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from moewatch.cli import main
from moewatch.runtime.config import ConfigError, RuntimeConfig, validate
from moewatch.runtime.ep_rank import EPEngine
from moewatch.runtime.launcher import launch
from moewatch.runtime.slowdown import Slowdown, prefix_counts, read_slowdown, run_slowed, write_slowdown
from moewatch.runtime.workload import Workload
from moewatch.runtime.model import input_batch
from moewatch.telemetry import Window


# --- configuration --------------------------------------------------------------------------------

@pytest.mark.parametrize("changes, field", [
    ({"slow_rank": 2}, "slow_rank"),
    ({"slow_rank": -1}, "slow_rank"),
    ({"slow_rank": 1.5}, "slow_rank"),
    ({"slow_factor": 0.5}, "slow_factor"),
    ({"slow_factor": math.nan}, "slow_factor"),
    ({"slow_factor": math.inf}, "slow_factor"),
    ({"slow_factor": "3"}, "slow_factor"),
    ({"slowdown_file": ""}, "slowdown_file"),
])
def test_bad_slowdown_settings_name_their_field(changes, field):
    with pytest.raises(ConfigError) as info:
        validate(RuntimeConfig(ranks=2, experts=8, **changes))
    assert info.value.field == field and str(info.value).startswith(field + ": ")


def test_sound_slowdown_settings_pass():
    validate(RuntimeConfig(ranks=2, experts=8, slow_rank=1, slow_factor=2.5, slowdown_file="/tmp/slow.json"))


@pytest.mark.parametrize("args, flag", [
    (["--slow-rank", "4"], "--slow-rank"),
    (["--slow-factor", "0.9"], "--slow-factor"),
])
def test_bad_slowdown_flags_exit_2_with_one_line(args, flag):
    result = CliRunner().invoke(main, ["runtime", "--ranks", "4"] + args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and flag in lines[0]


# --- the slowed kernel ----------------------------------------------------------------------------

def _recording_compute(calls):
    def compute(rows, segment_counts, w13, w2):
        calls.append((rows.shape[0], list(segment_counts)))
        return rows * 2.0 + len(calls)  # a different output per call: the first must be the one kept
    return compute


@pytest.mark.parametrize("factor, expected", [
    (1.0, [(10, [4, 0, 6])]),
    (3.0, [(10, [4, 0, 6])] * 3),
    (2.5, [(10, [4, 0, 6])] * 2 + [(5, [4, 0, 1])]),
    (1.2, [(10, [4, 0, 6]), (2, [2, 0, 0])]),
])
def test_the_kernel_runs_factor_times_and_the_first_output_is_kept(factor, expected):
    calls = []
    rows = torch.arange(20, dtype=torch.float32).reshape(10, 2)
    out = run_slowed(_recording_compute(calls), factor, rows, [4, 0, 6], None, None)
    assert calls == expected
    assert torch.equal(out, rows * 2.0 + 1)


def test_prefix_counts_cut_the_segments_at_the_prefix():
    assert prefix_counts([3, 0, 2, 5], 4) == [3, 0, 1, 0]
    assert prefix_counts([3, 0, 2, 5], 10) == [3, 0, 2, 5]
    assert prefix_counts([3, 2], 0) == [0, 0]


def test_engine_outputs_are_identical_with_a_slowdown():
    cfg = RuntimeConfig(ranks=1, layers=3, experts=8, top_k=2, hidden=32, ffn=48, batch_tokens=24, pad_fraction=0.1,
                        zipf=1.2)
    outputs = []
    for factor in (1.0, 3.0, 2.5):
        engine = EPEngine(cfg, 0, 1)
        engine.slow_factor = factor
        batch = Workload(cfg, 0).batch(0)
        outputs.append(engine.forward(input_batch(cfg.seed, 0, 0, cfg.batch_tokens, cfg.hidden), batch.valid,
                                      batch.expert_ids))
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])


def test_the_start_setting_slows_only_its_rank():
    cfg = RuntimeConfig(ranks=2, layers=1, experts=4, hidden=8, ffn=8, slow_rank=1, slow_factor=3.0)
    assert EPEngine(cfg, 1, 2).slow_factor == 3.0
    assert EPEngine(cfg, 0, 2).slow_factor == 1.0


# --- the live file --------------------------------------------------------------------------------

def test_write_then_read_round_trips_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "slow.json"
    write_slowdown(path, {1: 3, 0: 1.5})
    assert read_slowdown(path) == {0: 1.5, 1: 3.0}
    assert os.listdir(tmp_path) == ["slow.json"]
    with pytest.raises(ValueError, match="rank 1"):
        write_slowdown(path, {1: 0.5})
    assert read_slowdown(path) == {0: 1.5, 1: 3.0} and os.listdir(tmp_path) == ["slow.json"]


def test_the_file_overrides_the_start_setting_and_a_missing_file_gives_it_back(tmp_path):
    path = tmp_path / "slow.json"
    slow = Slowdown(rank=1, slow_rank=1, slow_factor=2.0, path=str(path))
    assert slow.refresh() == 2.0  # no file yet: the start setting
    write_slowdown(path, {0: 4.0})
    assert slow.refresh() == 1.0  # the file names another rank only: this one runs at full speed
    write_slowdown(path, {1: 5.0})
    assert slow.refresh() == 5.0
    os.unlink(path)
    assert slow.refresh() == 2.0


def test_a_bad_file_warns_once_and_keeps_the_previous_factor(tmp_path, caplog):
    path = tmp_path / "slow.json"
    slow = Slowdown(rank=0, path=str(path))
    write_slowdown(path, {0: 3.0})
    assert slow.refresh() == 3.0
    caplog.set_level(logging.WARNING, logger="moewatch.runtime.slowdown")
    for version, bad in enumerate(('{"0": 0.5}', "[1, 2]", '{"zero": 2}', "{not json", '{"0": NaN}'), start=1):
        caplog.clear()
        path.write_text(bad)  # in place, same inode: a distinct mtime marks each bad version
        os.utime(path, ns=(version * 10**9, version * 10**9))
        assert [slow.refresh() for _ in range(3)] == [3.0] * 3
        assert len(caplog.records) == 1 and "keeps factor 3" in caplog.records[0].getMessage()
    write_slowdown(path, {0: 1.5})
    assert slow.refresh() == 1.5


# --- a real 2-rank gloo group ---------------------------------------------------------------------

SIZES = dict(ranks=2, layers=2, experts=8, top_k=2, hidden=128, ffn=512, batch_tokens=128, zipf=0.0, window_steps=5,
             warmup_steps=0, threads_per_rank=1, return_windows=True, collective_timeout_s=60)


def _compute_by_rank(windows: list[dict], skip: int = 1) -> np.ndarray:
    """[W] compute seconds per pair computed, summed over layers and the windows after `skip`."""
    seconds, pairs = 0.0, 0.0
    for data in windows[skip:]:
        w = Window.from_dict(data)
        seconds = seconds + w.compute_seconds.sum(axis=0)
        pairs = pairs + w.slot_tokens.reshape(w.num_layers, w.world_size, -1).sum(axis=(0, 2))
    return seconds / pairs


def _least_compute_by_rank(windows: list[dict], skip: int = 1) -> np.ndarray:
    """[W] the least compute seconds per pair any one window after `skip` measured, per rank: other
    work on shared cores only ever adds time, so the least window is the run's own cost."""
    return np.min([_compute_by_rank([w], skip=0) for w in windows[skip:]], axis=0)


@pytest.mark.slow
def test_the_slow_rank_computes_about_factor_times_as_long_and_the_other_is_not_slowed():
    factor = 3.0
    base_run = launch(RuntimeConfig(steps=40, **SIZES)).windows
    slowed_run = launch(RuntimeConfig(steps=40, slow_rank=1, slow_factor=factor, **SIZES)).windows
    base, slowed = _compute_by_rank(base_run), _compute_by_rank(slowed_run)
    assert 0.6 < base[1] / base[0] < 1.6  # the same work takes about the same time on either rank
    assert slowed[1] / slowed[0] > 0.6 * factor
    # Across two runs, not within one: a CI run measured the fast rank's summed time 1.6 times its
    # unslowed run's, from other work on the two cores; its least window is what the slowdown sets.
    fast_slowed, fast_base = _least_compute_by_rank(slowed_run)[0], _least_compute_by_rank(base_run)[0]
    assert fast_slowed < 1.6 * fast_base, (fast_slowed, fast_base)  # the fast rank is not slowed


@pytest.mark.slow
def test_the_live_file_slows_a_rank_mid_run_then_lets_it_go(tmp_path, fake_agent):
    factor = 4.0
    path = tmp_path / "slow.json"
    changes = []  # window count at which each write happened

    def react(message, agent):
        if not isinstance(message, Window):
            return
        seen = len(agent.of_type(Window))
        if seen == 3 and not changes:
            write_slowdown(path, {1: factor})
            changes.append(seen)
        elif len(changes) == 1 and seen == changes[0] + 4:
            write_slowdown(path, {})  # every rank back to 1.0
            changes.append(seen)
        elif len(changes) == 2 and seen == changes[1] + 4:
            changes.append(seen)
            os.kill(agent.messages[0][1].pid, signal.SIGTERM)  # rank 0 stops the group at a boundary

    agent = fake_agent(react)
    result = launch(RuntimeConfig(steps=3000, slowdown_file=str(path), socket=agent.path, **SIZES))
    assert len(changes) == 3, f"the run ended after {len(result.windows)} windows"
    ratios = [r[1] / r[0] for r in (_compute_by_rank([w], skip=0) for w in result.windows)]
    before, during, after = ratios[:2], ratios[changes[0] + 1:changes[1]], ratios[changes[1] + 1:]
    # One window's ratio on two shared cores wanders (1.67 unslowed in a fresh-clone run): unslowed
    # and slowed windows are told apart at the geometric midpoint of 1 and the factor. A 5-step window
    # also takes a spike from other work now and then (3.28 in the last window after the release, in
    # a fresh-clone run, the one before it 0.94): "not slowed" reads the lesser of two windows, which
    # a slowdown still in force keeps near the factor.
    unslowed = factor ** 0.5
    assert min(before) < unslowed, ratios
    # Against the same run's own ratio before the file: the two ranks' compute differs a little even
    # unslowed (0.8-0.9 in a fresh-clone run on busy cores), and that offset is not the slowdown's.
    baseline = float(np.median(before))
    assert max(during) / baseline > 0.6 * factor, ratios
    assert min(after[-2:]) < unslowed, ratios
