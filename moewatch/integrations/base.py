"""What an engine integration declares, and the two interfaces the agent drives it through.

An integration is everything torch-free moewatch knows about one engine (`Integration`):
- the `runtime` values of the windows it covers (Window.runtime, Hello.runtime);
- its config section (`settings_section`) and how to read its settings from the agent's config;
- its source: what the agent polls that produces Windows (files, an exposition), or none;
- its actuator: how a decided Plan reaches the engine, or none, and the actuator's declared
  properties (`ActuatorProperties`): whether it takes plans at all, live or by restart, what one apply
  costs in seconds, and what it can apply.

The agent, its policy and its daemon ask these declarations (through `registry.py`) and never name
an engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Protocol

from ..errors import InputError
from ..plan import Plan
from ..telemetry import Window
from ..wire import Ack

GroupKey = tuple[str, str]  # (model, ep_group)
Ingest = Callable[[Window], Optional[str]]  # ingest(window) -> the rejection reason, None when accepted

# What an actuator can apply, in the words of Hello.capabilities: "plan" is a placement
# (physical_to_logical_map), "capacity" a capacity factor per layer.
PLACEMENT = "plan"
CAPACITY = "capacity"
SCHEDULE = "schedule"  # the all-to-all's order (Plan.a2a_schedule)


class SourceError(InputError):
    """A foreign file or exposition moewatch cannot use; `field` names the file (or URL) at fault."""


@dataclass(frozen=True)
class ActuatorProperties:
    """What an actuator declares about applying a plan; the policy reads these, never an engine name.

    The defaults describe an engine that applies any plan live at a step boundary (the reference
    runtime over the wire)."""

    accepts_plans: bool = True
    # Why no plan is ever sent, for an engine that takes none: the policy ends each recommendation with it.
    observe_only_reason: str = ""
    live: bool = True  # applied while serving (True), or only by a restart or the engine's own rebalance
    # Seconds of stalled serving one apply costs, whatever moves (a restart's time): the cost gate's floor.
    apply_seconds: float = 0.0
    applies: frozenset[str] = frozenset({PLACEMENT, CAPACITY})


OBSERVE_ONLY = ActuatorProperties(accepts_plans=False, live=False, applies=frozenset())


@dataclass(frozen=True)
class Actuation:
    status: str  # sent (an Ack will follow) | applied | failed
    detail: str = ""
    ack: Ack | None = None  # for actuators that finish synchronously


class Actuator(Protocol):
    """How a decided Plan reaches an engine. `apply` answers at once ("sent": the engine's Ack follows
    on the wire) or with the Ack itself (an actuator that finishes synchronously)."""

    name: str
    properties: ActuatorProperties

    def apply(self, group_key: GroupKey, plan: Plan) -> Actuation: ...


class Source(Protocol):
    """Something the agent polls that produces Windows: one job named `job_name`, every `poll_seconds`.

    `poll(ingest)` hands each new window to `ingest` (which returns the rejection reason, None when
    accepted). `capabilities` are what the groups it feeds can take through the agent's actuator (in
    Hello.capabilities' words: a polled group has no hello of its own). `status()` goes on /status
    under the integration's name.

    Optional, for a source that knows something of groups beside their windows (an engine's SLO
    signals): `annotate(window)` returns the window with that added to its `extra` before its triage,
    and `annotations()` returns {group key: those `extra` entries now}, which the agent exports to
    /metrics after each poll without waiting for the group's next window."""

    job_name: str
    poll_seconds: float
    capabilities: frozenset[str]

    def poll(self, ingest: Ingest) -> None: ...

    def status(self) -> dict[str, Any]: ...


def _actuate_setting(settings: Any) -> bool:
    return bool(getattr(settings, "actuate", False))


@dataclass(frozen=True)
class Integration:
    """One engine's declarations. Every callable takes the integration's own settings (what
    `settings(cfg)` returns from the agent's config), never the whole config."""

    name: str
    runtimes: frozenset[str] = frozenset()  # Window.runtime values this integration covers
    settings_section: str | None = None  # the agent config's section for this engine; None: it has none
    # The section's frozen settings class (fields declared with moewatch.settings.setting): the agent's
    # config builds, validates and documents the section from it.
    settings_class: type | None = None
    # cfg -> settings, for an integration whose settings live elsewhere (a test's); default: its section.
    settings_of: Callable[[Any], Any] | None = None
    # settings -> its Source, or None when the settings configure nothing to poll.
    make_source: Callable[[Any], Source | None] | None = None
    # (settings, connection_of) -> its Actuator; connection_of(group_key) is the group's wire connection.
    make_actuator: Callable[[Any, Callable[[GroupKey], Any]], Actuator] | None = None
    # Whether the settings ask for this integration's actuator (at most one integration's at a time).
    wants_actuator: Callable[[Any], bool] = _actuate_setting
    # For the windows it covers when its engine takes no plan from outside: OBSERVE_ONLY with a reason.
    observe_only: ActuatorProperties | None = None
    # {old name: field of its section} for settings it had in the agent's flat namespace before sections;
    # the agent refuses an old name with its new place.
    flat_names: Mapping[str, str] = field(default_factory=dict)

    def settings(self, cfg: Any) -> Any:
        """This integration's settings from the agent's config (None when it has no section)."""
        if self.settings_of is not None:
            return self.settings_of(cfg)
        return None if self.settings_section is None else cfg.engines[self.settings_section]
