"""SGLang as a source the agent polls (no probe inside SGLang needed): its expert-distribution dump
folder (each new dump set becomes one window, once) and its /metrics heatmap (per-rank load per layer
between scrapes, kept for /status: without per-expert counts it is not a Window).

One job, every `sglang_poll_seconds`. Errors are logged when they change, not on every poll.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from moewatch.sources import SourceError
from moewatch.sources.sglang_dump import DumpWatcher
from moewatch.sources.sglang_metrics import HeatmapScraper, RankLoad
from moewatch.telemetry import Window

log = logging.getLogger("moewatch.agent.sglang")


class SGLangSource:
    def __init__(self, cfg, ingest: Callable[[Window], str | None]):
        self.ingest = ingest
        self._last_error = ""
        self.rejected: dict[str, int] = {}
        self.watcher = (DumpWatcher(cfg.sglang_dump_dir, on_error=self._error, model=cfg.sglang_model,
                                    ep_group=cfg.sglang_ep_group) if cfg.sglang_dump_dir else None)
        self.scraper = HeatmapScraper(cfg.sglang_metrics_url) if cfg.sglang_metrics_url else None
        self.rank_load: RankLoad | None = None

    def _error(self, message: str) -> None:
        if message != self._last_error:
            log.warning("sglang source: %s", message)
        self._last_error = message

    def poll(self) -> None:
        if self.watcher is not None:
            for window in self.watcher.poll():
                reason = self.ingest(window)
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

    def status(self) -> dict[str, Any]:
        return {"dump_dir": None if self.watcher is None else str(self.watcher.folder),
                "dump_windows": 0 if self.watcher is None else self.watcher.windows,
                "dump_errors": 0 if self.watcher is None else self.watcher.errors,
                "windows_refused": dict(self.rejected),
                "metrics_url": None if self.scraper is None else self.scraper.url,
                "heatmap": None if self.rank_load is None else self.rank_load.to_dict(),
                "last_error": self._last_error or None}
