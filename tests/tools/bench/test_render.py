"""The benchmark tables in docs/benchmarks/*.md and the README's benchmark figures are rendered from
the result files, and every number in them is in one."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from moewatch.tools.bench.render import (pages, figures_without_result, load_results, machine_state, render,
                                         render_text, slots)

ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "docs" / "benchmarks" / "results"


def test_the_docs_are_what_rendering_gives():
    records = load_results(RESULTS)
    for page in pages(ROOT):
        text = (ROOT / page).read_text()
        assert render_text(text, records) == text, f"{page}: run `moewatch bench render`"


def test_every_benchmark_page_and_the_readme_have_slots():
    for page in pages(ROOT):
        assert slots((ROOT / page).read_text()), page


def test_every_figure_in_the_docs_is_in_a_result_file():
    records = load_results(RESULTS)
    for page in pages(ROOT):
        assert figures_without_result((ROOT / page).read_text(), records) == [], page


def test_the_eplb_page_has_no_table_outside_its_rendered_slot():
    # Its figures come from the result file through the slot; a table typed beside it goes stale unseen.
    from moewatch.tools.bench.render import SLOT

    outside = SLOT.sub("", (ROOT / "docs" / "benchmarks" / "eplb.md").read_text())
    assert [line for line in outside.splitlines() if line.startswith("|")] == []


def _record(bench: str, result: dict, busy: bool, others: float = 0.5) -> dict:
    return {"bench": bench, "file": f"{bench}-x.json", "result": result,
            "provenance": {"commit": "0" * 40, "command": f"moewatch bench {bench} --json",
                           "started_utc": "2026-12-01T10:00:00Z", "busy": busy, "other_cpu_cores": others}}


def test_a_hand_typed_figure_is_caught():
    records = [_record("agent", {"cpu_share": 0.037, "config": {"rate": 1.0}}, busy=True)]
    text = render_text("<!-- bench:agent -->\n<!-- /bench:agent -->\n", records)
    assert figures_without_result(text, records) == []
    typed = text.replace("0.037", "0.031")
    assert figures_without_result(typed, records) == ["bench:agent: 0.031"]


def test_busy_runs_are_marked_busy_and_none_is_called_quiet():
    busy = _record("agent", {"cpu_share": 0.04}, busy=True, others=0.62)
    calm = _record("agent", {"cpu_share": 0.04}, busy=False, others=0.03)
    assert machine_state(busy["provenance"]).startswith("**busy**")
    assert "busy" not in machine_state(calm["provenance"])
    text = render_text("<!-- bench:agent -->\n<!-- /bench:agent -->\n", [busy, calm])
    assert "**busy** (others 0.62 cores)" in text and "others 0.03 cores" in text
    assert "quiet" not in text.lower()


def test_a_planner_comparison_names_the_eplb_that_ran():
    for page in pages(ROOT):
        for name, body in slots((ROOT / page).read_text()):
            if "EPLB" in body and "No recorded" not in body:
                assert "port of DeepSeek's EPLB" in body, (page, name)


def test_render_check_exits_1_when_a_page_would_change(tmp_path):
    out = CliRunner().invoke(render, ["--check"])
    assert out.exit_code == 0, out.output
    (tmp_path / "agent-20261201T000000Z.json").write_text(json.dumps(
        _record("agent", {"cpu_share": 0.5}, busy=True) | {"schema": "moewatch-bench-result/1"}))
    out = CliRunner().invoke(render, ["--check", "--results-dir", str(tmp_path)])
    assert out.exit_code == 1 and "would change" in out.output


def test_the_pictures_are_what_drawing_gives():
    from moewatch.tools.bench.render import FIGURES

    records = load_results(RESULTS)
    for page, draw in FIGURES.items():
        drawn = draw(records)
        assert drawn is not None, f"{page}: no result to draw it from"
        assert (ROOT / page).read_text() == drawn, f"{page}: run `moewatch bench render`"
