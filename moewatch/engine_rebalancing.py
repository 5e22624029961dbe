"""The engine's own rebalancing as it is configured, carried in the windows an engine adapter sends.

An adapter reads its engine's settings (moewatch/integrations/<engine>/rebalancing.py knows where
each engine keeps them) and puts them in every window's `extra["rebalancing"]`. Not in the Hello: an
agent that predates a new hello field refuses the whole hello (wire.decode_payload), while a window's
extra is read additively by every agent, and a folder of windows carries them too.

    {"interval_steps": int > 0, "asynchronous": bool or null, "observed": bool, "source": str}

- `interval_steps`: forward steps between two rebalances as configured;
- `asynchronous`: whether weights move beside the steps (true) or the step waits for them (false);
  null when the engine does not say;
- `observed`: whether the adapter records every rebalance the engine performs (one record in
  `extra["engine_rebalance"]` per call of the engine's placement algorithm); only then can the agent
  tell that a rebalance did not happen;
- `source`: the engine's own name for the settings, for the operator ("vllm eplb_config").

A window without the key comes from an engine whose rebalancing is off or an adapter that does not
say: nothing to watch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

KEY = "rebalancing"


@dataclass(frozen=True)
class RebalancingSettings:
    interval_steps: int
    asynchronous: bool | None = None
    observed: bool = False
    source: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.interval_steps, bool) or not isinstance(self.interval_steps, int) or self.interval_steps < 1:
            raise ValueError(f"extra.{KEY}.interval_steps: must be a positive integer, got {self.interval_steps!r}")
        if self.asynchronous is not None and not isinstance(self.asynchronous, bool):
            raise ValueError(f"extra.{KEY}.asynchronous: must be true, false or null, got {self.asynchronous!r}")
        if not isinstance(self.observed, bool):
            raise ValueError(f"extra.{KEY}.observed: must be true or false, got {self.observed!r}")
        if not isinstance(self.source, str):
            raise ValueError(f"extra.{KEY}.source: must be a string, got {self.source!r}")

    def to_extra(self) -> dict[str, dict[str, Any]]:
        """{"rebalancing": {...}} for an adapter's window extra."""
        return {KEY: asdict(self)}

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> "RebalancingSettings | None":
        """The settings a window's extra carries, None without them; ValueError naming the field of a
        malformed one."""
        raw = extra.get(KEY)
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise ValueError(f"extra.{KEY}: must be an object")
        unknown = set(raw) - {"interval_steps", "asynchronous", "observed", "source"}
        known = {k: v for k, v in raw.items() if k not in unknown}  # later fields: read additively
        if "interval_steps" not in known:
            raise ValueError(f"extra.{KEY}.interval_steps: missing")
        return cls(**known)


def observed_rebalance(load: Any, before: Any, after: Any, num_ranks: int,
                       expert_bytes: float | None = None) -> dict[str, Any]:
    """What one rebalance by the engine's own policy did, for its record: [L, E] load it rebalanced on,
    [L, P] map before (None, another slot count or a slot marked -1: not comparable) and [L, P'] map
    after, W ranks -> {"layers_changed": [l...], "slots_moved", "bytes_moved" (with expert_bytes, else
    None), "balancedness_before" (None when not comparable), "balancedness_after" (mean over layers,
    the load spread evenly over each expert's replicas), "map_changes": {l: [before row, after row]} for
    each changed layer}."""
    import numpy as np

    from .planner.placement_math import placement_balancedness

    load_arr = np.asarray(load, dtype=np.float64)
    new = np.asarray(after, dtype=np.int64)
    old = None if before is None else np.asarray(before, dtype=np.int64)
    comparable = old is not None and old.shape == new.shape and old.min() >= 0 and old.max() < load_arr.shape[1]
    changed = (old != new).any(axis=1) if comparable else np.ones(new.shape[0], dtype=bool)
    slots = int((old != new).sum()) if comparable else int(new.size)
    layers = [int(layer) for layer in np.flatnonzero(changed)]
    return {
        "layers_changed": layers,
        "slots_moved": slots,
        "bytes_moved": None if expert_bytes is None else float(slots * expert_bytes),
        "balancedness_before": float(placement_balancedness(load_arr, old, num_ranks).mean()) if comparable else None,
        "balancedness_after": float(placement_balancedness(load_arr, new, num_ranks).mean()),
        "map_changes": {str(layer): [old[layer].tolist() if comparable else None, new[layer].tolist()]
                        for layer in layers},
    }
