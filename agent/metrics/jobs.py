"""Families the scheduler writes: job runs that raised or were missed."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .family import Counter, families_of

if TYPE_CHECKING:
    from .state import MetricsState

JOB_ERRORS_TOTAL = Counter("moewatch_job_errors_total", ("task",), "Scheduled job runs that raised.")
JOB_MISFIRES_TOTAL = Counter("moewatch_job_misfires_total", ("task",), "Scheduled job runs missed.")

FAMILIES = families_of(globals())


def init_jobs(state: MetricsState, jobs: list[str]) -> None:
    """Each job's counters start at 0, so a first error is an increase."""
    for job in jobs:
        state[JOB_ERRORS_TOTAL].inc((job,), 0)
        state[JOB_MISFIRES_TOTAL].inc((job,), 0)
