"""What a metric family is: its name, kind, labels, help and unit, declared once and checked.

The checks are the conventions of agent/catalog.py and [prometheus] (docs/sources.md): a `moewatch_` prefix, snake
case, base units spelled out in the name (`_seconds`, `_bytes`, `_ratio` for 0-1 shares), counters
and only counters ending in `_total`. A declaration that breaks one raises when its module is
imported, so a misnamed metric never reaches /metrics.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

Labels = tuple[str, ...]

GROUP: Labels = ("model", "ep_group")
LAYER: Labels = (*GROUP, "layer")

# Base units a name may carry; `""` for a dimensionless count or value without a unit suffix.
BASE_UNITS = ("seconds", "bytes", "ratio")
# Units Prometheus' conventions forbid (not base units): a name carrying one is refused.
NON_BASE_UNITS = ("milliseconds", "ms", "microseconds", "us", "minutes", "hours", "percent", "kb", "mb", "gb",
                  "kilobytes", "megabytes")
_NAME = re.compile(r"moewatch_[a-z][a-z0-9_]*[a-z0-9]")
_LABEL = re.compile(r"[a-z][a-z0-9_]*")


class FamilyError(ValueError):
    """A metric declaration that breaks the naming conventions."""


@dataclass(frozen=True)
class Family:
    """One metric family. `name` is as exposed (counters include `_total`; a histogram's is the base
    name of its _bucket/_sum/_count series)."""

    name: str
    labels: Labels
    help: str
    unit: str = ""
    kind: ClassVar[str] = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "labels", tuple(self.labels))
        for problem in self.problems():
            raise FamilyError(f"{self.name}: {problem}")

    def problems(self) -> list[str]:
        """Every convention the declaration breaks (empty when it follows them all)."""
        out = []
        if not _NAME.fullmatch(self.name) or "__" in self.name:
            out.append("a name is `moewatch_` then snake case")
        words = self.name.split("_")
        if (self.kind == "counter") != self.name.endswith("_total"):
            out.append("counters, and only counters, end in _total")
        if self.unit not in (*BASE_UNITS, ""):
            out.append(f"unit {self.unit!r} is not a base unit {BASE_UNITS}")
        elif self.unit and self.unit not in words:
            out.append(f"a metric in {self.unit} says so in its name (_{self.unit})")
        for unit in BASE_UNITS:
            if unit in words and self.unit != unit:
                out.append(f"the name says {unit}: declare unit={unit!r}")
        if set(words) & set(NON_BASE_UNITS):
            out.append("units are base units (seconds, bytes, 0-1 ratios)")
        if not self.help.strip():
            out.append("a help text says what the series means")
        if len(set(self.labels)) != len(self.labels):
            out.append(f"labels repeat: {self.labels}")
        for label in self.labels:
            if not _LABEL.fullmatch(label) or label == "le":
                out.append(f"label {label!r} is not snake case (or is the reserved `le`)")
        return out

    @property
    def per_group(self) -> bool:
        """Series of one EP group are stored, versioned and rendered together."""
        return self.labels[:2] == GROUP

    def exposed_names(self) -> tuple[str, ...]:
        return (self.name,)


@dataclass(frozen=True)
class Counter(Family):
    kind: ClassVar[str] = "counter"


@dataclass(frozen=True)
class Gauge(Family):
    kind: ClassVar[str] = "gauge"


@dataclass(frozen=True)
class Histogram(Family):
    buckets: tuple[float, ...] = ()
    kind: ClassVar[str] = "histogram"

    def problems(self) -> list[str]:
        out = super().problems()
        if not self.buckets or list(self.buckets) != sorted(set(self.buckets)):
            out.append("a histogram's buckets are distinct and ascending")
        return out

    def exposed_names(self) -> tuple[str, ...]:
        return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")


def families_of(namespace: dict) -> tuple[Family, ...]:
    """The families a module declares at its top level, in declaration order."""
    return tuple(value for value in namespace.values() if isinstance(value, Family))
