"""A real vLLM (CPU build, in .venv-vllm) serving HTTP with vLLM's OpenAI server and moewatch's plugin on,
and the agent scraping vLLM's /metrics for its SLO signals: what an operator runs, end to end.

- A burst of completions too short to fill one window (the plugin sends a window every 256 steps, the
  burst makes 128): the agent's /metrics still shows the burst's TTFT and inter-token latency
  quantiles (`moewatch_slo_latency_seconds`), at its next scrape of vLLM's /metrics; an engine that goes
  idle sends no window, so the interval must not wait for one.
- More completions until a window reaches the agent: its diagnosis carries the SLO section, and
  `moewatch diagnose` on the window file the plugin wrote prints it beside vLLM's /metrics.

Every wait polls against a deadline. scripts/vllm_slo_check.py is the same run for a user's shell."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from moewatch.tools.bench.vllm import openai_server_command, save_tiny_model, save_word_tokenizer, word_prompt

REPO = Path(__file__).resolve().parents[3]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
VOCAB, WINDOW_STEPS, MAX_TOKENS, BURST = 1024, 256, 16, 8  # the burst: 8 x 16 = 128 steps, half a window
GROUP = ("tiny", "ep0")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:  # noqa: S310 (localhost)
        return resp.read().decode()


def complete(port: int, seed: int) -> None:
    body = json.dumps({"model": GROUP[0], "prompt": word_prompt(seed, 12, VOCAB), "max_tokens": MAX_TOKENS,
                       "temperature": 0.0, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:  # noqa: S310 (localhost)
        assert len(json.loads(resp.read())["choices"]) == 1


def poll(check, seconds: float, interval: float = 0.05):
    """check()'s first truthy result within `seconds`, else None."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(interval)
    return None


def slo_lines(text: str) -> dict[tuple[str, str], float]:
    """{(signal, percentile): seconds} of the group's moewatch_slo_latency_seconds samples."""
    out = {}
    for line in text.splitlines():
        if line.startswith("moewatch_slo_latency_seconds{") and 'model="tiny"' in line:
            head, _, value = line.rpartition(" ")
            labels = dict(part.split("=", 1) for part in head[head.index("{") + 1:-1].split(","))
            out[(labels["signal"].strip('"'), labels["percentile"].strip('"'))] = float(value)
    return out


def vllm_count(text: str, family: str) -> float:
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith(f"{family}_count{{") and 'model_name="tiny"' in line)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_vllm_served_over_http_gives_the_agent_its_slo_quantiles_and_diagnose_its_slo_section(tmp_path):
    from moewatch.agent.config import AgentConfig
    from moewatch.agent.daemon import Daemon

    assert VLLM_PYTHON.is_file(), f"{VLLM_PYTHON} is missing: `make vllm-env` builds vLLM's environment"
    model_dir, windows_dir = tmp_path / "model", tmp_path / "windows"
    save_tiny_model(str(model_dir), layers=2, experts=8)
    save_word_tokenizer(model_dir, VOCAB)
    short = Path(tempfile.mkdtemp(prefix="mwslo-", dir="/tmp"))  # a unix socket path stays short
    vllm_port = free_port()
    engine_metrics = f"http://127.0.0.1:{vllm_port}/metrics"
    daemon = Daemon(AgentConfig.from_mapping({
        "server": {"socket": str(short / "agent.sock"), "listen": "127.0.0.1:0"},
        "log": {"audit_log": str(short / "audit.jsonl")}, "jobs": {"triage_interval_seconds": 0.05},
        "slo": {"endpoints": f"{GROUP[0]}/{GROUP[1]}={engine_metrics}", "poll_seconds": 1.0}})).start()
    triaged = []
    daemon.window_listeners.append(lambda group, t: triaged.append(t) if group.key == GROUP else None)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOEWATCH_", "VLLM_"))}
    env.update(MOEWATCH_SOCKET=str(short / "agent.sock"), MOEWATCH_WINDOW_DIR=str(windows_dir),
               MOEWATCH_MODEL=GROUP[0], MOEWATCH_WINDOW_STEPS=str(WINDOW_STEPS), VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"))
    log_path = tmp_path / "vllm.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(openai_server_command(str(VLLM_PYTHON), str(model_dir), vllm_port, GROUP[0]),
                                  env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        def vllm_up() -> bool:
            assert server.poll() is None, f"vLLM exited ({server.returncode}): {log_path.read_text()[-3000:]}"
            try:
                return "vllm:time_to_first_token_seconds" in get(engine_metrics)
            except OSError:
                return False

        assert poll(vllm_up, 420, interval=0.5), f"vLLM did not serve: {log_path.read_text()[-3000:]}"
        slo = daemon.sources["slo"]
        # The agent's first scrape of vLLM is its baseline: the burst comes after it, in an interval.
        assert poll(lambda: slo.latest(GROUP) is not None, 30), slo.status()

        before = get(engine_metrics)
        for i in range(BURST):
            complete(vllm_port, i)
        lines = poll(lambda: (lambda got: got if {("ttft", "p99"), ("itl", "p99")} <= set(got) else None)(
            slo_lines(get(daemon.http_url + "/metrics"))), 15)
        assert lines, f"no TTFT and ITL quantiles on the agent's /metrics; /status: {slo.status()}"
        assert triaged == [], "a window reached the agent during the burst: the test no longer shows the export alone"
        after = get(engine_metrics)
        assert vllm_count(after, "vllm:time_to_first_token_seconds") - \
            vllm_count(before, "vllm:time_to_first_token_seconds") == BURST  # vLLM measured every request
        for signal in ("ttft", "itl"):
            p50, p90, p99 = (lines.get((signal, p)) for p in ("p50", "p90", "p99"))
            assert p50 is not None and 0 < p50 <= p90 <= p99 < 60, (signal, lines)

        # More requests until a window arrives: the agent stamps it with the SLO interval it has.
        seed = BURST
        while not triaged and seed < BURST + 4 * WINDOW_STEPS // MAX_TOKENS:
            complete(vllm_port, seed)
            seed += 1
            poll(lambda: triaged, 0.2)
        assert poll(lambda: triaged, 10), f"no window of the group reached the agent: {log_path.read_text()[-3000:]}"
        section = triaged[0].diagnosis.summary["slo"]
        assert section is not None and section["engine"] == "vllm"
        assert {"ttft", "itl", "tpot", "e2e", "queue"} <= set(section["quantiles"])

        files = poll(lambda: sorted(windows_dir.glob("*.json")), 10)
        assert files, "the plugin wrote no window file"
        cli = [sys.executable, "-m", "moewatch.cli", "diagnose", str(files[0]), "--engine-metrics", engine_metrics]
        text = subprocess.run(cli, capture_output=True, text=True, timeout=120)
        assert text.returncode == 0, text.stderr
        assert any(line.startswith("SLO (vllm): ttft p99 ") for line in text.stdout.splitlines()), text.stdout
        as_json = subprocess.run([*cli, "--json"], capture_output=True, text=True, timeout=120)
        assert as_json.returncode == 0, as_json.stderr
        diagnosed = json.loads(as_json.stdout)
        assert diagnosed["runtime"] == "vllm" and diagnosed["model"] == GROUP[0]
        quantiles = diagnosed["summary"]["slo"]["quantiles"]
        for signal in ("ttft", "itl", "e2e"):
            assert 0 < quantiles[signal]["p50"] <= quantiles[signal]["p99"], (signal, quantiles)
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        daemon.stop()
        shutil.rmtree(short, ignore_errors=True)
