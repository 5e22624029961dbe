"""What the agent knows of vLLM: its windows come from the in-process plugin
(runtime/engines/vllm_plugin.py) over the wire or as files, and vLLM takes no placement from outside,
so the agent observes and recommends only. No source to poll, no actuator, no settings."""

from __future__ import annotations

import dataclasses

from ..base import OBSERVE_ONLY, Integration

RUNTIME = "vllm"

INTEGRATION = Integration(
    name="vllm", runtimes=frozenset({RUNTIME}),
    observe_only=dataclasses.replace(
        OBSERVE_ONLY,
        observe_only_reason="vLLM takes no placement from outside: moewatch observes and recommends only"))
