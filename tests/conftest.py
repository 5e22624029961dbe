"""Suite-wide settings."""

import os
import pathlib

import pytest
from hypothesis import settings

# CI draws the same examples every run, so a submission's result never depends on which random
# examples a run happened to try; developers' runs keep exploring new ones (and pin what they find
# with @example).
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


RESULTS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "results"


@pytest.fixture(scope="session", autouse=True)
def benchmark_results_untouched():
    """Tests run bench verbs with --results-dir or --no-record: the published result files are written by
    real runs only, never by the suite."""
    before = sorted(RESULTS.glob("*.json"))
    yield
    written = sorted(set(RESULTS.glob("*.json")) - set(before))
    assert not written, f"a test wrote benchmark results into the repository: {[p.name for p in written]}"


@pytest.fixture(autouse=True)
def planner_compile_default_restored(monkeypatch):
    """A test that runs an agent session in this process (the demo, bench loop) switches the planner's
    compiled loops to "only when asked", as `moewatch agent` does for its process: restored after it,
    so the planner's own tests see the default they are written for."""
    from moewatch.planner import mending_compiled

    monkeypatch.setattr(mending_compiled, "_default_on", mending_compiled._default_on)
