"""vLLM's CPU build serving with --data-parallel-size 2 (its OpenAI server: two engine processes, one
per DP rank, kept in lockstep by vLLM's DP engine core and coordinator; no expert parallelism, which
vLLM's CPU build does not run with DP) and moewatch's plugin on: each DP rank writes shards of one
window per sequence, and what they counted is, for every layer and expert, the histogram transformers
computes on the same weights and tokens. The shards of each sequence are one per rank, with the same
steps (an idle rank takes part through vLLM's dummy batches), and merge into the group's window.

vLLM 0.32.0's CPU build starts with DP 2 but fails its first step with tokens: its CPU communicator
lacks `all_gatherv` (NotImplementedError, base_device_communicator.py, called by the MoE layer's
all-gather dispatch, prepare_finalize/naive_dp_ep.py -> all2all.py AgRsAll2AllManager.dispatch) and
`reduce_scatterv` (its combine). The engine processes get those two collectives from
vllm_cpu_dp/sitecustomize.py (torch.distributed on the communicator's own group, test-only); the
rest is vLLM's own DP serving path."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from moewatch.shards import merge_sequence
from moewatch.telemetry import Window, validate
from moewatch.tools.bench.vllm import openai_server_command, save_random_moe, save_word_tokenizer
from test_vllm_plugin import EXPERTS, TOP_K, VOCAB, transformers_histogram  # the single-rank test's reference

REPO = Path(__file__).resolve().parents[3]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
CPU_DP_COLLECTIVES = Path(__file__).parent / "vllm_cpu_dp"  # sitecustomize.py: see the docstring


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tokens_written(folder: Path) -> int:
    total = 0
    for f in folder.glob("*.json"):
        try:
            total += int(sum(json.loads(f.read_text())["step_tokens"]))
        except (OSError, ValueError, KeyError):  # a file being replaced: read on the next poll
            pass
    return total


def complete(port: int, prompt: list[int], out: dict, key: int) -> None:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0.0, "ignore_eos": True,
                       "return_token_ids": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as resp:
        out[key] = json.loads(resp.read())["choices"][0]["token_ids"]


@pytest.mark.slow
def test_cpu_serving_with_data_parallel_size_2_shards_add_up_to_transformers_counts(tmp_path):
    assert VLLM_PYTHON.is_file(), f"{VLLM_PYTHON} is missing: `make vllm-env` builds vLLM's environment"
    model_dir = tmp_path / "model"
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=256, num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, moe_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[],
        norm_topk_prob=True, tie_word_embeddings=False)
    save_random_moe(config, model_dir, seed=0)
    save_word_tokenizer(model_dir, VOCAB)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 17, 33, 9, 24, 2, 12, 7)]

    port = free_port()
    windows_dir = tmp_path / "windows"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOEWATCH_", "VLLM_"))}
    env.update(MOEWATCH_WINDOW_DIR=str(windows_dir), MOEWATCH_WINDOW_STEPS="2", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(CPU_DP_COLLECTIVES), env.get("PYTHONPATH")])))
    command = openai_server_command(str(VLLM_PYTHON), str(model_dir), port, "tiny") + ["--data-parallel-size", "2"]
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    generated: dict[int, list[int]] = {}
    try:
        deadline = time.monotonic() + 420
        while time.monotonic() < deadline:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-4000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                time.sleep(2)
        else:
            raise AssertionError("vLLM's server did not come up: " + (tmp_path / "server.log").read_text()[-4000:])
        # All at once, so both DP ranks get requests (vLLM balances them by load), and then one alone
        # (the other rank takes part through dummy batches).
        threads = [threading.Thread(target=complete, args=(port, p, generated, i)) for i, p in enumerate(prompts[:-1])]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        complete(port, prompts[-1], generated, len(prompts) - 1)
        # The ranks run dummy batches until vLLM's DP sync sees them all idle; wait (bounded) until
        # every token's window is written, as vLLM may kill a worker that is slow to stop.
        computed = sum(len(p) + len(generated.get(i, [])) - 1 for i, p in enumerate(prompts))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and tokens_written(windows_dir) < computed:
            time.sleep(1)
    finally:
        server.send_signal(signal.SIGINT)  # a clean shutdown: each worker flushes its last window
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()
    assert sorted(generated) == list(range(len(prompts))), generated

    files = sorted(windows_dir.glob("*.json"))
    windows = [Window.from_json(f.read_text()) for f in files]
    assert windows, (tmp_path / "server.log").read_text()[-4000:]
    shards = [w.extra.get("shard") for w in windows]
    assert all(s is not None and s["count"] == 2 and s["rank"] == 0 for s in shards), shards  # no EP: one rank
    assert {(w.ep_group, w.world_size, w.ranks_per_node) for w in windows} == {("ep0", 1, 1)}
    by_sequence: dict[int, list[Window]] = {}
    for w, s in zip(windows, shards):
        by_sequence.setdefault(s["sequence"], []).append(w)
    # Every sequence has one shard from each DP rank, over the same steps (lockstep). At shutdown vLLM
    # kills an engine process that is slow to stop, whose last window is then lost: the last sequence
    # may lack a shard, where what came of it holds no token (an idle tail of dummy batches).
    assert sorted(by_sequence) == list(range(len(by_sequence)))
    last = max(by_sequence)
    for sequence, group in sorted(by_sequence.items()):
        if sequence == last and len(group) == 1:
            assert int(group[0].step_tokens.sum()) == 0, [w.extra["shard"] for w in group]
            continue
        assert sorted(w.extra["shard"]["index"] for w in group) == [0, 1], (sequence, [w.extra["shard"] for w in group])
        assert len({w.steps for w in group}) == 1, (sequence, [w.steps for w in group])
    # Both ranks computed tokens.
    assert all(sum(int(w.step_tokens.sum()) for w in windows if w.extra["shard"]["index"] == i) > 0 for i in (0, 1))

    # vLLM computes each prompt and every generated token but the last (never fed back).
    sequences = [p + generated[i][:-1] for i, p in enumerate(prompts)]
    expected = transformers_histogram(model_dir, sequences)
    np.testing.assert_array_equal(sum(w.expert_tokens for w in windows), expected)
    assert sum(int(w.step_tokens.sum()) for w in windows) == sum(len(s) for s in sequences)

    # The agent's merge (moewatch.shards.merge_sequence): one whole, valid window per sequence, none
    # refused or missing; over the run, transformers' counts again, and per step the tokens of both.
    merged = []
    for sequence, group in sorted(by_sequence.items()):
        window, refused = merge_sequence(group)
        assert refused == [] and window.shards_report.missing == tuple(sorted({0, 1} - {w.extra["shard"]["index"]
                                                                                     for w in group})), (sequence, refused)
        validate(window)
        assert window.steps == group[0].steps and "shard" not in window.extra
        np.testing.assert_array_equal(window.step_tokens, sum(w.step_tokens for w in group))
        merged.append(window)
    np.testing.assert_array_equal(sum(w.expert_tokens for w in merged), expected)
