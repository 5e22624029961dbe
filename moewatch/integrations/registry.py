"""The one place engines are listed. The agent asks here which sources to poll, which actuator to
build and what a group's actuator declares; it never names an engine itself.

Built in: `reference` (the reference runtime and any runtime speaking the wire), `sglang`, `vllm`,
and `slo` (the engines' own SLO signals from their /metrics, for any group).
`register` adds another (a new engine's room, or a test's), `unregister` takes it away again.
"""

from __future__ import annotations

from typing import Any, Callable

from .base import Actuator, ActuatorProperties, GroupKey, Integration, Source
from .reference import INTEGRATION as REFERENCE
from .sglang import INTEGRATION as SGLANG
from .slo import INTEGRATION as SLO
from .vllm import INTEGRATION as VLLM

# The actuator used when no integration's settings ask for theirs: plans over the wire.
DEFAULT_ACTUATOR = REFERENCE.name

_integrations: dict[str, Integration] = {}


def register(integration: Integration) -> Integration:
    """Add an integration; ValueError when its name, or a runtime it covers, is taken already."""
    if integration.name in _integrations:
        raise ValueError(f"integration {integration.name!r} is registered already")
    for other in _integrations.values():
        shared = integration.runtimes & other.runtimes
        if shared:
            raise ValueError(f"integration {integration.name!r}: runtime {sorted(shared)[0]!r} is "
                             f"covered by {other.name!r} already")
    _integrations[integration.name] = integration
    return integration


def unregister(name: str) -> None:
    """Remove an integration (a test's, after it ran); KeyError when none has that name."""
    del _integrations[name]


def integrations() -> tuple[Integration, ...]:
    """Every registered integration, in registration order."""
    return tuple(_integrations.values())


def get(name: str) -> Integration:
    return _integrations[name]


def settings_sections() -> dict[str, type]:
    """{section name: settings class} of every integration that has a config section."""
    return {i.settings_section: i.settings_class for i in _integrations.values()
            if i.settings_section is not None and i.settings_class is not None}


def covering(runtime: str) -> Integration | None:
    """The integration whose windows carry this `runtime` value, None when no integration claims it."""
    return next((i for i in _integrations.values() if runtime in i.runtimes), None)


def build_actuator(cfg: Any, connection_of: Callable[[GroupKey], Any]) -> Actuator:
    """The agent's actuator: that of the one integration whose settings ask for it, else the default.
    ValueError when several ask (the agent sends every plan through one actuator)."""
    wanted = [i for i in _integrations.values()
              if i.make_actuator is not None and i.wants_actuator(i.settings(cfg))]
    if len(wanted) > 1:
        names = ", ".join(i.name for i in wanted)
        raise ValueError(f"actuator: only one engine's actuator can steer the agent's plans, asked: {names}")
    chosen = wanted[0] if wanted else _integrations[DEFAULT_ACTUATOR]
    return chosen.make_actuator(chosen.settings(cfg), connection_of)


def build_sources(cfg: Any) -> dict[str, Source]:
    """{integration name: its source} for the integrations whose settings configure something to poll."""
    sources = {}
    for integration in _integrations.values():
        if integration.make_source is None:
            continue
        source = integration.make_source(integration.settings(cfg))
        if source is not None:
            sources[integration.name] = source
    return sources


def polled_integrations() -> tuple[str, ...]:
    """Names of the integrations that can have a source (each has a key on /status)."""
    return tuple(i.name for i in _integrations.values() if i.make_source is not None)


def properties_for(runtime: str, actuator: Actuator) -> ActuatorProperties:
    """What applying a plan means for a group whose windows carry `runtime`: the declaration of an
    engine that takes no plan from outside, else what the agent's actuator declares."""
    integration = covering(runtime)
    if integration is not None and integration.observe_only is not None:
        return integration.observe_only
    return actuator.properties


for _builtin in (REFERENCE, SGLANG, VLLM, SLO):
    register(_builtin)
