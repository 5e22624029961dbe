"""Everything torch-free moewatch knows about SGLang (docs/integrations.md, SGLang):

- `dump`: its expert-distribution recorder dumps (.pt; the one reader of them, the planner's too);
- `heatmap`: its /metrics heatmap (`sglang:eplb_gpu_physical_count`) as per-rank load;
- `source`: the agent's poll of both (`SGLangSource`);
- `actuator`: plans as an `--init-expert-location` file and the operator's command (`SGLangActuator`).

The hook that runs inside SGLang's process is runtime/engines/sglang_hooks.py. Every class here
takes the SGLang settings section (attribute access: dump_dir, metrics_url, poll_seconds,
placement_file, num_experts, model, ep_group, location_file, command, command_timeout_seconds,
apply_seconds, actuate).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable

from ..base import Actuator, GroupKey, Integration, Source

RUNTIME = "sglang"
SETTINGS_FIELDS = ("dump_dir", "metrics_url", "poll_seconds", "placement_file", "num_experts", "model", "ep_group",
                   "location_file", "command", "command_timeout_seconds", "apply_seconds")


def settings_from_flat_config(cfg: Any) -> SimpleNamespace:
    """The SGLang section read from the agent's flat `sglang_*` settings and `actuator: sglang`: the
    bridge until the agent's config holds the section itself (then `settings_of` reads it there)."""
    return SimpleNamespace(**{name: getattr(cfg, f"sglang_{name}") for name in SETTINGS_FIELDS},
                           actuate=getattr(cfg, "actuator", "runtime") == "sglang")


def _source(settings: Any) -> Source | None:
    if not (settings.dump_dir or settings.metrics_url):
        return None
    from .source import SGLangSource

    return SGLangSource(settings)


def _actuator(settings: Any, connection_of: Callable[[GroupKey], Any]) -> Actuator:
    from .actuator import SGLangActuator

    return SGLangActuator(settings)


INTEGRATION = Integration(name="sglang", runtimes=frozenset({RUNTIME}), settings_section="sglang",
                          settings_of=settings_from_flat_config, make_source=_source, make_actuator=_actuator)
