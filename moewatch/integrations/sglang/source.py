"""SGLang as a source the agent polls (no probe inside SGLang needed): its expert-distribution dump
folder (each new dump set becomes one window, once) and its /metrics heatmap (per-rank load per layer
between two scrapes becomes one window of per-rank totals, `rank_tokens`, under the placement the
configuration gives; the latest is also on /status).

One job, every `poll_seconds` of the SGLang settings. Errors are logged when they change, not on
every poll.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from ...planner.files import FileFormatError, read_plan
from ..base import PLACEMENT, Ingest, SourceError
from .dump import DumpWatcher
from .heatmap import HeatmapScraper, RankLoad, default_placement, heatmap_window

log = logging.getLogger("moewatch.integrations.sglang.source")


class SGLangSource:
    job_name = "sglang_source"

    def __init__(self, settings: Any):
        """settings: the SGLang section (dump_dir, metrics_url, poll_seconds, placement_file,
        num_experts, model, ep_group, actuate)."""
        self._last_error = ""
        self.rejected: dict[str, int] = {}
        self.poll_seconds = settings.poll_seconds
        # Its groups take placements only when the SGLang actuator writes them.
        self.capabilities = frozenset({PLACEMENT}) if settings.actuate else frozenset()
        self.watcher = (DumpWatcher(settings.dump_dir, on_error=self._error, model=settings.model,
                                    ep_group=settings.ep_group) if settings.dump_dir else None)
        self.scraper = HeatmapScraper(settings.metrics_url) if settings.metrics_url else None
        self.rank_load: RankLoad | None = None
        self.placement_file = settings.placement_file
        self.num_experts = settings.num_experts
        self.identity = {"model": settings.model, "ep_group": settings.ep_group}
        self.heatmap_windows = 0

    def _error(self, message: str) -> None:
        if message != self._last_error:
            log.warning("sglang source: %s", message)
        self._last_error = message

    def poll(self, ingest: Ingest) -> None:
        if self.watcher is not None:
            for window in self.watcher.poll():
                reason = ingest(window)
                if reason is not None:
                    self.rejected[reason] = self.rejected.get(reason, 0) + 1
                    self._error(f"window from {window.extra.get('source', {}).get('kind', 'a dump')} refused: {reason}")
        if self.scraper is not None:
            try:
                sample = self.scraper.scrape()
            except SourceError as exc:
                self._error(str(exc))
                return
            if sample is not None:
                self.rank_load = sample
                balanced = [round(float(b), 3) for b in sample.balancedness]
                log.info("sglang heatmap: balancedness per layer %s%s", balanced,
                         " (server restarted)" if sample.reset else "")
                try:
                    window = heatmap_window(sample, self.placement(sample.load.shape[0]), label=self.scraper.url,
                                            **self.identity)
                except SourceError as exc:
                    self._error(str(exc))
                    return
                reason = ingest(window)
                if reason is None:
                    self.heatmap_windows += 1
                else:
                    self.rejected[reason] = self.rejected.get(reason, 0) + 1
                    self._error(f"window from the /metrics heatmap refused: {reason}")

    def placement(self, num_layers: int) -> np.ndarray:
        """[L, P] in force: the placement file SGLang started with (read each time: a restart may
        have brought a new one), else SGLang's default for the configured number of experts."""
        if not self.placement_file:
            return default_placement(num_layers, self.num_experts)
        try:
            return read_plan(self.placement_file).physical_to_logical_map
        except FileFormatError as exc:
            raise SourceError("sglang.placement_file", str(exc)) from None

    def status(self) -> dict[str, Any]:
        return {"dump_dir": None if self.watcher is None else str(self.watcher.folder),
                "dump_windows": 0 if self.watcher is None else self.watcher.windows,
                "dump_errors": 0 if self.watcher is None else self.watcher.errors,
                "windows_refused": dict(self.rejected),
                "metrics_url": None if self.scraper is None else self.scraper.url,
                "heatmap": None if self.rank_load is None else self.rank_load.to_dict(),
                "heatmap_windows": self.heatmap_windows,
                "last_error": self._last_error or None}
