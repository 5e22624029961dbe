"""vLLM (the CPU build) serving HTTP with moewatch's plugin on, and the agent scraping its /metrics:
the agent's /metrics carries the group's TTFT and inter-token latency quantiles, and
`moewatch diagnose` on a window the plugin wrote prints the SLO section.

    .venv-vllm/bin/python scripts/vllm_slo_check.py [--requests 20] [--agent .venv/bin/moewatch]

A tiny random Mixtral saved by transformers and a word-level tokenizer (moewatch.tools.bench.vllm:
save_random_moe, save_word_tokenizer) stand in for a real model, offline; vLLM's OpenAI server starts
as openai_server_command says. Every wait polls against a deadline: the agent's SLO quantiles show at
its first scrape of vLLM after the requests, and leave again at the first interval without requests.
Prints one JSON object; exit 0 when every check held. tests/runtime/engines/test_vllm_slo.py runs the
same path in the suite.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from moewatch.tools.bench.vllm import openai_server_command, word_prompt


VOCAB = 256


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (localhost)
        return resp.read().decode()


def wait_until(check, seconds: float, interval: float = 1.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if check():
                return True
        except OSError:
            pass
        time.sleep(interval)
    return False


def tiny_model(folder: Path) -> None:
    import transformers

    from moewatch.tools.bench.vllm import save_random_moe, save_word_tokenizer

    # head_dim 64: vLLM's CPU attention takes no 16
    config = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=128, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                        num_local_experts=8, num_experts_per_tok=2)
    save_random_moe(config, folder, seed=0)
    save_word_tokenizer(folder, VOCAB)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--agent", default=str(Path(__file__).resolve().parents[1] / ".venv" / "bin" / "moewatch"))
    parser.add_argument("--startup-seconds", type=float, default=600)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="moewatch-vllm-slo-"))
    model_dir, windows = work / "model", work / "windows"
    windows.mkdir()
    tiny_model(model_dir)
    vllm_port, agent_port = free_port(), free_port()
    engine_metrics = f"http://127.0.0.1:{vllm_port}/metrics"
    socket_path = str(work / "agent.sock")
    agent = subprocess.Popen([args.agent, "agent", "--server.socket", socket_path,
                              "--server.listen", f"127.0.0.1:{agent_port}",
                              "--slo.endpoints", f"tiny/ep0={engine_metrics}", "--slo.poll-seconds", "2"],
                             stdout=open(work / "agent.log", "w"), stderr=subprocess.STDOUT)
    env = {**os.environ, "MOEWATCH_SOCKET": socket_path, "MOEWATCH_WINDOW_DIR": str(windows),
           "MOEWATCH_MODEL": "tiny", "MOEWATCH_WINDOW_STEPS": "20", "VLLM_CPU_KVCACHE_SPACE": "1"}
    server = subprocess.Popen(openai_server_command(sys.executable, str(model_dir), vllm_port, "tiny"),
                              env=env, stdout=open(work / "vllm.log", "w"), stderr=subprocess.STDOUT)
    report: dict = {"work": str(work)}
    try:
        def up() -> bool:
            if server.poll() is not None:
                raise RuntimeError(f"vLLM exited ({server.returncode}); see {work / 'vllm.log'}")
            return "vllm:" in get(engine_metrics)

        report["vllm_up"] = wait_until(up, args.startup_seconds)
        if not report["vllm_up"]:
            raise RuntimeError(f"vLLM did not start; see {work / 'vllm.log'}")
        # The agent's first scrape of vLLM is its baseline: the requests come after it, in an interval.
        status_url = f"http://127.0.0.1:{agent_port}/status"
        report["agent_baseline"] = wait_until(
            lambda: json.loads(get(status_url))["slo"]["groups"][0]["latest"] is not None, 30, 0.2)
        for i in range(args.requests):
            body = json.dumps({"model": "tiny", "prompt": word_prompt(i, 12, VOCAB), "max_tokens": 16,
                               "temperature": 0.0, "ignore_eos": True}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{vllm_port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=120).read()  # noqa: S310 (localhost)
        lines: list[str] = []

        def has_ttft_and_itl() -> bool:
            lines[:] = [ln for ln in get(f"http://127.0.0.1:{agent_port}/metrics").splitlines()
                        if ln.startswith("moewatch_slo_latency_seconds{")]
            return any('signal="ttft"' in ln for ln in lines) and any('signal="itl"' in ln for ln in lines)

        # shown from the agent's next scrape of vLLM (every 2 s) until an interval without requests
        report["agent_has_ttft_and_itl"] = wait_until(has_ttft_and_itl, 10, 0.1)
        report["agent_slo_lines"] = lines[:12]
        engine = get(engine_metrics)
        report["vllm_ttft_count"] = next((ln for ln in engine.splitlines()
                                          if ln.startswith("vllm:time_to_first_token_seconds_count")), None)
        files = sorted(windows.glob("*.json"))
        report["windows_written"] = len(files)
        if files:
            out = subprocess.run([args.agent, "diagnose", str(files[-1]), "--engine-metrics", engine_metrics],
                                 capture_output=True, text=True, timeout=120)
            report["diagnose"] = out.stdout.splitlines()[:12]
            report["diagnose_has_slo_section"] = any(ln.startswith("SLO (vllm)") for ln in report["diagnose"])
        report["ok"] = bool(report["agent_has_ttft_and_itl"] and report.get("diagnose_has_slo_section"))
    except Exception as exc:
        report["ok"] = False
        report["error"] = repr(exc)
    finally:
        for proc in (server, agent):
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
