"""Runs inside .venv-vllm (the tests start it there): serves token prompts with vLLM's offline
engine and writes what it generated as JSON. moewatch's plugin is active when the caller's
environment sets MOEWATCH_WINDOW_DIR or MOEWATCH_SOCKET.

With --vllm-capture (in-process engine only: VLLM_ENABLE_V1_MULTIPROCESSING=0), vLLM's own
routed-experts capturer is bound to the model once it is loaded, before warm-up and compilation,
with vLLM's own bind function (what enable_return_routed_experts does; that flag needs Model Runner
V2, which needs a Triton with a CPU backend, absent here). After each step the rows vLLM captured
for the step's tokens are read with the capturer's own snapshot and counted into an [L, E] histogram per
step, written in step order as "vllm_capture_steps". An in-process engine also writes vLLM's
compilation counter and, for each module vLLM's compile decorator wraps, whether it was compiled.

With --slow-sample SECONDS (in-process engine only), vLLM's sampler (the runner's `_sample`, which
sample_tokens calls after execute_model) takes that much longer, so a step time that leaves
sample_tokens out is visibly short.

usage: vllm_driver.py MODEL_DIR PROMPTS_JSON OUT_JSON [--compiled] [--tp N] [--max-tokens K] [--rounds R]
                      [--vllm-capture] [--slow-sample SECONDS]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import numpy as np


def bind_vllm_capture_after_load(steps: list) -> None:
    """Patch the CPU worker so vLLM's capturer is bound right after the model is loaded, and append
    to `steps` what it captured in each step with tokens: pairs per layer and expert, [L, E]."""
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
        RoutedExpertsCapturer,
        bind_routed_experts_capturer,
    )
    from vllm.v1.worker.cpu_worker import CPUWorker

    load_model = CPUWorker.load_model

    def load_and_bind(self, *args, **kwargs):
        load_model(self, *args, **kwargs)
        config = self.vllm_config
        capturer = RoutedExpertsCapturer(max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
                                         vllm_config=config)
        bind_routed_experts_capturer(self.model_runner.model, capturer)
        layers, experts = config.model_config.get_total_num_hidden_layers(), config.model_config.get_num_experts()
        runner = self.model_runner
        execute = runner.execute_model  # the class's (moewatch's wrapper around vLLM's), bound to this runner

        def execute_and_read(scheduler_output, *a, **kw):
            out = execute(scheduler_output, *a, **kw)
            tokens = scheduler_output.total_num_scheduled_tokens
            if tokens > 0:
                rows = capturer.snapshot_routing_data(tokens).cpu().numpy().astype(np.int64)  # [N, L, k]
                steps.append([np.bincount(rows[:, layer].reshape(-1), minlength=experts).tolist()
                              for layer in range(layers)])
            return out

        runner.execute_model = execute_and_read

    CPUWorker.load_model = load_and_bind


def slow_sampler(seconds: float) -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    sample = GPUModelRunner._sample

    def slow(self, *args, **kwargs):
        time.sleep(seconds)
        return sample(self, *args, **kwargs)

    GPUModelRunner._sample = slow


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("prompts")
    parser.add_argument("out")
    parser.add_argument("--compiled", action="store_true")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--vllm-capture", action="store_true")
    parser.add_argument("--slow-sample", type=float, default=0.0)
    args = parser.parse_args()
    in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    if args.vllm_capture and not (in_process and args.tp == 1):
        parser.error("--vllm-capture needs the in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) and --tp 1")

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if args.slow_sample and not in_process:
        parser.error("--slow-sample needs the in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    if args.slow_sample:
        slow_sampler(args.slow_sample)
    captured_steps: list = []
    if args.vllm_capture:
        bind_vllm_capture_after_load(captured_steps)
    with open(args.prompts) as f:
        prompts = json.load(f)
    llm = LLM(model=args.model, skip_tokenizer_init=True, enforce_eager=not args.compiled, dtype="float32",
              max_model_len=256, enable_prefix_caching=False, tensor_parallel_size=args.tp, seed=0)
    # In process: which of the model's modules vLLM's compile decorator wraps, and whether each was
    # compiled (a worker process would need the function pickled).
    compiled_modules = llm.apply_model(lambda model: {
        name: {"compiled": bool(m.compiled), "has_compiled_fn": getattr(m, "aot_compiled_fn", None) is not None}
        for name, m in model.named_modules() if hasattr(m, "compiled") and hasattr(m, "aot_compiled_fn")
    })[0] if in_process else None
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, detokenize=False, ignore_eos=True)
    outputs = []
    seconds = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
        outputs = [list(r.outputs[0].token_ids) for r in results]
    del llm  # shuts the engine down: the plugin flushes its last window
    result: dict = {"generated": outputs, "seconds": seconds}
    if in_process:  # the engine ran in this process: its compilation counter is this process's
        from vllm.compilation.counter import compilation_counter

        result["compilation_counter"] = dataclasses.asdict(compilation_counter)
        result["compiled_modules"] = compiled_modules
    if args.vllm_capture:
        result["vllm_capture_steps"] = captured_steps
    # Which model runners' steps the plugin observes: V1's (what runs here) and V2's.
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as GPUModelRunnerV2
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    result["observed_runners"] = {name: getattr(cls.execute_model, "_moewatch", False)
                                  for name, cls in (("v1", GPUModelRunner), ("v2", GPUModelRunnerV2))}
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
