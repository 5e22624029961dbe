"""Plans over the wire: the Plan frame goes on the group's connection, the runtime applies it at a
step boundary and answers with an Ack later."""

from __future__ import annotations

from typing import Callable

from ...plan import Plan
from ..base import CAPACITY, PLACEMENT, SCHEDULE, Actuation, ActuatorProperties, GroupKey


class RuntimeActuator:
    """Plans over the socket to the connected reference runtime (or any runtime speaking wire)."""

    name = "runtime"
    # Live, any placement, capacity and all-to-all order, no cost beyond the migration.
    properties = ActuatorProperties(applies=frozenset({PLACEMENT, CAPACITY, SCHEDULE}))

    def __init__(self, connection_of: Callable[[GroupKey], object | None]):
        self.connection_of = connection_of

    def apply(self, group_key: GroupKey, plan: Plan) -> Actuation:
        conn = self.connection_of(group_key)
        if conn is None:
            return Actuation("failed", "no runtime of this group is connected")
        try:
            conn.send(plan)
        except (OSError, ConnectionError) as exc:
            return Actuation("failed", f"send failed: {exc}")
        return Actuation("sent", f"plan epoch {plan.epoch} sent on connection {conn.id}")
