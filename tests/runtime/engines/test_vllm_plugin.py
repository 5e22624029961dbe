"""A real vLLM (CPU build, in .venv-vllm) serving a tiny random-weight MoE with moewatch's plugin
active: the windows' expert counts equal, for every layer and expert, the histogram transformers
computes on the same weights and tokens (float32). Two engine starts cover eager and compiled,
multiprocessing on and off, TP=2 (whose counts must not double) and one rank: eager + worker
processes + TP=2, then compiled in-process (compiling once, not on two ranks, keeps it short). The
first also sends its windows to a running agent, whose /metrics then shows the layers with the
evidence that vLLM could not give marked missing. The second also binds vLLM's own routed-experts
capturer to the same routers after the model is built (the router's one capture slot, shared), and
shows from vLLM's compilation state that the model was compiled. `moewatch bench vllm` runs for real
on a tiny model, two rounds."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from moewatch.telemetry import Window
from moewatch.tools.bench.vllm import save_random_moe

REPO = Path(__file__).resolve().parents[3]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
DRIVER = Path(__file__).parent / "vllm_driver.py"
EXPERTS, TOP_K, VOCAB = 16, 2, 512


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """(model folder, prompts file, prompts): distinct random weights per layer, saved by transformers."""
    folder = tmp_path_factory.mktemp("vllm")
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=256, num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, moe_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[],
        norm_topk_prob=True, tie_word_embeddings=False)
    save_random_moe(config, folder / "model", seed=0)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 17, 33, 9, 24, 2)]
    (folder / "prompts.json").write_text(json.dumps(prompts))
    return folder / "model", folder / "prompts.json", prompts


def transformers_histogram(model_dir: Path, sequences: list[list[int]]) -> np.ndarray:
    """[L, E] pairs per layer and expert: transformers' own router on each sequence, top-k of its logits."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    routers = [m for name, m in model.named_modules() if name.endswith("mlp.gate")]
    logits: dict[int, torch.Tensor] = {}
    for i, router in enumerate(routers):
        router.register_forward_hook(lambda m, a, out, i=i: logits.__setitem__(i, out[0]))
    counts = np.zeros((len(routers), EXPERTS), dtype=np.int64)
    with torch.no_grad():
        for seq in sequences:
            model(input_ids=torch.tensor([seq]))
            for i in range(len(routers)):
                chosen = torch.topk(logits[i], TOP_K, dim=-1).indices
                counts[i] += np.bincount(chosen.reshape(-1).numpy(), minlength=EXPERTS)
    return counts


def run_vllm(tiny_model, out: Path, *, compiled: bool, multiprocessing: bool, tp: int = 1,
             socket: str | None = None, vllm_capture: bool = False,
             slow_sample: float = 0.0) -> tuple[list[Window], list[Path], dict]:
    """Serve the prompts once (3 tokens each); returns (windows, their files, the driver's result:
    "generated" holds the tokens each prompt generated; see vllm_driver.py for the rest)."""
    assert VLLM_PYTHON.is_file(), f"{VLLM_PYTHON} is missing: `make vllm-env` builds vLLM's environment"
    model_dir, prompts_path, _ = tiny_model
    windows_dir = out / "windows"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOEWATCH_", "VLLM_"))}
    # A compile cache of its own: a graph compiled earlier (with other code bound) is never loaded.
    env.update(MOEWATCH_WINDOW_DIR=str(windows_dir), MOEWATCH_WINDOW_STEPS="2", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocessing else "0", VLLM_CACHE_ROOT=str(out / "vllm-cache"))
    if socket:
        env["MOEWATCH_SOCKET"] = socket
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))
    args = [str(VLLM_PYTHON), str(DRIVER), str(model_dir), str(prompts_path), str(out / "out.json"), "--tp", str(tp)]
    args += (["--compiled"] if compiled else []) + (["--vllm-capture"] if vllm_capture else [])
    args += ["--slow-sample", str(slow_sample)] if slow_sample else []
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-4000:]
    files = sorted(windows_dir.glob("*"))
    assert files and all(f.suffix == ".json" for f in files), [f.name for f in files]  # renamed into place
    windows = [Window.from_json(f.read_text()) for f in files]
    return windows, files, json.loads((out / "out.json").read_text())


