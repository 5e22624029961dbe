"""What the agent knows of vLLM: its windows come from the in-process plugin
(runtime/engines/vllm_plugin.py) over the wire or as files. vLLM takes no plan from the agent: it moves
experts with its own EPLB, whose placements are moewatch's policy's when MOEWATCH_EPLB=1 (decided
inside vLLM, runtime/engines/vllm_eplb.py), so the agent observes and recommends only. No source to poll, no actuator, no settings."""

from __future__ import annotations

import dataclasses

from ..base import OBSERVE_ONLY, Integration

RUNTIME = "vllm"

INTEGRATION = Integration(
    name="vllm", runtimes=frozenset({RUNTIME}),
    observe_only=dataclasses.replace(
        OBSERVE_ONLY,
        observe_only_reason="vLLM takes no plan from the agent (it moves experts with its own EPLB, with "
                            "moewatch's policy inside when MOEWATCH_EPLB=1): moewatch observes and recommends only"))
