"""The reference runtime (moewatch.runtime) and any runtime speaking moewatch.wire: its windows and
Acks arrive on the agent's socket, its plans leave on the same connection (`RuntimeActuator`). No
source to poll and no settings of its own; its actuator is the agent's default."""

from __future__ import annotations

from typing import Any, Callable

from ..base import Actuator, GroupKey, Integration

RUNTIME = "moewatch-runtime"  # Hello.runtime of moewatch.runtime (runtime/probe.py RUNTIME_NAME)


def _actuator(settings: Any, connection_of: Callable[[GroupKey], Any]) -> Actuator:
    from .actuator import RuntimeActuator

    return RuntimeActuator(connection_of)


INTEGRATION = Integration(name="reference", runtimes=frozenset({RUNTIME}), make_actuator=_actuator,
                          wants_actuator=lambda settings: False)  # chosen as the default, never asked for