def check_counts(windows: list[Window], tiny_model, generated) -> None:
    model_dir, _, prompts = tiny_model
    # vLLM computes each prompt and every generated token but the last (never fed back).
    sequences = [p + g[:-1] for p, g in zip(prompts, generated)]
    expected = transformers_histogram(model_dir, sequences)
    got = sum(w.expert_tokens for w in windows)
    np.testing.assert_array_equal(got, expected)
    assert sum(int(w.step_tokens.sum()) for w in windows) == sum(len(s) for s in sequences)
    for w in windows:
        assert (w.runtime, w.world_size, w.num_experts, w.top_k) == ("vllm", 1, EXPERTS, TOP_K)
        assert w.model.rstrip("/").endswith(model_dir.name)
        assert w.extra["layer_ids"] == [0, 1, 2]
        # vLLM gives logical counts only: rank-level counts and the phase split are absent.
        assert w.slot_tokens is None and w.sent_tokens is None and w.dispatch_seconds is None
    assert len(windows) >= 2  # flushed every 2 steps, and the rest at shutdown


@pytest.mark.slow
def test_eager_multiprocess_tp2_counts_equal_transformers_not_doubled_and_reach_the_agent(tiny_model, tmp_path):
    from moewatch.agent.config import AgentConfig
    from moewatch.agent.daemon import Daemon

    short = Path(tempfile.mkdtemp(prefix="mwv-", dir="/tmp"))
    sock = str(short / "agent.sock")
    daemon = Daemon(AgentConfig.from_mapping({
        "server": {"socket": sock, "listen": "127.0.0.1:0"}, "log": {"audit_log": str(short / "audit.jsonl")},
        "jobs": {"triage_interval_seconds": 0.05, "export_interval_seconds": 0.2}})).start()
    try:
        windows, files, result = run_vllm(tiny_model, tmp_path, compiled=False, multiprocessing=True, tp=2,
                                          socket=sock)
        check_counts(windows, tiny_model, result["generated"])
        # CPU eager: per-layer MoE time and per-step time are measured (perf_counter, no sync).
        assert all(w.layer_seconds is not None and (w.layer_seconds > 0).all() for w in windows)
        assert all(w.step_seconds is not None for w in windows)

        diagnose = subprocess.run([sys.executable, "-m", "moewatch.cli", "diagnose", str(files[0]), "--json"],
                                  capture_output=True, text=True, timeout=60)
        assert diagnose.returncode == 0, diagnose.stderr
        assert [layer["layer"] for layer in json.loads(diagnose.stdout)["layers"]] == [0, 1, 2]

        model = windows[0].model
        deadline = time.monotonic() + 20
        text = ""
        while time.monotonic() < deadline:
            with urllib.request.urlopen(daemon.http_url + "/metrics", timeout=5) as resp:
                text = resp.read().decode()
            if f'moewatch_windows_total{{ep_group="ep0",model="{model}"}} {float(len(windows))}' in text:
                break
            time.sleep(0.2)
        routed = {line for line in text.splitlines()
                  if line.startswith("moewatch_layer_routed_pairs_total{") and f'model="{model}"' in line}
        assert len(routed) == 3, text[-3000:]
        total = sum(float(line.rpartition(" ")[2]) for line in routed)
        assert total == sum(int(w.expert_tokens.sum()) for w in windows)
        check_missing_evidence_marked(text, model)
    finally:
        daemon.stop()
        shutil.rmtree(short, ignore_errors=True)


