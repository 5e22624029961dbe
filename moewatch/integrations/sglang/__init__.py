"""Everything torch-free moewatch knows about SGLang (docs/integrations.md, SGLang):

- `dump`: its expert-distribution recorder dumps (.pt; the one reader of them, the planner's too);
- `heatmap`: its /metrics heatmap (`sglang:eplb_gpu_physical_count`) as per-rank load;
- `source`: the agent's poll of both (`SGLangSource`);
- `actuator`: plans as an `--init-expert-location` file and the operator's command (`SGLangActuator`).

The hook that runs inside SGLang's process is runtime/engines/sglang_hooks.py. Every class here
takes the SGLang settings section (`SGLangSettings`: dump_dir, metrics_url, poll_seconds,
placement_file, num_experts, model, ep_group, location_file, command, command_timeout_seconds,
apply_seconds, actuate).
"""

from __future__ import annotations

from typing import Any, Callable

from ..base import Actuator, GroupKey, Integration, Source
from .settings import SECTION, SGLangSettings

RUNTIME = "sglang"
# Its settings' names in the agent's flat namespace before sections: `sglang_<field>`, and `actuator`.
FLAT_NAMES = {**{f"sglang_{name}": name for name in (
    "dump_dir", "metrics_url", "poll_seconds", "placement_file", "num_experts", "model", "ep_group", "location_file",
    "command", "command_timeout_seconds", "apply_seconds")}, "actuator": "actuate"}


def _source(settings: Any) -> Source | None:
    if not (settings.dump_dir or settings.metrics_url):
        return None
    from .source import SGLangSource

    return SGLangSource(settings)


def _actuator(settings: Any, connection_of: Callable[[GroupKey], Any]) -> Actuator:
    from .actuator import SGLangActuator

    return SGLangActuator(settings)


INTEGRATION = Integration(name="sglang", runtimes=frozenset({RUNTIME}), settings_section=SECTION,
                          settings_class=SGLangSettings, make_source=_source, make_actuator=_actuator,
                          flat_names=FLAT_NAMES)
