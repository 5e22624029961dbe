"""The Triton grouped GEMM against the torch path, run by Triton's interpreter on the CPU.

TRITON_INTERPRET must be set before triton is imported, so the checks run in a fresh interpreter.
Shapes stay tiny: the interpreter executes every program instance in Python.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

CHECK = textwrap.dedent("""
    import json, os
    assert os.environ["TRITON_INTERPRET"] == "1"
    import torch
    from moewatch.runtime.kernels import grouped_swiglu_torch, grouped_swiglu_triton, tile_table
    from moewatch.runtime.config import RuntimeConfig
    from moewatch.runtime.ep_rank import EPEngine
    from moewatch.runtime.workload import Workload
    from moewatch.runtime.model import input_batch

    out = {"cases": []}
    g = torch.Generator().manual_seed(0)
    # (hidden, ffn, rows per segment): empty segments, a segment longer than a tile, sizes that are
    # not multiples of the block (masking), a K loop of several blocks.
    for hidden, ffn, counts in [(16, 32, [5, 0, 17, 3]), (20, 24, [0, 37, 1]), (40, 16, [2]), (16, 16, [0, 0])]:
        w13 = torch.randn(len(counts), hidden, 2 * ffn, generator=g) / hidden ** 0.5
        w2 = torch.randn(len(counts), ffn, hidden, generator=g) / ffn ** 0.5
        rows = torch.randn(sum(counts), hidden, generator=g)
        ref = grouped_swiglu_torch(rows, counts, w13, w2)
        got = grouped_swiglu_triton(rows, counts, w13, w2)
        out["cases"].append({"counts": counts, "shape": list(got.shape), "ref_shape": list(ref.shape),
                             "max_abs_diff": float((got - ref).abs().max()) if ref.numel() else 0.0,
                             "scale": float(ref.abs().max()) if ref.numel() else 0.0})
    out["tiles"] = tile_table([5, 0, 17, 3], 16)
    # The whole model on one rank with each kernel.
    cfg = RuntimeConfig(ranks=1, layers=2, experts=4, slots=6, hidden=16, ffn=16, batch_tokens=24, zipf=1.0)
    batch = Workload(cfg, 0).batch(0)
    x = input_batch(0, 0, 0, cfg.batch_tokens, cfg.hidden)
    a = EPEngine(cfg, 0, 1).forward(x, batch.valid, batch.expert_ids)
    b = EPEngine(cfg.replace(kernel="triton"), 0, 1).forward(x, batch.valid, batch.expert_ids)
    out["engine_max_abs_diff"] = float((a - b).abs().max())
    print(json.dumps(out))
""")


def test_triton_grouped_gemm_matches_torch_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for case in out["cases"]:
        assert case["shape"] == case["ref_shape"], case
        assert case["max_abs_diff"] <= 1e-5 * max(1.0, case["scale"]), case
    assert sum(case["scale"] > 0 for case in out["cases"]) == 3
    # Tiles of 16 rows: segment 0 (rows 0-4), segment 2 in two tiles (5-20, 21), segment 3 (22-24).
    assert out["tiles"] == [[0, 2, 2, 3], [0, 5, 21, 22], [5, 22, 22, 25]]
    assert out["engine_max_abs_diff"] <= 1e-5