def check_missing_evidence_marked(text: str, model: str) -> None:
    """Each layer's series say which evidence vLLM could not give (1) and which it measured (0)."""
    marks: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if line.startswith("moewatch_layer_evidence_missing{") and f'model="{model}"' in line:
            head, _, value = line.rpartition(" ")
            labels = dict(part.split("=", 1) for part in head[head.index("{") + 1:-1].split(","))
            marks[(labels["layer"].strip('"'), labels["evidence"].strip('"'))] = float(value)
    for layer in ("0", "1", "2"):
        for kind in ("a2a_time", "rank_load", "cross_rank", "compute_time"):
            assert marks.get((layer, kind)) == 1.0, (layer, kind, marks)
        for kind in ("layer_time", "steps", "capacity"):  # measured on the CPU in eager mode
            assert marks.get((layer, kind)) == 0.0, (layer, kind, marks)
    # What needs absent evidence has no series for these layers, rather than a guessed number.
    assert not any(line.startswith(("moewatch_layer_a2a_share_ratio{", "moewatch_layer_balancedness_ratio{"))
                   and f'model="{model}"' in line for line in text.splitlines())
    assert any(line.startswith("moewatch_layer_expert_load_cv_ratio{") and f'model="{model}"' in line
               for line in text.splitlines())


@pytest.mark.slow
def test_compiled_in_process_counts_equal_transformers_beside_vllms_own_capture(tiny_model, tmp_path):
    windows, _, result = run_vllm(tiny_model, tmp_path, compiled=True, multiprocessing=False, vllm_capture=True,
                                  slow_sample=SLOW_SAMPLE)
    check_counts(windows, tiny_model, result["generated"])
    # A step is the engine's whole step: execute_model and then sample_tokens (vLLM's
    # GPUModelRunner.execute_model, then sample_tokens -> _sample, which the driver slows by
    # SLOW_SAMPLE). Every step's time covers the sampler, so none is shorter than that.
    for w in windows:
        assert w.step_seconds is not None and len(w.step_seconds) == w.steps
        assert (w.step_seconds >= SLOW_SAMPLE).all(), w.step_seconds
    # Compiled: no per-layer timing without a sync, so it is absent rather than guessed.
    assert all(w.layer_seconds is None for w in windows)

    # vLLM's routed-experts capturer, bound after moewatch's counter (as enable_return_routed_experts
    # binds it), captured every real step, and what it captured is what moewatch counted: window by
    # window (each the histogram of its steps' captured ids), layer by layer, expert by expert.
    captured = np.array(result["vllm_capture_steps"])  # [steps, L, E]
    assert captured.shape == (sum(w.steps for w in windows), 3, EXPERTS)
    first = 0
    for w in windows:  # files sorted by name: in the order they were written
        np.testing.assert_array_equal(captured[first:first + w.steps].sum(axis=0), w.expert_tokens)
        first += w.steps
    sequences = [p + g[:-1] for p, g in zip(tiny_model[2], result["generated"])]
    assert (captured.sum(axis=(0, 2)) == TOP_K * sum(len(s) for s in sequences)).all()

    # vLLM compiled the model in this run (its own counter, in the engine's process), from a cache
    # of its own (never a graph loaded from an earlier run), and serves it from the compiled code.
    counter = result["compilation_counter"]
    assert counter["num_aot_compiles"] == 1 and counter["num_aot_artifacts_loaded"] == 0, counter
    assert counter["num_models_seen"] == 1, counter
    modules = result["compiled_modules"]
    assert modules and all(m == {"compiled": True, "has_compiled_fn": True} for m in modules.values()), modules
    # enable_return_routed_experts needs Model Runner V2 (not runnable on this CPU build): its steps
    # are observed too, besides V1's, which counted the steps above.
    assert result["observed_runners"] == {"v1": True, "v2": True}


# Seconds vLLM's sampler is slowed by in the compiled run: far above a tiny model's step (3 to 110 ms
# measured without the sampler, on a busy 2-core machine; one run at load 10 passed 0.3 s), so a step
# time that leaves sample_tokens out cannot reach it.
SLOW_SAMPLE = 1.0


class OneSlotRouter:
    """The capture slot of vLLM's BaseRouter, as this version has it: one function, set by
    set_capture_fn and called with the logical top-k ids [N, k] in select_experts."""

    def __init__(self):
        self.capture_fn = None

    def set_capture_fn(self, capture_fn):
        self.capture_fn = capture_fn

    def route(self, topk_ids: torch.Tensor) -> None:
        if self.capture_fn is not None:
            self.capture_fn(topk_ids)


