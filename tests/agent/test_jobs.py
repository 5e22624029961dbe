"""Scheduled jobs: a job that raises or overruns is counted and the scheduler keeps going."""

from __future__ import annotations

import threading
from collections import Counter

from moewatch.agent.jobs import Jobs


def test_errors_and_misfires_are_counted_never_fatal(helpers):
    errors, misfires, runs = Counter(), Counter(), Counter()
    release = threading.Event()
    jobs = Jobs(on_error=lambda job: errors.update([job]), on_misfire=lambda job: misfires.update([job]))

    def broken() -> None:
        runs["broken"] += 1
        raise RuntimeError("boom")

    def slow() -> None:
        runs["slow"] += 1
        release.wait(1.0)  # longer than its interval: the next run finds it still running

    jobs.add("broken", broken, 0.05, first_run_in=0)
    jobs.add("slow", slow, 0.05, first_run_in=0)
    jobs.add("fine", lambda: runs.update(["fine"]), 0.05, first_run_in=0)
    jobs.start()
    try:
        assert helpers.wait_for(lambda: errors["broken"] >= 3 and misfires["slow"] >= 1 and runs["fine"] >= 3)
        assert jobs.running
    finally:
        release.set()
        jobs.shutdown()
    assert not jobs.running
    assert errors["fine"] == 0 and runs["broken"] == errors["broken"]


def test_daemon_counts_job_errors_in_metrics(start_agent, helpers, monkeypatch):
    daemon = start_agent()
    assert daemon.metrics.get("moewatch_job_errors_total", ("triage",)) == 0
    # A triage that raises (a bug, a bad window that slipped through) is counted, and the next run works.
    original = daemon.store.groups
    calls = Counter()

    def flaky():
        calls["n"] += 1
        if calls["n"] <= 2:
            raise RuntimeError("flaky")
        return original()

    monkeypatch.setattr(daemon.store, "groups", flaky)
    assert helpers.wait_for(lambda: daemon.metrics.get("moewatch_job_errors_total", ("triage",), 0) >= 1)
    assert helpers.wait_for(lambda: calls["n"] > 4)
    assert daemon.jobs.running
