"""The engines' own SLOs beside the MoE evidence: which SLO a window's interval breaches, for how
long, and whether the MoE triage of the same window explains it.

A source of SLO signals (moewatch/integrations/slo/) stamps each window with the interval's
latency quantiles under `Window.extra["slo"]` (`SLO_KEY`), with the targets it judged them by and
since when each has been breached; `section` turns that and the window's layer diagnoses into the
diagnosis' `slo` section. Pure functions of dicts and diagnoses.

The targets and rules come from the source documents: TTFT p99 under 200 ms, TPOT p99 under 50 ms;
TTFT over its SLO -> smaller prefill chunks; TPOT over its SLO -> lower concurrency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

SLO_KEY = "slo"  # Window.extra key

TTFT_P99, TPOT_P99 = "ttft_p99", "tpot_p99"
RECOMMENDATIONS = {
    TTFT_P99: "TTFT over its SLO: use smaller prefill chunks (vLLM --max-num-batched-tokens, SGLang "
              "--chunked-prefill-size).",
    TPOT_P99: "TPOT over its SLO: lower the concurrency (vLLM --max-num-seqs, SGLang --max-running-requests).",
}


@dataclass(frozen=True)
class SloTargets:
    ttft_p99_seconds: float = 0.2
    tpot_p99_seconds: float = 0.05
    # The MoE evidence explains a breach when the unhealthy layers' seconds at stake per step reach
    # this share of the inter-token latency (one decode step's time, as the engine measures it).
    explain_share: float = 0.2

    def to_dict(self) -> dict[str, float]:
        return {"ttft_p99_seconds": self.ttft_p99_seconds, "tpot_p99_seconds": self.tpot_p99_seconds,
                "explain_share": self.explain_share}

    @classmethod
    def from_dict(cls, data: Any) -> "SloTargets":
        data = data if isinstance(data, dict) else {}
        return cls(**{k: float(v) for k, v in data.items() if k in cls.__dataclass_fields__
                      and isinstance(v, (int, float)) and not isinstance(v, bool)})


def _p99(interval: dict[str, Any], signal: str) -> float | None:
    value = (interval.get("quantiles") or {}).get(signal, {}) or {}
    value = value.get("p99")
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def per_token_p99(interval: dict[str, Any]) -> tuple[str | None, float | None]:
    """The per-output-token latency the TPOT SLO is judged on: time per output token where the
    engine exposes it, else the inter-token latency."""
    for signal in ("tpot", "itl"):
        value = _p99(interval, signal)
        if value is not None:
            return signal, value
    return None, None


def breaches(interval: dict[str, Any], targets: SloTargets) -> dict[str, bool | None]:
    """{slo: True when over its target, False when under, None when not measured in the interval}."""
    ttft = _p99(interval, "ttft")
    _, tpot = per_token_p99(interval)
    return {TTFT_P99: None if ttft is None else ttft > targets.ttft_p99_seconds,
            TPOT_P99: None if tpot is None else tpot > targets.tpot_p99_seconds}


def update_breached_since(previous: dict[str, float], interval: dict[str, Any], targets: SloTargets,
                          now: float) -> dict[str, float]:
    """{slo: unix time its breach began}: kept while breached, set when it starts, dropped when the
    SLO is met; an unmeasured interval keeps what was known."""
    out = {}
    for slo, over in breaches(interval, targets).items():
        if over is None and slo in previous:
            out[slo] = previous[slo]
        elif over:
            out[slo] = previous.get(slo, interval.get("start_time") or now)
    return out


def section(slo: Any, layers: Iterable[Any]) -> dict[str, Any] | None:
    """The diagnosis' SLO section from a window's `extra.slo` and its LayerDiagnosis list; None when
    the window carries no SLO signals."""
    if not isinstance(slo, dict) or not isinstance(slo.get("quantiles"), dict):
        return None
    targets = SloTargets.from_dict(slo.get("targets"))
    end = slo.get("end_time")
    since = slo.get("breached_since") or {}
    per_token_signal, per_token = per_token_p99(slo)
    values = {TTFT_P99: _p99(slo, "ttft"), TPOT_P99: per_token}
    target_of = {TTFT_P99: targets.ttft_p99_seconds, TPOT_P99: targets.tpot_p99_seconds}
    breached = []
    for name, over in breaches(slo, targets).items():
        if not over:
            continue
        start = since.get(name)
        lasting = (float(end) - float(start)) if isinstance(end, (int, float)) and isinstance(start, (int, float)) \
            else None
        breached.append({"slo": name, "value_seconds": values[name], "target_seconds": target_of[name],
                         "breached_for_seconds": lasting, "recommendation": RECOMMENDATIONS[name]})
    itl = _p99(slo, "itl") or per_token
    return {"engine": slo.get("engine"), "start_time": slo.get("start_time"), "end_time": end,
            "targets": targets.to_dict(), "per_token_signal": per_token_signal,
            "quantiles": slo["quantiles"], "gauges": slo.get("gauges") or {}, "breached": breached,
            "moe": attribution(layers, itl, targets.explain_share) if breached else None}


def attribution(layers: Iterable[Any], itl_p99: float | None, explain_share: float) -> dict[str, Any]:
    """Whether the MoE evidence explains a latency breach: the seconds per step at stake in the
    imbalance-bound and comm-bound layers, as a share of the inter-token latency. `explains` is
    True at or over `explain_share`, False under it (the cause is elsewhere), None when it cannot
    be told (unmeasured stake or latency)."""
    unhealthy = [d for d in layers if d.verdict in ("imbalance-bound", "comm-bound")]
    known = [d for d in unhealthy if math.isfinite(d.seconds_at_stake)]
    stake = sum(d.seconds_at_stake for d in known)
    top = sorted(known, key=lambda d: -d.seconds_at_stake)[:5]
    out: dict[str, Any] = {"layers": [{"layer": d.layer, "verdict": d.verdict, "cause": d.cause,
                                       "seconds_at_stake": d.seconds_at_stake} for d in top],
                           "seconds_at_stake_per_step": stake if known else None, "share_of_itl": None,
                           "explains": None}
    if not unhealthy:
        out.update(explains=False, seconds_at_stake_per_step=0.0,
                   share_of_itl=0.0 if itl_p99 is not None and itl_p99 > 0 else None,
                   text="No MoE layer is imbalance-bound or comm-bound: the cause is elsewhere.")
        return out
    if not known or itl_p99 is None or itl_p99 <= 0:
        out["text"] = (f"{len(unhealthy)} MoE layers are unhealthy, but their seconds at stake (or the "
                       "inter-token latency) are not measured: whether they explain the breach is unknown.")
        return out
    share = stake / itl_p99
    out["share_of_itl"] = share
    out["explains"] = share >= explain_share
    if out["explains"]:
        out["text"] = (f"The unhealthy MoE layers put {stake * 1e3:.2f} ms per step at stake, {share:.0%} of the "
                       f"inter-token latency p99 (threshold {explain_share:.0%}): the MoE evidence explains it.")
    else:
        out["text"] = (f"The unhealthy MoE layers put only {stake * 1e3:.2f} ms per step at stake, {share:.0%} of "
                       f"the inter-token latency p99 (threshold {explain_share:.0%}): the cause is elsewhere.")
    return out
