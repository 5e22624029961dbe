"""GPU checks of the runtime, for a machine with CUDA: `python -m moewatch.tools.gpu_check [--quick]`.

Prints one JSON object: NCCL (EP output against the single-process reference, probe windows timed by
CUDA events, a live placement change, a stale plan, an injected migration failure), the Triton grouped
GEMM against the torch path on the device (match and speed), the probe's overhead ratio on the GPU,
the engine adapters' no-sync step clock (eager and under a CUDA graph, with sync debug mode "error"),
their pair counters and flush under CUDA-graph replay with padded batches and out-of-range ids (sync
debug mode "error" around steps and flushes),
moewatch's EPLB policy as vLLM and SGLang call it at production shape on device-resident inputs
(and, with two GPUs and vLLM, a short vLLM run with EPLB and the policy), the runtime end to end
with each kernel, and the closed loop (`moewatch bench loop --backend nccl`: step time before and
after the agent acts on a hot-expert skew, against an observe-mode control; it needs two GPUs or
more, and is reported as not run on one). `ok` is true only when every check that
ran passed. Ranks: one per visible GPU (NCCL refuses two ranks on one device). Exit status 0 when ok,
1 otherwise, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

import numpy as np
import torch

from moewatch.tools import vllm_eplb_run


def _timed(fn, reps: int = 20) -> float:
    """Median milliseconds of fn() by CUDA events (after two warm-up calls)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def _kernel_case(g: torch.Generator, slots: int, hidden: int, ffn: int, rows: int, dtype: torch.dtype,
                 tolerance: float) -> dict:
    from moewatch.runtime.kernels import grouped_swiglu_torch, grouped_swiglu_triton

    # Zipf-skewed ragged segments, one of them empty.
    weights = 1.0 / np.arange(1, slots + 1) ** 1.2
    counts = np.random.default_rng(slots).multinomial(rows, weights / weights.sum()).tolist()
    counts[-1] = 0
    w13 = (torch.randn(slots, hidden, 2 * ffn, device="cuda", generator=g) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(slots, ffn, hidden, device="cuda", generator=g) / ffn ** 0.5).to(dtype)
    x = torch.randn(sum(counts), hidden, device="cuda", generator=g).to(dtype)
    ref = grouped_swiglu_torch(x, counts, w13, w2).float()
    got = grouped_swiglu_triton(x, counts, w13, w2).float()
    scale = float(ref.abs().max())
    diff = float((got - ref).abs().max())
    torch_ms = _timed(lambda: grouped_swiglu_torch(x, counts, w13, w2))
    triton_ms = _timed(lambda: grouped_swiglu_triton(x, counts, w13, w2))
    # Other tile shapes, for whoever tunes _launch_shape next (the verdict uses the built-in one).
    sweep = {}
    launches = () if dtype == torch.float32 else (
        (64, 64, 32, 4, 3), (64, 128, 32, 4, 3), (128, 64, 32, 8, 3), (128, 128, 64, 8, 3), (64, 128, 64, 8, 4))
    for launch in launches:
        name = ",".join(map(str, launch))
        try:
            sweep[name] = _timed(lambda: grouped_swiglu_triton(x, counts, w13, w2, launch=launch), reps=10)
        except Exception as exc:  # a shape this GPU cannot hold (shared memory, registers)
            sweep[name] = f"failed: {type(exc).__name__}"
    return {"slots": slots, "hidden": hidden, "ffn": ffn, "rows": rows, "dtype": str(dtype).split(".")[-1],
            "max_abs_diff": diff, "scale": scale, "match": diff <= tolerance * max(scale, 1.0),
            "torch_ms": torch_ms, "triton_ms": triton_ms, "triton_over_torch": triton_ms / torch_ms,
            "not_slower": triton_ms <= torch_ms, "triton_ms_by_launch (BLOCK_M,N,K,warps,stages)": sweep}


def kernel_check(quick: bool) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(32, 1024, 2048, 8192)] if quick else [(32, 1024, 2048, 8192), (8, 2048, 4096, 16384),
                                                    (64, 512, 1024, 4096)]
    cases = [_kernel_case(g, *shape, dtype, tolerance)
             for shape in shapes for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2))]
    return {"cases": cases, "match": all(c["match"] for c in cases),
            "ok": all(c["match"] and c["not_slower"] for c in cases)}


