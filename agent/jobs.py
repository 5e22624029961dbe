"""The agent's scheduled jobs on APScheduler 3.x (BackgroundScheduler).

Every job is an interval job with coalesce (a backlog of missed runs becomes one run) and
max_instances=1 (a slow run is never overlapped by the next). A job that raises, or a run that is
missed or skipped because the previous one still runs, is counted (moewatch_job_errors_total,
moewatch_job_misfires_total) and logged once per job per interval (APScheduler's own warning
about the same skipped run is filtered out); the scheduler keeps going, so a failing job is never
fatal.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone
from typing import Callable

from apscheduler.events import EVENT_JOB_ERROR, EVENT_JOB_MAX_INSTANCES, EVENT_JOB_MISSED, JobEvent
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.interval import IntervalTrigger

log = logging.getLogger("moewatch.agent.jobs")


class _SkippedRunFilter(logging.Filter):
    """Drops APScheduler's warnings for missed or overlapping runs: Jobs logs each (throttled)."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        return not ("maximum number of running instances" in text or "was missed by" in text)


_FILTER = _SkippedRunFilter()


class Jobs:
    def __init__(self, on_error: Callable[[str], None], on_misfire: Callable[[str], None],
                 log_interval: float = 60.0):
        from .throttle import Throttle

        self._throttle = Throttle(log_interval)
        for name in ("apscheduler.scheduler", "apscheduler.executors.default"):
            logger = logging.getLogger(name)
            if _FILTER not in logger.filters:
                logger.addFilter(_FILTER)
        self.scheduler = BackgroundScheduler(timezone=timezone.utc, job_defaults={
            "coalesce": True, "max_instances": 1, "misfire_grace_time": None})
        self._on_error = on_error
        self._on_misfire = on_misfire
        self.scheduler.add_listener(self._listen, EVENT_JOB_ERROR | EVENT_JOB_MISSED | EVENT_JOB_MAX_INSTANCES)

    def _listen(self, event: JobEvent) -> None:
        if event.code == EVENT_JOB_ERROR:
            log.error("job %s raised %r", event.job_id, getattr(event, "exception", None))
            self._on_error(event.job_id)
        else:
            self._on_misfire(event.job_id)
            held = self._throttle(f"misfire:{event.job_id}")
            if held is not None:
                log.warning("job %s skipped a run: the previous one still runs or the process was busy%s",
                            event.job_id, f" ({held} more since the last line)" if held else "")

    def add(self, job_id: str, func: Callable[[], None], interval_seconds: float, jitter: float | None = None,
            first_run_in: float | None = None) -> None:
        trigger = IntervalTrigger(seconds=interval_seconds, jitter=jitter, timezone=timezone.utc)
        first = datetime.now(timezone.utc) + timedelta(seconds=interval_seconds if first_run_in is None
                                                       else first_run_in)
        self.scheduler.add_job(func, trigger, id=job_id, name=job_id, next_run_time=first)

    def start(self) -> None:
        self.scheduler.start()

    @property
    def running(self) -> bool:
        return bool(self.scheduler.running)

    def shutdown(self) -> None:
        if self.scheduler.running:
            self.scheduler.shutdown(wait=True)
