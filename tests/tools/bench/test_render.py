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


def test_the_eplb_page_has_no_figure_outside_its_rendered_slot():
    # Prose beside the slot quotes no number: a figure typed there outlives the run it came from.
    import re

    from moewatch.tools.bench.render import SLOT, _numbers

    outside = SLOT.sub("", (ROOT / "docs" / "benchmarks" / "eplb.md").read_text())
    outside = re.sub(r"```.*?```", "", outside, flags=re.S)  # commands, not figures
    outside = re.sub(r"\]\([^)]*\)", "]", outside)  # link targets
    assert _numbers(outside) == []


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


def test_the_eplb_table_shows_slots_over_the_lp_bound_the_pauses_and_the_integer_programs():
    figures = {"balancedness_after": [0.994, 0.995], "experts_moved_total": 118, "experts_moved": [118, 0],
               "solve_seconds_median": 0.0123, "layers_kept_by_gate": [0, 0],
               "bound": {"rebalances": [0, 1], "slots_moved": 118, "lp_bound": 54, "moved_over_lp_bound": 2.185,
                         "integer_program": [{"layer": 0, "status": "time limit", "slots_rewritten": None,
                                              "slots_rewritten_bound": 54, "lp_bound": 54, "slots_moved": 118,
                                              "seconds": 30.2}]},
               "pause": {"pause_max_seconds": 0.0033, "pause_p99_seconds": 0.0017}}
    result = {"shape": {"layers": 1, "experts": 256, "slots": 320, "ranks": 64, "nodes": 8, "optimum_seconds": 30.0},
              "results": {"lognormal": {"moewatch": figures}}, "goals": {"longest_pause_at_most_5_ms": True},
              "bound_seconds": 41.5}
    records = [_record("eplb", result, busy=True)]
    text = render_text("<!-- bench:eplb -->\n<!-- /bench:eplb -->\n", records)
    row = next(line for line in text.splitlines() if line.startswith("| lognormal | moewatch"))
    assert "| 0, 1 | 118 / 54 | 2.19 |" in row and "| 3.3 | 1.7 |" in row
    assert "| lognormal | moewatch | 0 | time limit | n/a | 54 | 54 | 118 | 30.2 |" in text
    assert "longest_pause_at_most_5_ms **pass**" in text
    assert figures_without_result(text, records) == []