def nccl_checks(world_size: int, backend: str = "nccl") -> dict:
    from moewatch.runtime import checks
    from moewatch.runtime.config import RuntimeConfig
    from moewatch.runtime.launcher import run_group

    L, E, P = 2, 8, 8 + 4 * world_size
    cfg = RuntimeConfig(ranks=world_size, layers=L, experts=E, slots=P, hidden=64, ffn=128, batch_tokens=64,
                        pad_fraction=0.1, zipf=1.2, backend=backend,
                        placement=checks.replicated_placement(L, E, P, seed=1).tolist())
    modes = {"dropless": {}, "dropless-learned": {"router": "learned"},
             "drop": {"capacity_factor": 1.0}, "reroute": {"capacity_factor": 1.0, "overflow": "reroute"},
             "dropless-triton": {"kernel": "triton"}}
    new_map = checks.replicated_placement(L, E, P, seed=2).tolist()
    fail_map = checks.replicated_placement(L, E, P, seed=3).tolist()
    probe_cfg = cfg.replace(capacity_factor=1.0, overflow="reroute")
    if backend != "nccl":  # a CPU rehearsal of this script's judgement: no Triton without a GPU
        modes.pop("dropless-triton")
    out = run_group(world_size, checks.suite, (cfg, modes, probe_cfg, 3, new_map, fail_map), backend=backend,
                    timeout_s=120)[0]
    reference = {name: {**r, "ok": r["max_abs_diff"] <= 1e-4 * max(1.0, r["scale"])
                        and r["computed"] + r["dropped"] == r["routed"]} for name, r in out["reference"].items()}
    probe = out["probe"]
    facts = checks.window_facts(probe["window"], steps=3, top_k=cfg.top_k) if probe["window"] else {"ok": False}
    live = out["live"]
    acks = live[0]["acks"]
    live_ok = (all(r["moved"]["weights_match"] and r["moved"]["placement"] == new_map
                   and float((r["before"] - r["after"]).abs().max()) <= 1e-5
                   and r["failed"]["placement"] == new_map and r["failed"]["weights_match"] for r in live)
               and [(a["plan_epoch"], a["ok"]) for a in acks] == [(1, True), (1, False), (3, False)])
    return {"reference": reference, "probe_window": facts, "probe_invalid": probe["invalid"],
            "live": {"ok": live_ok, "acks": acks,
                     "max_abs_diff_before_after": max(float((r["before"] - r["after"]).abs().max()) for r in live)},
            "ok": all(r["ok"] for r in reference.values()) and facts["ok"] and probe["invalid"] == 0 and live_ok}


def probe_overhead(world_size: int, quick: bool) -> dict:
    from moewatch.tools.bench.probe import measure
    from moewatch.runtime.config import RuntimeConfig

    cfg = RuntimeConfig(ranks=world_size, layers=8, experts=32, slots=32, top_k=2, hidden=2048, ffn=1408,
                        batch_tokens=4096, backend="nccl", dtype="bfloat16", kernel="triton", zipf=1.0)
    result = measure(cfg, windows=4 if quick else 10, block=1, window=50, warmup=20)
    result["goal"] = 1.005
    result["ok"] = result["overhead_ratio"] <= 1.005
    return result


