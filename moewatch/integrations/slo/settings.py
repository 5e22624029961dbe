"""The `slo:` section of the agent's configuration: which engines' /metrics to scrape for each EP
group, and the SLO targets the agent judges them by."""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass

from moewatch.settings import check_section, setting
from moewatch.slo import SloTargets
from moewatch.thresholds import ConfigError

SECTION = "slo"


def parse_endpoints(text: str) -> dict[tuple[str, str], str]:
    """`MODEL/EP_GROUP=URL[,MODEL/EP_GROUP=URL...]` -> {(model, ep_group): url}; ConfigError naming
    the entry that is not one."""
    out: dict[tuple[str, str], str] = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        group, sep, url = entry.partition("=")
        model, slash, ep_group = group.strip().partition("/")
        parsed = urllib.parse.urlsplit(url.strip())
        if not sep or not slash or not model or not ep_group or parsed.scheme not in ("http", "https") \
                or not parsed.hostname:
            raise ConfigError(f"slo.endpoints: expected MODEL/EP_GROUP=http://HOST:PORT/metrics, got {entry!r}")
        if (model, ep_group) in out:
            raise ConfigError(f"slo.endpoints: group {model}/{ep_group} is listed twice")
        out[(model, ep_group)] = url.strip()
    return out


@dataclass(frozen=True)
class SloSettings:
    endpoints: str = setting("", "the engines' /metrics per EP group, MODEL/EP_GROUP=URL separated by commas "
                                 "(vLLM's or SGLang's; empty: no SLO signals)")
    poll_seconds: float = setting(15.0, "how often each engine's /metrics is scraped (the SLO interval)",
                                  kind=float, lo=0.1, hi=86_400)
    ttft_p99_seconds: float = setting(0.2, "the SLO on the time to first token's p99, in seconds", kind=float,
                                      lo=0.0001, hi=3600)
    tpot_p99_seconds: float = setting(0.05, "the SLO on the time per output token's p99 (the inter-token "
                                            "latency where the engine has no TPOT histogram), in seconds",
                                      kind=float, lo=0.0001, hi=3600)
    explain_share: float = setting(0.2, "the MoE evidence explains a latency breach when the unhealthy layers' "
                                        "seconds at stake per step reach this share of the inter-token latency",
                                   kind=float, lo=0.0, hi=1.0)

    def __post_init__(self) -> None:
        check_section(self, SECTION)
        parse_endpoints(self.endpoints)

    @property
    def targets(self) -> SloTargets:
        return SloTargets(self.ttft_p99_seconds, self.tpot_p99_seconds, self.explain_share)