def test_the_capture_slot_runs_moewatchs_counter_and_the_other_bind_whichever_came_first():
    from moewatch.runtime.engines.common import PairCounter, PairWeights
    from moewatch.runtime.engines.vllm_plugin import _share_capture_slot

    ids = torch.tensor([[0, 3], [3, 1]])
    weights = PairWeights(max_tokens=8, top_k=2, device="cpu")
    weights.arm(2)
    counter = PairCounter(4, weights.tensor)
    earlier, later = [], []
    router = OneSlotRouter()
    router.set_capture_fn(earlier.append)  # bound before moewatch's bind
    _share_capture_slot(router, counter.add)
    router.route(ids)
    assert counter.counts.tolist() == [1, 1, 0, 2] and len(earlier) == 1

    router.set_capture_fn(later.append)  # bound after: replaces the earlier one, not the counter
    router.route(ids)
    assert counter.counts.tolist() == [2, 2, 0, 4] and (len(earlier), len(later)) == (1, 1)

    router.set_capture_fn(router.capture_fn)  # what was read back, bound again: still counted once
    router.route(ids)
    assert counter.counts.tolist() == [3, 3, 0, 6] and len(later) == 2

    router.set_capture_fn(None)  # unbound by the other party: the counter stays
    router.route(ids)
    assert counter.counts.tolist() == [4, 4, 0, 8] and len(later) == 2


def test_moewatchs_bind_on_an_empty_slot_leaves_only_its_counter():
    from moewatch.runtime.engines.common import PairCounter, PairWeights
    from moewatch.runtime.engines.vllm_plugin import _share_capture_slot

    weights = PairWeights(max_tokens=4, top_k=1, device="cpu")
    weights.arm(1)
    counter = PairCounter(2, weights.tensor)
    router = OneSlotRouter()
    _share_capture_slot(router, counter.add)
    assert router.capture_fn == counter.add  # nothing else bound: the counter itself, no wrapper
    router.route(torch.tensor([[1]]))
    assert counter.counts.tolist() == [0, 1]


