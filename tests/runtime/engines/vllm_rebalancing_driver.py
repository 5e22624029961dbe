"""Runs inside .venv-vllm (the tests start it there): vLLM's own ParallelConfig and EPLBConfig, built as
`--enable-expert-parallel --enable-eplb --eplb-config '{...}' -tp 2` builds them, read by the plugin's
_rebalancing_extra; prints one JSON line. vLLM refuses EPLB off CUDA, ROCm and XPU when it validates the
config: that one platform check is answered as on a GPU, the rest of vLLM's validation runs.

usage: vllm_rebalancing_driver.py EPLB_CONFIG_JSON
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    from vllm.config.parallel import EPLBConfig, ParallelConfig
    from vllm.platforms import current_platform
    from vllm.plugins import load_general_plugins

    from moewatch.runtime.engines import vllm_plugin

    load_general_plugins()  # installs moewatch's EPLB policy when MOEWATCH_EPLB=1
    current_platform.is_cuda_alike = lambda: True
    on = ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
                        eplb_config=EPLBConfig(**json.loads(sys.argv[1])))
    off = ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True)
    extra = {name: {key: take() for key, take in vllm_plugin._rebalancing_extra(config).items()}
             for name, config in (("on", on), ("off", off))}
    print(json.dumps(extra))


if __name__ == "__main__":
    main()
