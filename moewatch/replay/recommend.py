"""The replay's advice: EPLB off, a static placement, or a policy at an interval, with the exact engine
settings that carry it out.

The candidates are those the operator's engine can run: "off", "static" and, at every interval that
rebalanced at least MIN_REBALANCES times in the recording, the engine's own policy and moewatch's
(the other engine's policy is replayed for comparison, never recommended). The one with the most net
seconds per hour wins; a rebalancing choice must buy at least `min_gain` of the serving time (net per
hour >= min_gain x 3600 s), else EPLB stays off. No recommendation at all (None, with the reason) when
the recording is too short, no interval rebalanced often enough, or the gain cannot be priced.

Settings: vLLM 0.32's `--eplb-config` JSON (EPLBConfig's fields window_size, step_interval,
num_redundant_experts) with `--enable-expert-parallel --enable-eplb`; SGLang 0.5.23's flags
(`--enable-eplb`, `--eplb-algorithm`, `--eplb-rebalance-num-iterations`, `--ep-num-redundant-experts`,
`--init-expert-location`); moewatch's policy by MOEWATCH_EPLB=1 and its MOEWATCH_EPLB_* settings
(docs/integrations.md); a static placement for vLLM by MOEWATCH_EPLB=1 MOEWATCH_EPLB_PLACEMENT=FILE.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, field
from typing import Any

from .replay import MIN_REBALANCES, MIN_WINDOWS, MOEWATCH, OFF, STATIC

ENGINE_OWN = {"vllm": "vllm_default", "sglang": "sglang_deepseek"}
DEFAULT_MIN_GAIN = 0.001  # a rebalancing choice must buy 0.1 % of the serving time
PLACEMENT_FILE = {"vllm": "placement.json", "sglang": "expert_location.json"}


@dataclass(frozen=True)
class Candidate:
    policy: str
    interval: str  # label; "-" for off and static
    interval_steps: int | None
    net_seconds_per_hour: float
    balancedness: float
    slots_moved: int


@dataclass(frozen=True)
class Recommendation:
    choice: str  # "off", "static" or "rebalance"
    policy: str
    interval: str
    interval_steps: int | None
    net_seconds_per_hour: float
    why: str
    engine: str
    settings: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def candidates(result: dict[str, Any], engine: str) -> list[Candidate]:
    """The runnable (policy, interval) pairs whose net per hour is known."""
    steps = {i["label"]: i["steps"] for i in result["intervals"]}
    enough = {i["label"] for i in result["intervals"] if i["enough_rebalances"]}
    out = []
    for policy in (OFF, STATIC, ENGINE_OWN[engine], MOEWATCH):
        for label, f in result["policies"].get(policy, {}).items():
            if f["net_seconds_per_hour"] is None or (label != "-" and label not in enough):
                continue
            out.append(Candidate(policy, label, steps.get(label), f["net_seconds_per_hour"], f["balancedness"],
                                 f["slots_moved"]))
    return out


def insufficient(num_windows: int, result: dict[str, Any], step_cost_known: bool, serving_known: bool) -> str | None:
    """Why the recording cannot carry a recommendation, in one line; None when it can."""
    if num_windows < MIN_WINDOWS:
        return f"too few windows for a recommendation: {num_windows} recorded, at least {MIN_WINDOWS} needed"
    if result["intervals"] and not any(i["enough_rebalances"] for i in result["intervals"]):
        shortest = min(result["intervals"], key=lambda i: i["steps"])
        return (f"too few rebalances for a recommendation: the shortest interval ({shortest['label']}) rebalances "
                f"{shortest['rebalances']} time(s) over {num_windows} windows, at least {MIN_REBALANCES} needed "
                "(record longer, or pass shorter --intervals)")
    if not step_cost_known:
        return "the gain cannot be priced: the windows carry too few step times to fit (give --seconds-per-pair)"
    if not serving_known:
        return "net seconds per hour cannot be given: the windows carry no step times (give --step-seconds)"
    return None


def choose(result: dict[str, Any], engine: str, min_gain: float = DEFAULT_MIN_GAIN) -> Candidate | None:
    """The best candidate by net seconds per hour, "off" unless another buys min_gain x 3600 s per hour;
    equal nets go to fewer slots moved. None: no candidate."""
    found = candidates(result, engine)
    if not found:
        return None
    best = max(found, key=lambda c: (c.net_seconds_per_hour, -c.slots_moved))
    off = next((c for c in found if c.policy == OFF), None)
    if best.policy != OFF and best.net_seconds_per_hour < min_gain * 3600.0 and off is not None:
        return off
    return best


def recommend(result: dict[str, Any], engine: str, context: dict[str, Any],
              min_gain: float = DEFAULT_MIN_GAIN) -> Recommendation | None:
    """The recommendation with its settings. context: num_experts, slots, ranks, nodes, load_paths (for
    the `moewatch plan` line), seconds_per_pair, expert_bytes, bytes_per_second."""
    best = choose(result, engine, min_gain)
    if best is None:
        return None
    if best.policy == OFF:
        why = (f"no rebalancing choice buys {min_gain:.1%} of the serving time here (the best, "
               f"{_best_other(result, engine)}): leave EPLB off")
        return Recommendation("off", OFF, "-", None, 0.0, why, engine, off_settings(engine))
    if best.policy == STATIC:
        why = (f"a static placement from these windows nets {best.net_seconds_per_hour:.3g} s per hour, more than any "
               "rebalancing interval (measured out of sample: each half of the windows under the placement solved from "
               "the other half)")
        return Recommendation("static", STATIC, "-", None, best.net_seconds_per_hour, why, engine,
                              static_settings(engine, context))
    why = (f"{best.policy} every {best.interval_steps} steps nets {best.net_seconds_per_hour:.3g} s per hour "
           f"(balancedness {best.balancedness:.3f}, {best.slots_moved} slots moved in the recording)")
    return Recommendation("rebalance", best.policy, best.interval, best.interval_steps, best.net_seconds_per_hour,
                          why, engine, rebalance_settings(engine, best.policy, int(best.interval_steps), context))


def alternatives(result: dict[str, Any], engine: str, context: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """For each choice the engine can run besides off, its best interval with its net and the settings
    that carry it out (what to set to run that policy anyway, recommended or not)."""
    out: dict[str, dict[str, Any]] = {}
    for c in candidates(result, engine):
        if c.policy == OFF or (c.policy in out and out[c.policy]["net_seconds_per_hour"] >= c.net_seconds_per_hour):
            continue
        settings = (static_settings(engine, context) if c.policy == STATIC
                    else rebalance_settings(engine, c.policy, int(c.interval_steps), context))
        out[c.policy] = {"interval": c.interval, "interval_steps": c.interval_steps,
                         "net_seconds_per_hour": c.net_seconds_per_hour, "settings": settings}
    return out


def _best_other(result: dict[str, Any], engine: str) -> str:
    others = [c for c in candidates(result, engine) if c.policy != OFF and c.slots_moved > 0]
    if not others:
        return "none moved a slot"
    c = max(others, key=lambda c: c.net_seconds_per_hour)
    where = "" if c.interval == "-" else f" every {c.interval_steps} steps"
    return f"{c.policy}{where}, nets {c.net_seconds_per_hour:.3g} s per hour"


def off_settings(engine: str) -> dict[str, Any]:
    if engine == "vllm":
        return {"args": "", "env": "", "note": "start vLLM without --enable-eplb"}
    return {"args": "", "env": "", "note": "start SGLang without --enable-eplb"}


def static_settings(engine: str, context: dict[str, Any]) -> dict[str, Any]:
    redundant = context["slots"] - context["num_experts"]
    placement = PLACEMENT_FILE[engine]
    plan = ["moewatch", "plan", "--load", *context["load_paths"], "--gpus", str(context["ranks"]),
            "--slots", str(context["slots"])]
    plan += ["--nodes", str(context["nodes"])] if context["nodes"] > 1 else []
    plan += ["--format", "sglang"] if engine == "sglang" else []
    plan += ["--out", placement]
    if engine == "vllm":
        config = {"num_redundant_experts": redundant}
        return {"plan": shlex.join(plan), "placement_file": placement,
                "args": f"--enable-expert-parallel --enable-eplb --eplb-config {shlex.quote(json.dumps(config))}",
                "eplb_config": config, "env": f"MOEWATCH_EPLB=1 MOEWATCH_EPLB_PLACEMENT={placement}"}
    args = f"--init-expert-location {placement}" + (f" --ep-num-redundant-experts {redundant}" if redundant else "")
    return {"plan": shlex.join(plan), "placement_file": placement, "args": args, "env": "",
            "note": "without --enable-eplb, so the placement stays"}


def rebalance_settings(engine: str, policy: str, interval_steps: int, context: dict[str, Any]) -> dict[str, Any]:
    redundant = context["slots"] - context["num_experts"]
    env = ""
    if policy == MOEWATCH:
        values = {"MOEWATCH_EPLB": "1", "MOEWATCH_EPLB_HORIZON_STEPS": str(interval_steps),
                  "MOEWATCH_EPLB_WINDOW_STEPS": str(interval_steps),
                  "MOEWATCH_EPLB_EXPERT_BYTES": f"{context['expert_bytes']:.6g}",
                  "MOEWATCH_EPLB_LINK_BYTES_PER_SECOND": f"{context['bytes_per_second']:.6g}",
                  "MOEWATCH_EPLB_INTER_NODE_BYTES_PER_SECOND": f"{context['bytes_per_second']:.6g}"}
        if context.get("seconds_per_pair"):
            values["MOEWATCH_EPLB_SECONDS_PER_PAIR"] = f"{context['seconds_per_pair']:.6g}"
        env = " ".join(f"{k}={v}" for k, v in values.items())
    if engine == "vllm":
        # The replay gives each rebalance the load since the one before: the window is the interval.
        config = {"window_size": interval_steps, "step_interval": interval_steps, "num_redundant_experts": redundant}
        return {"args": f"--enable-expert-parallel --enable-eplb --eplb-config {shlex.quote(json.dumps(config))}",
                "eplb_config": config, "env": env}
    args = (f"--enable-eplb --eplb-algorithm deepseek --eplb-rebalance-num-iterations {interval_steps}"
            + (f" --ep-num-redundant-experts {redundant}" if redundant else ""))
    return {"args": args, "env": env}