@pytest.mark.slow
def test_vllm_loads_the_plugin_which_stays_inactive_without_a_destination():
    assert VLLM_PYTHON.is_file(), f"{VLLM_PYTHON} is missing: `make vllm-env` builds vLLM's environment"
    # (Active, it is what produced the windows above.) Inactive, it binds nothing and wraps nothing:
    # not even the MoE layer's module is imported.
    probe = """
import sys
from vllm.plugins import load_general_plugins
load_general_plugins()
loaded = 'moewatch.runtime.engines.vllm_plugin' in sys.modules
from moewatch.runtime.engines import vllm_plugin
print(loaded, vllm_plugin._state['registered'], 'vllm.model_executor.layers.fused_moe.runner.moe_runner' in sys.modules)
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOEWATCH_")}
    proc = subprocess.run([str(VLLM_PYTHON), "-c", probe], env=env, capture_output=True, text=True, timeout=180)
    assert proc.stdout.split()[-3:] == ["True", "False", "False"], proc.stderr[-2000:]


class StepLog:
    """Stands in for the recorder: the steps the plugin began and ended."""

    def __init__(self):
        self.steps: list = []

    def begin_step(self, tokens: int) -> None:
        self.steps.append(("begin", tokens))

    def end_forward(self) -> None:
        self.steps.append(("end_forward",))

    def end_step(self) -> None:
        self.steps.append(("end",))


def test_a_v2_runners_dummy_runs_are_no_steps_and_its_real_steps_are(monkeypatch):
    from types import SimpleNamespace

    from moewatch.runtime.engines import vllm_plugin

    log = StepLog()
    monkeypatch.setitem(vllm_plugin._state, "recorder", log)
    calls = []
    v2 = vllm_plugin._counting_steps(lambda self, out, *a, **kw: calls.append(out.total_num_scheduled_tokens),
                                     dummy_runs=True)
    tokens = SimpleNamespace
    v2("runner", tokens(total_num_scheduled_tokens=8), dummy_run=True)  # warm-up, profiling
    v2("runner", tokens(total_num_scheduled_tokens=8), None, True)  # dummy_run passed by position
    v2("runner", tokens(total_num_scheduled_tokens=0))
    assert log.steps == [] and calls == [8, 8, 0]
    v2("runner", tokens(total_num_scheduled_tokens=5))
    v2("runner", tokens(total_num_scheduled_tokens=3), None, False)
    assert log.steps == [("begin", 5), ("end",), ("begin", 3), ("end",)] and calls == [8, 8, 0, 5, 3]
    # V1's second parameter is the intermediate tensors, not a dummy flag: a real step all the same.
    v1 = vllm_plugin._counting_steps(lambda self, out, *a, **kw: None, dummy_runs=False)
    v1("runner", tokens(total_num_scheduled_tokens=4), object())
    assert log.steps[-2:] == [("begin", 4), ("end",)]


BENCH_VLLM_FIGURES = ("overhead_ratio", "overhead_ratio_cpu_time", "tokens_per_second_inactive",
                      "tokens_per_second_active", "plugin_seconds_per_step")


@pytest.mark.slow
def test_bench_vllm_runs_two_rounds_on_a_tiny_model_and_reports_finite_positive_figures():
    assert VLLM_PYTHON.is_file(), f"{VLLM_PYTHON} is missing: `make vllm-env` builds vLLM's environment"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOEWATCH_", "VLLM_"))}
    proc = subprocess.run([sys.executable, "-m", "moewatch.cli", "bench", "vllm", "--python", str(VLLM_PYTHON),
                           "--rounds", "2", "--prompts", "4", "--prompt-len", "8", "--max-tokens", "4", "--pause", "0",
                           "--json", "--no-record"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout)
    assert set(BENCH_VLLM_FIGURES) | {"rounds", "prompts", "prompt_len", "max_tokens", "pause_seconds", "mode",
                                      "windows_written", "tokens_per_round", "per_round_tokens_per_second"} <= set(out)
    for key in BENCH_VLLM_FIGURES:
        assert isinstance(out[key], float) and math.isfinite(out[key]) and out[key] > 0, (key, out[key])
    per_round = out["per_round_tokens_per_second"]
    assert set(per_round) == {"inactive", "active"}
    assert all(len(v) == 2 and all(math.isfinite(x) and x > 0 for x in v) for v in per_round.values()), per_round
    assert (out["rounds"], out["prompts"], out["prompt_len"], out["max_tokens"], out["mode"]) == (2, 4, 8, 4, "eager")
    # Every prompt and every generated token, in each round; the active engine wrote its windows.
    assert out["tokens_per_round"] == 4 * (8 + 4)
    assert out["windows_written"] >= 1



class Runner:
    """vLLM 0.32's model runner as the step wrapper sees it: execute_model leaves `execute_model_state`
    for sample_tokens and returns None (GPUModelRunner.execute_model / sample_tokens, V1 and V2)."""

    def __init__(self):
        self.execute_model_state = None


def test_a_step_ends_when_sample_tokens_returns_and_counts_pairs_only_during_the_forward(monkeypatch):
    from types import SimpleNamespace

    from moewatch.runtime.engines import vllm_plugin

    log = StepLog()
    monkeypatch.setitem(vllm_plugin._state, "recorder", log)
    monkeypatch.setitem(vllm_plugin._state, "off", None)

    def forward(self, out, *args, **kwargs):
        log.steps.append(("forward", out.total_num_scheduled_tokens))
        self.execute_model_state = "logits"
        return None

    def sample(self, grammar_output):
        log.steps.append(("sample",))  # the sampler, the MTP drafter, the EPLB step
        self.execute_model_state = None
        return "sampled"

    execute_model = vllm_plugin._counting_steps(forward, dummy_runs=False)
    sample_tokens = vllm_plugin._ending_steps(sample)
    runner = Runner()
    assert execute_model(runner, SimpleNamespace(total_num_scheduled_tokens=5)) is None
    assert sample_tokens(runner, None) == "sampled"
    # pairs counted while the forward is launched; the step's time runs to the end of sample_tokens
    assert log.steps == [("begin", 5), ("forward", 5), ("end_forward",), ("sample",), ("end",)]

    log.steps.clear()  # an execute_model that answers by itself (no sampling follows): the step ends there
    direct = vllm_plugin._counting_steps(lambda self, out: "output", dummy_runs=False)
    assert direct(Runner(), SimpleNamespace(total_num_scheduled_tokens=2)) == "output"
    sample_tokens(runner, None)
    assert log.steps == [("begin", 2), ("end",), ("sample",)]  # the later sample_tokens ends nothing

    log.steps.clear()  # a step whose sample_tokens never came: ended by the next execute_model
    execute_model(runner, SimpleNamespace(total_num_scheduled_tokens=3))
    runner.execute_model_state = None
    execute_model(runner, SimpleNamespace(total_num_scheduled_tokens=4))
    assert log.steps[:4] == [("begin", 3), ("forward", 3), ("end_forward",), ("end",)]
    vllm_plugin._end_open_step()


def test_a_failing_recorder_turns_observation_off_once_and_the_engine_keeps_serving(monkeypatch, caplog):
    import logging
    from types import SimpleNamespace

    from moewatch.runtime.engines import vllm_plugin

    class Failing:
        def begin_step(self, tokens):
            raise RuntimeError("no room for the counters")

    monkeypatch.setitem(vllm_plugin._state, "recorder", Failing())
    monkeypatch.setitem(vllm_plugin._state, "off", None)
    served = []
    execute_model = vllm_plugin._counting_steps(lambda self, out: served.append(out) or "output", dummy_runs=False)
    with caplog.at_level(logging.WARNING, logger="moewatch.vllm"):
        for n in (3, 4):
            assert execute_model(Runner(), SimpleNamespace(total_num_scheduled_tokens=n)) == "output"
    assert len(served) == 2
    warnings = [r.message for r in caplog.records if "observation is off" in r.message]
    assert len(warnings) == 1 and "no room for the counters" in warnings[0]
    assert "begin_step" in vllm_plugin._state["off"]


@pytest.mark.slow
def test_a_vllm_without_a_hook_serves_unobserved_with_one_warning_naming_its_version(tmp_path):
    assert VLLM_PYTHON.is_file(), f"{VLLM_PYTHON} is missing: `make vllm-env` builds vLLM's environment"
    # vLLM's own plugin loader runs register(); this vLLM is made to lack sample_tokens on its runner.
    probe = """