def engine_clock(quick: bool) -> dict:
    """The engine adapters' step clock (runtime/engines/clock.py) on the GPU: a tiny MoE-shaped step
    (router top-k counted by PairCounter, two expert matmuls), eager and replayed from a captured
    CUDA graph, with torch.cuda.set_sync_debug_mode("error") around every step so any host sync the
    clock added would raise. Checks that the windows carry step time, and the overhead ratio (step
    time with the clock over without)."""
    from moewatch.runtime.engines import common
    from moewatch.runtime.engines.clock import EventClock, cuda_event_factory

    tokens, hidden, experts, top_k = 256, 1024, 16, 2
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, hidden, device="cuda", generator=g)
    router = torch.randn(hidden, experts, device="cuda", generator=g)
    w1 = torch.randn(hidden, 4 * hidden, device="cuda", generator=g) / hidden ** 0.5
    w2 = torch.randn(4 * hidden, hidden, device="cuda", generator=g) / hidden ** 0.5
    steps = 40 if quick else 200
    out: dict = {"steps": steps}
    for mode in ("eager", "cuda_graph"):
        seen: list = []
        weights = common.PairWeights(tokens, top_k, "cuda")
        # One window, flushed after the timed steps (engine_counters checks flushes between steps).
        rec = common.EngineRecorder(common.EngineSettings(window_steps=10 * steps),
                                    runtime="gpu-check", model="tiny",
                                    top_k=top_k, hidden_bytes=hidden * 4, num_experts=experts, weights=weights,
                                    sinks=[seen.append], clock=EventClock(cuda_event_factory()), timer=False)
        counter = rec.counter(0)

        def forward():
            counter.add(torch.topk(x @ router, top_k, dim=1).indices)
            return torch.relu(x @ w1) @ w2

        step = forward
        if mode == "cuda_graph":
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                forward()  # warm-up, weights disarmed: counts nothing
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                forward()
            step = graph.replay

        def timed_steps(with_clock: bool) -> float:
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                torch.cuda.set_sync_debug_mode("error")
                try:
                    if with_clock:
                        rec.begin_step(tokens)
                        step()
                        rec.end_step()
                    else:
                        step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
            return time.perf_counter() - start

        timed_steps(False)  # warm-up
        bare = timed_steps(False)
        clocked = timed_steps(True)
        torch.cuda.synchronize()
        rec.close()  # after the sync every event is complete: every window carries its step time
        timed = [w for w in seen if w.step_seconds is not None]
        out[mode] = {"windows": len(seen), "windows_with_step_time": len(timed),
                     "step_p50_ms": float(np.median(np.concatenate([w.step_seconds for w in timed])) * 1e3)
                     if timed else None,
                     "overhead_ratio": clocked / bare, "clock_error": rec.clock.error or None,
                     "ok": bool(seen) and len(timed) == len(seen) and not rec.clock.error}
    out["ok"] = all(out[m]["ok"] for m in ("eager", "cuda_graph"))
    return out


