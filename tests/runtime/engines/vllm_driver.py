"""Runs inside .venv-vllm (the tests start it there): serves token prompts with vLLM's offline
engine and writes what it generated as JSON. moewatch's plugin is active when the caller's
environment sets MOEWATCH_WINDOW_DIR or MOEWATCH_SOCKET.

usage: vllm_driver.py MODEL_DIR PROMPTS_JSON OUT_JSON [--compiled] [--tp N] [--max-tokens K] [--rounds R]
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("prompts")
    parser.add_argument("out")
    parser.add_argument("--compiled", action="store_true")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(args.prompts) as f:
        prompts = json.load(f)
    llm = LLM(model=args.model, skip_tokenizer_init=True, enforce_eager=not args.compiled, dtype="float32",
              max_model_len=256, enable_prefix_caching=False, tensor_parallel_size=args.tp, seed=0)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, detokenize=False, ignore_eos=True)
    outputs = []
    seconds = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
        outputs = [list(r.outputs[0].token_ids) for r in results]
    del llm  # shuts the engine down: the plugin flushes its last window
    with open(args.out, "w") as f:
        json.dump({"generated": outputs, "seconds": seconds}, f)


if __name__ == "__main__":
    main()
