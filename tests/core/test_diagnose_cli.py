"""`moewatch diagnose`: the --json contract, --fail-on, thresholds from YAML and flags, bad input -> exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from moewatch.cli import main
from moewatch.tools.examples import SCENARIOS, write_examples

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def example_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("examples")
    write_examples(folder)
    return folder


def run(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_committed_examples_are_what_the_generator_writes(example_dir):
    for name in SCENARIOS:
        assert (ROOT / "examples" / f"{name}.json").read_text() == (example_dir / f"{name}.json").read_text(), name


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_each_committed_example_gets_its_intended_verdict(name):
    result = run("diagnose", str(ROOT / "examples" / f"{name}.json"), "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    s = SCENARIOS[name]
    assert [layer["layer"] for layer in out["layers"]] == list(range(len(out["layers"])))
    for layer in out["layers"]:
        assert set(layer) >= {"layer", "verdict", "cause", "overflow", "metrics", "actions"}
        assert isinstance(layer["overflow"], bool)
        assert (layer["verdict"], layer["cause"], layer["overflow"]) == (s.intended_verdict, s.intended_cause,
                                                                         s.intended_overflow)


def test_human_output_is_a_table_worst_first(example_dir):
    result = run("diagnose", str(example_dir / "imbalance-hot-experts.json"))
    assert result.exit_code == 0
    lines = result.output.splitlines()
    table = lines[lines.index(next(l for l in lines if l.startswith("layer"))):]
    assert "imbalance-bound" in table[1] and "replicate" in table[1]
    assert "slowest rank: 0" in result.output


def test_fail_on_exits_one_only_when_a_layer_matches(example_dir):
    assert run("diagnose", str(example_dir / "healthy.json"), "--fail-on", "comm-bound,imbalance-bound").exit_code == 0
    assert run("diagnose", str(example_dir / "comm-bound-volume.json"), "--fail-on", "comm-bound").exit_code == 1


def test_thresholds_from_yaml_then_flags(example_dir, tmp_path):
    path = str(example_dir / "comm-bound-volume.json")
    config = tmp_path / "t.yaml"
    config.write_text("thresholds:\n  comm_share: 0.9\n")
    out = json.loads(run("diagnose", path, "--json", "--config", str(config)).output)
    assert {layer["verdict"] for layer in out["layers"]} == {"healthy"}
    out = json.loads(run("diagnose", path, "--json", "--config", str(config), "--comm-share", "0.5").output)
    assert {layer["verdict"] for layer in out["layers"]} == {"comm-bound"}


def good_window(example_dir) -> dict:
    return json.loads((example_dir / "healthy.json").read_text())


def mutated(example_dir, tmp_path, change) -> str:
    data = good_window(example_dir)
    change(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    return str(path)


BAD_INPUTS = {
    "missing file": (lambda d, t: str(t / "nope.json"), "no such file"),
    "folder": (lambda d, t: str(t), "is a folder"),
    "empty": (lambda d, t: _write(t, ""), "empty file"),
    "invalid json": (lambda d, t: _write(t, "{this is not json"), "not valid JSON"),
    "truncated json": (lambda d, t: _write(t, (d / "healthy.json").read_text()[:500]), "not valid JSON"),
    "wrong shape": (lambda d, t: mutated(d, t, lambda w: w["expert_tokens"].pop()), "expert_tokens: shape"),
    "nan": (lambda d, t: _write(t, (d / "healthy.json").read_text().replace('"start_time": 1790000000.0',
                                                                             '"start_time": NaN')), "NaN"),
    "negative count": (lambda d, t: mutated(d, t, lambda w: w["sent_tokens"][0].__setitem__(0, -3)), "negative"),
    "map out of range": (lambda d, t: mutated(d, t, lambda w: w["physical_to_logical_map"][1].__setitem__(0, 64)),
                         "outside [0, 16)"),
    "sums disagree": (lambda d, t: mutated(d, t, lambda w: w["slot_tokens"][0].__setitem__(0, 0)), "slot_tokens"),
    "unknown schema": (lambda d, t: mutated(d, t, lambda w: w.__setitem__("schema", "other/v2")), "unknown schema"),
    "not an object": (lambda d, t: _write(t, "[1, 2, 3]"), "expected a JSON object"),
}


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "bad.json"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_exits_two_with_one_line(example_dir, tmp_path, case):
    make, needle = BAD_INPUTS[case]
    result = CliRunner().invoke(main, ["diagnose", make(example_dir, tmp_path), "--json"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], lines
    assert "Traceback" not in result.output + result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("args,needle", [
    (["--fail-on", "slow"], "unknown verdict"),
    (["--comm-share", "1.5"], "comm_share"),
    (["--config", "MISSING.yaml"], "cannot read"),
])
def test_bad_options_exit_two(example_dir, args, needle):
    result = CliRunner().invoke(main, ["diagnose", str(example_dir / "healthy.json"), *args])
    assert result.exit_code == 2 and needle in result.output + result.stderr


def test_yaml_with_unknown_threshold_names_it(example_dir, tmp_path):
    config = tmp_path / "t.yaml"
    config.write_text("thresholds:\n  comm_shar: 0.4\n")
    result = CliRunner().invoke(main, ["diagnose", str(example_dir / "healthy.json"), "--config", str(config)])
    assert result.exit_code == 2 and "thresholds.comm_shar: unknown threshold" in result.stderr


def test_binary_window_files_are_read_too(example_dir, tmp_path):
    from moewatch.telemetry import Window

    blob = tmp_path / "w.bin"
    blob.write_bytes(Window.from_json((example_dir / "overflow.json").read_text()).to_bytes())
    out = json.loads(run("diagnose", str(blob), "--json").output)
    assert all(layer["overflow"] for layer in out["layers"])


def test_a_named_straggler_comes_with_each_rank_speed():
    """The slow-device example (rank 0 computes 1.8x slower): the human output prints each rank's pairs
    per second and its speed over the median rank's; the JSON summary carries them for every window."""
    result = run("diagnose", str(ROOT / "examples" / "imbalance-straggler.json"))
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if line.startswith("rank speed"))
    assert "pairs/s" in line and line.count("x)") >= 2
    out = json.loads(run("diagnose", str(ROOT / "examples" / "imbalance-straggler.json"), "--json").output)
    speed = out["summary"]["rank_speed"]
    assert speed["relative"][0] < 0.85 and all(r > 0.85 for r in speed["relative"][1:])
    assert all(rate > 0 for rate in speed["pairs_per_second"])
    # No straggler named: no speed line (the JSON still has the numbers).
    hot = run("diagnose", str(ROOT / "examples" / "imbalance-hot-experts.json"))
    assert not any(line.startswith("rank speed") for line in hot.output.splitlines())
    assert json.loads(run("diagnose", str(ROOT / "examples" / "imbalance-hot-experts.json"), "--json").output)[
        "summary"]["rank_speed"] is not None