import vllm
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
del GPUModelRunner.sample_tokens
from vllm.plugins import load_general_plugins
load_general_plugins()
load_general_plugins()
from moewatch.runtime.engines import vllm_plugin
print(vllm.__version__, bool(vllm_plugin._state.get("off")))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOEWATCH_")}
    env["MOEWATCH_WINDOW_DIR"] = str(tmp_path / "windows")
    proc = subprocess.run([str(VLLM_PYTHON), "-c", probe], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    version, off = proc.stdout.split()[-2:]
    assert off == "True"
    lines = [line for line in proc.stderr.splitlines() if "observation is off" in line]
    assert len(lines) == 1 and f"vLLM {version}" in lines[0] and "sample_tokens" in lines[0], proc.stderr[-2000:]


def test_a_malformed_setting_leaves_the_engine_serving_unobserved_with_a_warning_naming_it(monkeypatch, caplog):
    import logging

    from moewatch.runtime.engines import vllm_plugin

    monkeypatch.setitem(vllm_plugin._state, "off", None)
    monkeypatch.setitem(vllm_plugin._state, "registered", False)
    monkeypatch.setenv("MOEWATCH_WINDOW_DIR", "/tmp/unused")
    monkeypatch.setenv("MOEWATCH_WINDOW_STEPS", "ten")
    monkeypatch.delenv("MOEWATCH_EPLB", raising=False)
    with caplog.at_level(logging.WARNING, logger="moewatch.vllm"):
        vllm_plugin.register()  # vLLM calls it unguarded in every process: it must not raise
    assert not vllm_plugin._state["registered"] and "MOEWATCH_WINDOW_STEPS" in vllm_plugin._state["off"]
    assert sum("observation is off" in r.message and "MOEWATCH_WINDOW_STEPS" in r.message for r in caplog.records) == 1
