"""`python -m moewatch.runtime` outside and inside torchrun's environment: bad input exits 2 with one
line naming what is wrong, before any process group is joined; a one-process group runs in-process."""

from __future__ import annotations

import json
import signal

import pytest
from click.testing import CliRunner

from moewatch.runtime.__main__ import _command, torchrun_environment

TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_torchrun_environment_reads_the_layout():
    env = torchrun_environment(TORCHRUN)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (0, 2, 0, 1)


@pytest.mark.parametrize("change, named", [
    ({"RANK": None}, "RANK is not set"),
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two'"),
    ({"RANK": "2"}, "out of range"),
    ({"WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "2"}, "does not split into nodes"),
])
def test_a_bad_torchrun_environment_is_named(change, named):
    env = {k: v for k, v in {**TORCHRUN, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=named):
        torchrun_environment(env)


@pytest.mark.parametrize("env, args, named", [
    ({}, [], "RANK is not set: start this module with torchrun"),
    (TORCHRUN, ["--ranks", "4"], "--ranks: 4 contradicts torchrun's layout (2)"),
    (TORCHRUN, ["--ranks-per-node", "2"], "--ranks-per-node: 2 contradicts torchrun's layout (1)"),
    (TORCHRUN, ["--experts", "4", "--top-k", "5"], "--top-k"),
    (TORCHRUN, ["--socket", "tcp://nowhere"], "--socket"),
    (TORCHRUN, ["--inject-migration-failure", "{"], "--inject-migration-failure"),
    (TORCHRUN, ["--link-rate", "100"], "--link-rate: emulated links need `moewatch runtime` to spawn the ranks"),
])
def test_bad_input_exits_2_with_one_line(monkeypatch, env, args, named):
    for key in TORCHRUN:
        monkeypatch.delenv(key, raising=False)
    result = CliRunner().invoke(_command(), args, env=env)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and named in lines[0] and "Traceback" not in result.output


@pytest.mark.slow
def test_a_one_process_group_reports_to_an_agent_over_tcp_and_prints_the_result(fake_agent):
    """Rank 0 finds the agent through MOEWATCH_SOCKET=tcp://...: hello first, every window delivered."""
    import time

    import torch.distributed as dist

    from moewatch import wire
    from moewatch.runtime.launcher import free_port
    from moewatch.telemetry import Window

    agent = fake_agent(tcp=True)
    env = {**TORCHRUN, "WORLD_SIZE": "1", "MASTER_PORT": str(free_port()), "MOEWATCH_SOCKET": agent.path}
    # The rank installs its stop handlers in this process: give pytest its own back afterwards.
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        result = CliRunner().invoke(_command(), ["--layers", "1", "--experts", "4", "--hidden", "16", "--ffn", "32",
                                             "--batch-tokens", "16", "--steps", "6", "--window-steps", "3",
                                                 "--ranks-per-node", "1", "--json"], env=env)
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["config"]["ranks"] == 1 and out["windows_built"] == 2 and out["pairs_lost"] == 0
    assert out["config"]["socket"] == agent.path and out["sender"]["frames_dropped"] == 0
    assert not dist.is_initialized()
    deadline = time.monotonic() + 10
    while len(agent.of_type(Window)) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(agent.of_type(Window)) == 2 and not agent.errors
    hello = agent.messages[0][1]
    assert isinstance(hello, wire.Hello) and hello.world_size == 1 and hello.ranks_per_node == 1
