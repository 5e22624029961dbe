"""`moewatch bench agent --json`: the contract's keys from a real agent process fed over its socket
(a small size and a short run here; the figures themselves go into notes, never into assertions)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moewatch.tools.bench.agent import CONTRACT_KEYS


@pytest.mark.slow
def test_bench_agent_prints_the_contract_keys(tmp_path):
    out = subprocess.run([sys.executable, "-m", "moewatch.cli", "bench", "agent", "--layers", "3", "--experts", "8",
                          "--slots", "8", "--ranks", "2", "--top-k", "2", "--rate", "5", "--seconds", "1",
                          "--scrape-interval", "0.2", "--json", "--results-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)  # --json: machine output only, progress on stderr
    assert set(CONTRACT_KEYS) <= set(result)
    assert "bench agent:" in out.stderr
    assert result["windows_sent"] == 10 and result["windows_processed"] == 10 and result["windows_lagging"] == 0
    assert result["cpu_per_window_s"] > 0 and 0 < result["cpu_share"] and result["rss_mb"] > 10
    assert result["scrape_ms_p50"] > 0 and result["triage_ms"] > 0 and result["scrapes"] >= 1
    assert result["phase_cpu_ms"]["triage"] > 0 and result["scrape_ms_p99"] >= result["scrape_ms_p50"]
    assert result["config"] == {"layers": 3, "experts": 8, "slots": 8, "ranks": 2, "top_k": 2, "rate": 5.0,
                                "seconds": 1.0, "mode": "observe"}
    # The run is recorded with its provenance, the command line as typed.
    record = json.loads(next(tmp_path.glob("agent-*.json")).read_text())
    assert record["result"] == result
    typed = ("bench agent --layers 3 --experts 8 --slots 8 --ranks 2 --top-k 2 --rate 5 --seconds 1 "
             f"--scrape-interval 0.2 --json --results-dir {tmp_path}")
    assert record["provenance"]["command"].endswith(typed)


def test_bench_agent_rejects_impossible_sizes_with_exit_2():
    out = subprocess.run([sys.executable, "-m", "moewatch.cli", "bench", "agent", "--experts", "8", "--slots", "6",
                          "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == "" and "--slots 6" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_bench_windows_carry_every_evidence_and_each_phase_is_timed():
    from moewatch.tools.bench.agent import PHASES, full_evidence_window, phase_cpu_ms

    windows = [full_evidence_window(seed, num_layers=4, num_experts=16, num_slots=24, world_size=8, top_k=2)
               for seed in range(2)]
    w = windows[0]
    assert w.missing_evidence == [] and w.absent_fields == []
    assert w.dropped_tokens.sum() > 0 and (w.capacity_factor > 0).all() and w.traffic.shape == (4, 8, 8)
    assert (w.slot_tokens.sum(axis=1) == w.expert_tokens.sum(axis=1) - w.dropped_tokens.sum(axis=1)).all()
    phases = phase_cpu_ms(windows, repeats=3)
    assert set(phases) == {*PHASES, "total"}
    assert all(phases[p] >= 0 for p in PHASES) and phases["triage"] > 0 and phases["export"] > 0
    assert phases["total"] == pytest.approx(sum(phases[p] for p in PHASES if p != "scrape"), abs=0.05)
