"""The agent's poll of the engines' /metrics for their SLO signals: one scraper per EP group. The latest
interval goes to the agent's /metrics after each poll (`annotations`), and each window of that group
is stamped with it (`annotate`) before its triage, so the diagnosis carries its SLO section and the
window keeps its evidence when recorded."""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from ...slo import SLO_KEY, update_breached_since
from ...telemetry import Window
from ..base import GroupKey, Ingest, SourceError
from .scrape import SloScraper
from .settings import SloSettings, parse_endpoints

log = logging.getLogger(__name__)


class SloSource:
    job_name = "slo"
    capabilities: frozenset[str] = frozenset()

    def __init__(self, settings: SloSettings, *, fetch: Callable[[str, float], str] | None = None,
                 clock: Callable[[], float] | None = None):
        self.settings = settings
        self.poll_seconds = settings.poll_seconds
        kwargs: dict[str, Any] = {"fetch": fetch}
        if clock is not None:
            kwargs["clock"] = clock
        self.scrapers = {key: SloScraper(url, **kwargs) for key, url in parse_endpoints(settings.endpoints).items()}
        self._latest: dict[GroupKey, dict[str, Any]] = {}
        self._since: dict[GroupKey, dict[str, float]] = {}
        self._errors: dict[GroupKey, str] = {}
        self._lock = threading.Lock()

    def poll(self, ingest: Ingest) -> None:
        """Scrape every endpoint; a failing one is noted on /status and the others go on. Produces no
        windows of its own (`ingest` is not called)."""
        for key, scraper in self.scrapers.items():
            try:
                interval = scraper.scrape()
            except SourceError as e:
                with self._lock:
                    first = key not in self._errors
                    self._errors[key] = str(e)
                if first:  # once per outage, not once per poll; /status keeps the latest error
                    log.warning("slo: %s/%s: %s", *key, e)
                continue
            with self._lock:
                recovered = self._errors.pop(key, None) is not None
            if recovered:
                log.info("slo: %s/%s: scraping again", *key)
            if interval is None:
                continue
            targets = self.settings.targets
            with self._lock:
                since = update_breached_since(self._since.get(key, {}), interval, targets, interval["end_time"])
                self._since[key] = since
                self._latest[key] = {**interval, "targets": targets.to_dict(), "breached_since": since}

    def latest(self, key: GroupKey) -> dict[str, Any] | None:
        with self._lock:
            return self._latest.get(key)

    def annotations(self) -> dict[GroupKey, dict[str, Any]]:
        """{group: what its windows are stamped with now}: `extra.slo`, the latest interval, for each
        group that has one. The agent exports these to /metrics after every poll, so an interval shows
        without waiting for the group's next window (an engine that has gone idle sends none)."""
        with self._lock:
            return {key: {SLO_KEY: latest} for key, latest in self._latest.items()}

    def annotate(self, window: Window) -> Window:
        """The window with its group's latest SLO interval under `extra.slo` (unchanged without one)."""
        latest = self.latest((window.model, window.ep_group))
        if latest is None:
            return window
        return window.replace(extra={**window.extra, SLO_KEY: latest})

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {"groups": [{"model": m, "ep_group": g, "url": s.url, "latest": self._latest.get((m, g)),
                                "error": self._errors.get((m, g))} for (m, g), s in self.scrapers.items()]}
