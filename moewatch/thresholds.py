"""Triage thresholds: one validated object, the source documents' values as defaults, each with its source (keys of docs/sources.md).

Overridable from a YAML file (a mapping, optionally under a `thresholds:` key) and from flags
(`thresholds_options` turns every field into a `--name` option). Unknown or out-of-range values are
rejected with the field named, once, at the edge.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

from .errors import ConfigError


def _t(default: float, source: str, help: str, lo: float = 0.0, hi: float = math.inf) -> Any:
    return field(default=default, metadata={"source": source, "help": help, "range": (lo, hi)})


@dataclass(frozen=True)
class Thresholds:
    comm_share: float = _t(
        0.5, "[a2a-bottleneck]: all-to-all near or above half of layer time means communication dominates",
        "all-to-all transfer share of layer time (waiting left out) at or above which a layer is communication-dominated", 0.0, 1.0)
    rank_load_cv: float = _t(
        0.3, "[serving-2026]: expert load per card, std/mean < 0.3",
        "std/mean of per-rank load above which ranks are imbalanced")
    rank_load_max_mean: float = _t(
        1.3, "moewatch: the busiest rank 30 % above the mean (std/mean 0.3 on two ranks)",
        "max/mean of per-rank load above which ranks are imbalanced", 1.0)
    expert_load_cv: float = _t(
        0.3, "[serving-2026] applied per expert: std/mean < 0.3",
        "std/mean of per-expert load above which routing is skewed")
    hot_expert_multiple: float = _t(
        2.0, "moewatch: an expert with twice the mean expert load is hot ([a2a-bottleneck]: long-term hot experts)",
        "multiple of the mean expert load above which an expert is hot", 1.0)
    cross_rank_margin: float = _t(
        0.05, "moewatch: measured cross-rank ratio 5 points above the placement's prediction",
        "how far the cross-rank ratio may exceed the placement's prediction before the mapping is blamed", 0.0, 1.0)
    small_message_bytes: float = _t(
        32768, "[serving-2026]: messages under 32 KB are dominated by per-message protocol overhead",
        "mean all-to-all message size below which fixed per-collective cost dominates")
    overflow_rate: float = _t(
        0.05, "[serving-2026]: expert overflow rate < 5 %",
        "share of routed pairs dropped or rerouted above which the overflow flag is raised", 0.0, 1.0)
    overflow_target: float = _t(
        0.01, "moewatch: the capacity action aims under 1 % overflow ([serving-2026]: C = 2.0 gives < 2 %)",
        "overflow the recommended capacity factor aims for", 0.0, 1.0)
    max_capacity_factor: float = _t(
        2.0, "[serving-2026]: C = 2.0 roughly doubles expert memory",
        "largest capacity factor the triage will recommend", 1.0)
    compute_straggler_max_mean: float = _t(
        1.3, "moewatch: the slowest rank's expert compute within 30 % of the mean",
        "max/mean of per-rank compute time at or under which compute counts as even beside uneven rank load "
        "(evidence only: a plan made for rank speeds looks like that)", 1.0)
    compute_straggler_per_pair: float = _t(
        1.3, "moewatch: in one layer at even load, a rank's expert compute per pair 30 % above the median rank's "
        "(per pair, so that a rank busy with more pairs is not read as slow)",
        "a rank's expert compute seconds per pair over the median rank's, in one layer, above which it is a slow "
        "device (at even load)", 1.0)
    straggler_relative_speed: float = _t(
        0.85, "moewatch: a rank under 85 % of the median rank's pairs per compute second, all layers of a window "
        "(a slow device is slow in every layer; one layer's time is noisy)",
        "speed relative to the median rank under which a rank at even load is a straggler", 0.0, 1.0)
    straggler_wait_share: float = _t(
        0.25, "moewatch: the ranks wait a quarter of layer time inside the all-to-all for one that arrives later",
        "share of layer time ranks spend waiting for a later rank at or above which that rank is a straggler "
        "(used when expert compute does not name one)", 0.0, 1.0)
    effective_capacity_factor: float = _t(
        0.8, "[serving-2026]: capacity_factor_effective > 0.8",
        "computed pairs over granted capacity below which capacity is mostly padding", 0.0, 1.0)
    a2a_p99_seconds: float = _t(
        0.005, "[serving-2026]: all-to-all latency p99 < 5 ms per layer",
        "per-layer per-step all-to-all time the alerts hold p99 under")
    link_bandwidth_bytes_per_second: float = _t(
        4.5e11, "moewatch: NVLink-class per-GPU bandwidth for the Aurora bound; set yours",
        "per-rank link bandwidth used for the all-to-all lower bound", 1.0)
    schedule_over_bound: float = _t(
        1.3, "moewatch: an all-to-all 30 % above its Aurora bound (measured link rates) is far above it; "
        "Aurora reports up to 1.38x from ordering alone",
        "measured all-to-all over its bound above which a comm-bound / volume layer gets the schedule action", 1.0)
    min_routed_pairs: float = _t(
        1, "moewatch: a layer that routed nothing gets no verdict but healthy",
        "routed pairs below which a layer is reported idle")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{f.name}: expected a number, got {value!r}")
            lo, hi = f.metadata["range"]
            if not math.isfinite(float(value)) or not lo <= float(value) <= hi:
                bound = f"[{lo}, {hi}]" if math.isfinite(hi) else f">= {lo}"
                raise ConfigError(f"{f.name}: {value!r} is outside {bound}")
            object.__setattr__(self, f.name, float(value))

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None, where: str = "thresholds") -> "Thresholds":
        data = dict(data or {})
        known = {f.name for f in dataclasses.fields(cls)}
        for key in data:
            name = str(key).replace("-", "_")
            if name not in known:
                raise ConfigError(f"{where}.{key}: unknown threshold (known: {', '.join(sorted(known))})")
        try:
            return cls(**{str(k).replace("-", "_"): v for k, v in data.items()})
        except ConfigError as exc:
            raise ConfigError(f"{where}.{exc}") from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> "Thresholds":
        data = read_yaml_mapping(path, "a mapping of threshold names to numbers")
        if "thresholds" in data:
            data = data["thresholds"] or {}
            if not isinstance(data, dict):
                raise ConfigError(f"{path}: thresholds must be a mapping")
        return cls.from_mapping(data)

    def with_overrides(self, **overrides: Any) -> "Thresholds":
        given = {k: v for k, v in overrides.items() if v is not None}
        return self.from_mapping({**dataclasses.asdict(self), **given})

    @classmethod
    def describe(cls) -> list[dict[str, Any]]:
        """Every threshold with its default, source and meaning (for docs and `--help`)."""
        return [{"name": f.name, "default": f.default, "source": f.metadata["source"], "help": f.metadata["help"]}
                for f in dataclasses.fields(cls)]


class _DuplicateKey(Exception):
    def __init__(self, key: Any, line: int):
        self.key, self.line = key, line


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a mapping naming the same key twice (YAML says keys are unique; the
    plain loader silently keeps the last, so a typo'd override would go unnoticed)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: the base class reports it
                break
            if duplicate:
                raise _DuplicateKey(key, key_node.start_mark.line + 1)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml_mapping(path: str | Path, expected: str) -> dict[str, Any]:
    """A YAML file's top-level mapping ({} for an empty file); ConfigError names the file otherwise
    (unreadable, a folder, not UTF-8, not YAML, a key given twice)."""
    try:
        data = yaml.load(Path(path).read_text(encoding="utf-8"), Loader=_StrictLoader)  # noqa: S506 (safe)
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a folder, not a file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except _DuplicateKey as exc:
        raise ConfigError(f"{path}: line {exc.line}: key {exc.key!r} is given twice") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc.__class__.__name__})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected {expected}")
    return data


def thresholds_options(command: Callable) -> Callable:
    """Add one `--<threshold>` option per field to a click command (values land in **kwargs)."""
    import click

    for f in reversed(dataclasses.fields(Thresholds)):
        command = click.option(
            "--" + f.name.replace("_", "-"), f.name, type=float, default=None,
            help=f"{f.metadata['help']} [default {f.default:g}]")(command)
    return command


def thresholds_from_cli(config_path: str | None, **flags: Any) -> Thresholds:
    """YAML file first, then flags on top."""
    base = Thresholds.from_yaml(config_path) if config_path else Thresholds()
    names = {f.name for f in dataclasses.fields(Thresholds)}
    return base.with_overrides(**{k: v for k, v in flags.items() if k in names})