def engine_counters(device: str = "cuda", quick: bool = False) -> dict:
    """The engine adapters' pair counters and their flush (runtime/engines/common.py, readout.py) as
    an engine runs them on a GPU: one CUDA graph captured per padded batch size and replayed for
    batches of any real size up to it; padding rows masked to -1 and a fused shared expert appended
    as id E after the top-k (out-of-range ids: PairCounter's discard bin); a window flushed every 7
    steps, between replays, with torch.cuda.set_sync_debug_mode("error") around every step and flush,
    so a host sync in the counters, the flush's copy or the step clock raises. Passed when every
    window came, the windows' counts sum to an eager count of the same ids (real rows only, the
    capture warm-up counting nothing), the discard bin holds exactly the appended column's pairs, and
    each flush made one device-to-host copy. On the CPU (device "cpu") the same steps run eagerly,
    without graphs or sync debug mode: the check's own test. Never run on a GPU yet."""
    from moewatch.runtime.engines import common
    from moewatch.runtime.engines.clock import EventClock, cuda_event_factory

    on_gpu = device == "cuda"
    layers, experts, top_k, hidden, window_steps = 4, 16, 2, 256, 7
    sizes = (64, 256)  # the padded batch sizes graphs are captured for
    steps = 30 if quick else 120
    g = torch.Generator(device=device).manual_seed(0)
    routers = [torch.randn(hidden, experts, device=device, generator=g) for _ in range(layers)]
    weights = common.PairWeights(max(sizes), top_k, device)
    seen: list = []
    rec = common.EngineRecorder(common.EngineSettings(window_steps=window_steps), runtime="gpu-check", model="tiny",
                                top_k=top_k, hidden_bytes=hidden * 4, num_experts=experts, weights=weights,
                                sinks=[seen.append], clock=EventClock(cuda_event_factory()) if on_gpu else None,
                                timer=False)
    counters = [rec.counter(i) for i in range(layers)]
    x = torch.zeros(max(sizes), hidden, device=device)  # the graphs' static input
    real_rows = torch.zeros(max(sizes), dtype=torch.bool, device=device)
    chosen = [torch.zeros(max(sizes), top_k + 1, dtype=torch.int64, device=device) for _ in range(layers)]

    def forward(size: int) -> None:
        for i, counter in enumerate(counters):
            ids = torch.topk(x[:size] @ routers[i], top_k, dim=1).indices
            ids = torch.where(real_rows[:size, None], ids, -1)  # padding rows masked to -1
            ids = torch.cat([ids, torch.full_like(ids[:, :1], experts)], dim=1)  # a shared expert: id E
            counter.add(ids)
            chosen[i][:size].copy_(ids)

    run = forward
    if on_gpu:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in sizes:
                forward(size)  # warm-up, weights disarmed: counts nothing
        torch.cuda.current_stream().wait_stream(stream)
        graphs = {}
        for size in sizes:
            graphs[size] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[size]):
                forward(size)
        run = lambda size: graphs[size].replay()  # noqa: E731
    else:
        for size in sizes:
            forward(size)  # the same warm-up
    reference = torch.zeros(layers, experts + 1, dtype=torch.int64, device=device)
    ones = torch.ones(max(sizes) * (top_k + 1), dtype=torch.int64, device=device)
    rng = np.random.default_rng(0)
    real_total, padded_total = 0, 0
    sync_debug = torch.cuda.set_sync_debug_mode if on_gpu else (lambda mode: None)
    started = time.perf_counter()
    for _ in range(steps):
        n = int(rng.integers(1, max(sizes) + 1))
        size = next(s for s in sizes if s >= n)
        real_total, padded_total = real_total + n, padded_total + size
        sync_debug("error")
        try:
            x[:size].normal_(generator=g)  # the step's tokens, made on the device
            real_rows[:n].fill_(True)
            real_rows[n:].fill_(False)
            rec.begin_step(n)
            run(size)
            rec.end_step()  # every 7th: the flush's copy, no sync
            for i in range(layers):  # the eager count of the same ids, real rows only
                reference[i].index_add_(0, chosen[i][:n].reshape(-1), ones[:n * (top_k + 1)])
        finally:
            sync_debug("default")
    seconds = time.perf_counter() - started
    if on_gpu:
        torch.cuda.synchronize()
    rec.close()
    want = reference.cpu().numpy()
    got = sum(w.expert_tokens for w in seen) if seen else np.zeros((layers, experts), dtype=np.int64)
    discarded = [int(c.discarded.sum()) for c in counters]
    out = {"device": device, "steps": steps, "padded_sizes": list(sizes), "real_tokens": real_total,
           "padded_tokens": padded_total, "windows": len(seen), "windows_expected": -(-steps // window_steps),
           "windows_with_step_time": sum(w.step_seconds is not None for w in seen),
           "counts_match": bool(np.array_equal(got, want[:, :experts])),
           "pairs_counted": int(np.asarray(got).sum()), "discarded": discarded,
           "discarded_expected": want[:, experts].tolist(), "device_copies": rec.readout.copies,
           "sync_debug": "error" if on_gpu else "off (CPU)", "steps_seconds": seconds,
           "windows_lost": rec.windows_lost()}
    out["ok"] = (out["windows"] == out["windows_expected"] and out["counts_match"]
                 and discarded == out["discarded_expected"] and out["device_copies"] == out["windows"]
                 and not out["windows_lost"] and (not on_gpu or out["windows_with_step_time"] == out["windows"]))
    return out


def engine_policy(device: str = "cuda", quick: bool = False) -> dict:
    """moewatch's EPLB policy as vLLM and SGLang call it, at production shape (61 layers x 256
    experts, 320 slots, 64 ranks on 8 nodes), on inputs resident on `device`: each adapter's answer
    from device tensors must equal its answer from the same values on the CPU, byte for byte, and be
    a map the engine accepts. Call seconds are reported, not judged (no engine policy runs here to
    compare with: `moewatch bench eplb` does that). With two GPUs or more and vLLM importable, a short
    vLLM run with EPLB and the policy follows (tools/vllm_eplb_run.py: the windows must show the map
    changing by moewatch's decisions and balancedness rising); never run, as no machine this project
    is developed on has two GPUs. Without them the result says what it lacked."""
    from moewatch.planner.placement_math import contiguous_placement
    from moewatch.planner.rebalance import RebalanceSettings
    from moewatch.runtime.engines import sglang_eplb, vllm_eplb
    from moewatch.tools.bench.eplb import scenario_loads

    L, E, P, W, N = 61, 256, 320, 64, 8
    windows = 2 if quick else 4
    loads = scenario_loads("drift", windows, L, E, 1000 * 64 * 256 * 8, seed=17)
    settings = RebalanceSettings()
    out: dict = {"shape": {"layers": L, "experts": E, "slots": P, "ranks": W, "nodes": N}, "device": device,
                 "windows": windows}
    for engine in ("vllm", "sglang"):
        current = contiguous_placement(L, E, P).astype(np.int64)
        calls = []
        for window in loads:
            on_cpu = torch.from_numpy(window)
            on_device = on_cpu.to(device)
            old_device = torch.from_numpy(current).to(device)
            if engine == "vllm":
                started = time.perf_counter()
                got = vllm_eplb.decide(on_device, P, N, W, old_device, settings).physical_to_logical_map
                seconds = time.perf_counter() - started
                want = vllm_eplb.decide(on_cpu, P, N, W, current, settings).physical_to_logical_map
            else:
                started = time.perf_counter()
                (got_t, _, _), _ = sglang_eplb.decide(on_device[None], P, P // W, N, current, settings)
                seconds = time.perf_counter() - started
                (want_t, _, _), _ = sglang_eplb.decide(on_cpu[None], P, P // W, N, current, settings)
                got, want = got_t.numpy(), want_t.numpy()
            vllm_eplb.check_map(got, L, E, P)
            calls.append({"seconds": seconds, "same_as_cpu": got.tobytes() == want.tobytes(),
                          "slots_moved": int((got != current).sum())})
            current = got
        out[engine] = {"calls": calls, "ok": all(c["same_as_cpu"] for c in calls)}
    out["vllm_run"] = vllm_eplb_part(torch.cuda.device_count() if device == "cuda" else 0)
    out["ok"] = out["vllm"]["ok"] and out["sglang"]["ok"] and out["vllm_run"]["ok"] is not False
    return out


def vllm_eplb_part(gpus: int) -> dict:
    """The vLLM run with EPLB and moewatch's policy where it can run (two GPUs, vLLM in this
    Python), else why not (ok None: not run, not failed)."""
    import importlib.util

    if gpus < vllm_eplb_run.RANKS:
        return {"ran": False, "ok": None, "gpus": gpus,
                "why": f"needs {vllm_eplb_run.RANKS} GPUs or more (vLLM's EPLB needs more than one rank); saw {gpus}"}
    if importlib.util.find_spec("vllm") is None:
        return {"ran": False, "ok": None, "gpus": gpus, "why": "vLLM is not installed in this Python"}
    return {"gpus": gpus, **vllm_eplb_run.run(sys.executable)}


def end_to_end(world_size: int) -> dict:
    from moewatch.runtime.config import RuntimeConfig
    from moewatch.runtime.launcher import launch

    out = {}
    for kernel in ("torch", "triton"):
        cfg = RuntimeConfig(ranks=world_size, layers=8, experts=32, top_k=2, hidden=2048, ffn=1408, batch_tokens=4096,
                            steps=60, backend="nccl", dtype="bfloat16", kernel=kernel, capacity_factor=1.25,
                            overflow="reroute", window_steps=20)
        r = launch(cfg)
        out[kernel] = {"step_p50_s": r.step_p50_s, "step_p99_s": r.step_p99_s, "tokens_per_s": r.tokens_per_s,
                       "pairs_lost": r.pairs_lost, "windows_built": r.windows_built,
                       "windows_invalid": r.windows_invalid}
    out["ok"] = all(v["pairs_lost"] == 0 and v["windows_invalid"] == 0 and v["windows_built"] >= 3
                    for v in out.values() if isinstance(v, dict))
    return out


# What the closed loop must show (the goals for a machine where the busiest rank sets the step).
LOOP_GOALS = {"step_p50_ratio": 0.80, "windows_to_fix": 3, "stall_per_plan_s": 1.0}


def closed_loop(world_size: int, backend: str = "nccl", quick: bool = False, shape: dict | None = None,
                seconds: float | None = None, control_seconds: float | None = None) -> dict:
    """The agent in act mode against the runtime, one rank per GPU, then an observe-mode control, by
    running `moewatch bench loop --json` (the runtime never imports the agent: it is a subprocess).
    `shape` overrides the bench's sizes ({"hidden": ..., "ffn": ..., "batch-tokens": ...,
    "window-steps": ...}); backend "gloo" is the CPU rehearsal of this check."""
    if world_size < 2:
        return {"ran": False, "ok": None, "why": f"{world_size} GPU: expert parallelism needs two ranks or more"}
    seconds = seconds if seconds is not None else (20.0 if quick else 40.0)
    control_seconds = control_seconds if control_seconds is not None else (10.0 if quick else 20.0)
    # Its figures go into this check's report, not into the repository's benchmark results.
    cmd = [sys.executable, "-m", "moewatch.cli", "bench", "loop", "--json", "--no-record", "--backend", backend,
           "--ranks", str(world_size), "--seconds", f"{seconds:g}", "--control-seconds", f"{control_seconds:g}"]
    for key, value in (shape or {}).items():
        cmd += [f"--{key}", str(value)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + control_seconds + 600,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        return {"ran": True, "ok": False, "error": proc.stderr[-4000:]}
    result = json.loads(proc.stdout)
    stall = result["migration_stall_s"]["max_per_plan"]
    checks = {
        "pairs_lost": result["pairs_lost"] == 0,
        "acted": result["plans_applied"] >= 1,
        "no_false_rollback": result["false_rollbacks"] == 0,
        "step_p50_ratio": result["step_p50_ratio"] is not None and result["step_p50_ratio"] <= LOOP_GOALS["step_p50_ratio"],
        "windows_to_fix": result["windows_to_fix"] is not None and result["windows_to_fix"] <= LOOP_GOALS["windows_to_fix"],
        "stall_per_plan": stall < LOOP_GOALS["stall_per_plan_s"],
    }
    return {"ran": True, "result": result, "goals": LOOP_GOALS, "checks": checks, "ok": all(checks.values())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and windows (about a minute)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "CUDA is not available on this machine"}))
        return 2
    world_size = torch.cuda.device_count()
    report: dict = {"device": torch.cuda.get_device_name(0), "gpus": world_size, "torch": torch.__version__}
    try:
        import triton
        report["triton"] = triton.__version__
    except ImportError as exc:
        report["triton"] = f"missing: {exc}"
    for name, fn in (("kernel", lambda: kernel_check(args.quick)), ("nccl", lambda: nccl_checks(world_size)),
                     ("probe_overhead", lambda: probe_overhead(world_size, args.quick)),
                     ("engine_clock", lambda: engine_clock(args.quick)),
                     ("engine_counters", lambda: engine_counters("cuda", args.quick)),
                     ("engine_policy", lambda: engine_policy("cuda", args.quick)),
                     ("end_to_end", lambda: end_to_end(world_size)),
                     ("closed_loop", lambda: closed_loop(world_size, quick=args.quick))):
        started = time.monotonic()
        try:
            report[name] = fn()
        except Exception:
            report[name] = {"ok": False, "error": traceback.format_exc()[-4000:]}
        report[name]["seconds"] = round(time.monotonic() - started, 1)
    report["ok"] = all(report[name].get("ok") for name in ("kernel", "nccl", "probe_overhead", "engine_clock",
                                                          "engine_counters", "engine_policy", "end_to_end")) and \
        report["closed_loop"].get("ok") is not False
    print(json.dumps(report, default=str))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
