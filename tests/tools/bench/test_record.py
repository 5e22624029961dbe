"""Every bench verb's result is written with its provenance: commit, command, times, cores, load and
the other processes' CPU while it ran; a busy machine is marked busy."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import click
from click.testing import CliRunner

from moewatch.tools.bench import SUBCOMMANDS, BenchGroup, bench
from moewatch.machine_load import BUSY_OTHER_CORES, MachineSample, machine_busy_seconds, other_cpu_cores, sample
from moewatch.tools.bench.record import provenance, recorded

PROVENANCE_KEYS = {"commit", "command", "started_utc", "ended_utc", "cores", "load_average_before",
                   "load_average_after", "other_cpu_cores", "own_cpu_cores", "busy"}


def _fake_bench() -> click.Command:
    @click.command("fake")
    @click.option("--n", type=int, default=1)
    def fake(n: int) -> dict:
        return {"n": n, "ratio": 1.25}

    return recorded("fake", fake)


def test_a_run_writes_one_file_with_provenance_and_never_overwrites(tmp_path):
    command = _fake_bench()
    for _ in range(2):
        out = CliRunner().invoke(command, ["--n", "3", "--results-dir", str(tmp_path)])
        assert out.exit_code == 0, out.output
    files = sorted(tmp_path.glob("fake-*.json"))
    assert len(files) == 2  # two runs in the same second: two files
    record = json.loads(files[0].read_text())
    assert record["bench"] == "fake" and record["result"] == {"n": 3, "ratio": 1.25}
    assert PROVENANCE_KEYS <= set(record["provenance"])
    prov = record["provenance"]
    assert prov["commit"] == "unknown" or len(prov["commit"].split("-")[0]) == 40
    assert prov["cores"] >= 1 and len(prov["load_average_before"]) == 3
    assert prov["started_utc"] <= prov["ended_utc"]
    assert prov["busy"] == (prov["other_cpu_cores"] >= BUSY_OTHER_CORES)


def test_no_record_writes_nothing(tmp_path):
    out = CliRunner().invoke(_fake_bench(), ["--results-dir", str(tmp_path), "--no-record"])
    assert out.exit_code == 0 and list(tmp_path.iterdir()) == []


def test_every_measuring_verb_goes_through_the_recorder():
    ctx = click.Context(bench, info_name="bench")
    assert isinstance(bench, BenchGroup)
    for name in SUBCOMMANDS:
        command = bench.get_command(ctx, name)
        names = {p.name for p in command.params}
        assert {"results_dir", "no_record"} <= names, name


def test_the_command_line_is_recorded_as_typed(tmp_path):
    group = BenchGroup(name="bench", verbs={})
    group.add_command(_fake_bench())
    original = group.get_command

    def get(ctx, name):  # the fake verb is not lazily registered; it is recorded already
        return original(ctx, name) or group.commands.get(name)

    group.get_command = get
    out = CliRunner().invoke(group, ["fake", "--n", "7", "--results-dir", str(tmp_path)])
    assert out.exit_code == 0, out.output
    record = json.loads(next(tmp_path.glob("fake-*.json")).read_text())
    assert record["provenance"]["command"].endswith("fake --n 7 --results-dir " + str(tmp_path))


def test_another_busy_process_is_seen_and_marks_the_run_busy():
    spin = "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"
    spinner = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.2)
        before = sample()
        time.sleep(1.0)
        after = sample()
    finally:
        spinner.wait()
    others = other_cpu_cores(before, after)
    assert others is not None and others >= 0.5  # the spinner held most of a core
    assert provenance("x", before, after)["busy"] is True


def test_own_cpu_is_not_counted_as_another_process():
    a = MachineSample(0.0, 0.0, 100.0, 10.0, (0.0, 0.0, 0.0))
    b = MachineSample(2.0, 2.0, 102.0, 11.9, (0.0, 0.0, 0.0))  # 2 busy s, 1.9 of them this process tree's
    assert abs(other_cpu_cores(a, b) - 0.05) < 1e-9
    assert provenance("x", a, b)["busy"] is False


def test_proc_stat_busy_seconds():
    line = "cpu  100 20 30 1000 50 5 5 10 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n"
    import os

    assert abs(machine_busy_seconds(line) - 170 / os.sysconf("SC_CLK_TCK")) < 1e-9
