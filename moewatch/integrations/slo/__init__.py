"""The engines' own SLO signals (docs/integrations.md, "SLO signals"): vLLM's and SGLang's
latency histograms and request gauges scraped from their /metrics (`engines`, `scrape`,
`histogram`), per EP group (`settings`, the `slo:` section), stamped on each window of the group
before its triage (`source`). The judgment itself (breaches, the MoE attribution, the
recommendations) is moewatch/slo.py's."""

from __future__ import annotations

from typing import Any

from ..base import Integration, Source
from .settings import SECTION, SloSettings


def _source(settings: Any) -> Source | None:
    if not settings.endpoints:
        return None
    from .source import SloSource
    return SloSource(settings)


INTEGRATION = Integration(name="slo", settings_section=SECTION, settings_class=SloSettings, make_source=_source)
