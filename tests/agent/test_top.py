"""`moewatch top`: the per-layer view of a running agent, and one line on exit 2 when none answers."""

from __future__ import annotations

import json
import subprocess
import sys

from moewatch.agent.top import fetch_status, render


def test_top_renders_a_running_agent(start_agent, helpers):
    daemon = start_agent(policy={"mode": "recommend"})
    rt = helpers.FakeRuntime(daemon.cfg.server.socket).connect()
    group = helpers.wait_group(daemon)
    for i in range(2):
        rt.send(helpers.make_window(helpers.hot_load(), helpers.contiguous(2, 8, 12), 4, start_time=1000.0 + 10 * i))
    assert helpers.wait_for(lambda: len(group.history) == 2)
    daemon.controller.plan_tick()
    status = fetch_status(daemon.http_url)
    text = render(status, colour=False)
    assert "m/g: connected, epoch 0, 2 windows" in text
    rows = [line for line in text.splitlines() if line.strip().startswith(("0 ", "1 "))]
    assert len(rows) == 2 and all("imbalance-bound" in row and "hot-experts" in row for row in rows)
    assert "decision" in text  # the recommendations, most recent last
    out = subprocess.run([sys.executable, "-m", "moewatch.cli", "top", "--url", daemon.http_url, "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and json.loads(out.stdout)["groups"][0]["windows_accepted"] == 2


def test_top_without_an_agent_exits_2():
    out = subprocess.run([sys.executable, "-m", "moewatch.cli", "top", "--url", "http://127.0.0.1:9", "--once"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "cannot reach the agent" in out.stderr


def test_top_shows_the_engine_slo_beside_the_verdicts():
    from moewatch.agent.top import format_slo

    slo = {"engine": "vllm", "quantiles": {"ttft": {"p99": 0.48}, "itl": {"p99": 0.0925}, "tpot": {"p99": None}},
           "gauges": {"running": 4.0, "waiting": 2.0},
           "breached": [{"slo": "ttft_p99"}], "moe": {"explains": False}}
    line = format_slo(slo)
    assert line == ("SLO (vllm): TTFT p99 480.0 ms, ITL p99 92.5 ms, TPOT p99 ?; running 4, waiting 2; "
                    "BREACHED: ttft_p99 (cause elsewhere)")
    assert format_slo({**slo, "breached": []}).endswith("SLOs met")
    assert format_slo(None) == ""
    status = {"agent": {"version": "x", "mode": "observe", "frames_rejected": {}},
              "groups": [{"model": "m", "ep_group": "g", "connected": True, "epoch_in_force": 0,
                          "windows_accepted": 1, "sizes": {}, "control": {}, "layers": [],
                          "summary": {"slo": slo}}]}
    assert "SLO (vllm): TTFT p99 480.0 ms" in render(status, colour=False)
