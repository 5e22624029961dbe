"""Settings declared once: a frozen dataclass per section, each field with its meaning, type and bounds.

A section (the agent's `policy`, an engine's `sglang`, ...) declares its fields with `setting(...)` and
checks itself in `__post_init__` with `check_section`. `coerce` turns one value from any source (YAML,
an environment variable's text, a flag) into the field's type, or raises ConfigError naming the value
by where it came from (`policy.persist_windows: ...`, `MOEWATCH_POLICY__PERSIST_WINDOWS: ...`).
Torch-free and agent-free, so an engine package in the core can declare its own section.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import field
from typing import Any, Callable

from .thresholds import ConfigError

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def setting(default: Any, help: str, *, kind: type = str, lo: float | None = None, hi: float | None = None,
            choices: tuple[str, ...] = (), default_text: str | None = None,
            normalize: Callable[[str], str] | None = None) -> Any:
    """One field of a settings section. A callable default is a factory (read at construction);
    `default_text` is what docs show for it. `normalize` checks and rewrites a string value (raising
    ValueError with the reason)."""
    meta = {"help": help, "kind": kind, "lo": lo, "hi": hi, "choices": choices, "default_text": default_text,
            "normalize": normalize}
    if callable(default):
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)


def coerce(f: dataclasses.Field, value: Any, where: str) -> Any:
    """Check and convert one field's value; ConfigError starts with `where` (the name the value came by)."""
    meta = f.metadata
    kind = meta["kind"]
    if kind is bool:
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if kind in (int, float):
        return _number(kind, value, where, meta["lo"], meta["hi"])
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    value = value.strip()
    if meta["choices"] and value not in meta["choices"]:
        raise ConfigError(f"{where}: {value!r} is not one of {', '.join(meta['choices'])}")
    if meta["normalize"] is not None:
        try:
            value = meta["normalize"](value)
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    return value


def _number(kind: type, value: Any, where: str, lo: float | None, hi: float | None) -> int | float:
    if isinstance(value, str):
        try:
            value = float(value.strip()) if kind is float else int(value.strip(), 0)
        except ValueError:
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if kind is int:
        if isinstance(value, float) and not value.is_integer():
            raise ConfigError(f"{where}: expected a whole number, got {value!r}")
        value = int(value)
    else:
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"{where}: must be finite, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ConfigError(f"{where}: {value!r} is outside [{lo:g}, {hi:g}]")
    return value


def check_section(section: Any, name: str) -> None:
    """Coerce every field of a frozen section in place; errors name `<name>.<field>`. For __post_init__."""
    for f in dataclasses.fields(section):
        object.__setattr__(section, f.name, coerce(f, getattr(section, f.name), f"{name}.{f.name}"))


def section_fields(cls: type) -> dict[str, dataclasses.Field]:
    """{field name: field} of a section class, in declaration order."""
    return {f.name: f for f in dataclasses.fields(cls)}


def default_of(f: dataclasses.Field) -> Any:
    """A field's default as docs show it (its default_text for a factory)."""
    if f.metadata.get("default_text"):
        return f.metadata["default_text"]
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()
