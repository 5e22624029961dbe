"""Expert compute over ragged per-expert segments: a torch reference path and a Triton grouped GEMM.

Input: rows [R, d] grouped by local slot, `segment_counts` [S] rows per slot (host ints), the slots'
weights w13 [S, d, 2f] (gate | up) and w2 [S, f, d]. Output [R, d]: row i of segment s is
swiglu(rows[i], w13[s], w2[s]).

The Triton path launches one kernel per layer and matrix: one over the stacked gate|up matrix (the
SwiGLU activation fused into its epilogue) and one over the down matrix, each covering every segment
through a host-built tile table (segment, first row, end row per tile of BLOCK_M rows). Triton is
imported on first use, so TRITON_INTERPRET=1 set before that runs the kernel on the CPU.
"""

from __future__ import annotations

import functools

import torch

from .model import swiglu


def grouped_swiglu_torch(rows: torch.Tensor, segment_counts: list[int], w13: torch.Tensor,
                         w2: torch.Tensor) -> torch.Tensor:
    """Reference: one pair of matmuls per non-empty segment."""
    out = torch.empty_like(rows)
    start = 0
    for slot, count in enumerate(segment_counts):
        if count:
            out[start:start + count] = swiglu(rows[start:start + count], w13[slot], w2[slot])
        start += count
    return out


def tile_table(segment_counts: list[int], block_m: int) -> list[list[int]]:
    """[3, T] per tile of up to block_m rows: its segment, first row and the segment's end row."""
    segments, starts, ends = [], [], []
    start = 0
    for slot, count in enumerate(segment_counts):
        for offset in range(0, count, block_m):
            segments.append(slot)
            starts.append(start + offset)
            ends.append(start + count)
        start += count
    return [segments, starts, ends]


@functools.lru_cache(maxsize=None)
def _triton_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def grouped_gemm(x_ptr, w_ptr, y_ptr, tiles_ptr, num_tiles, K, N,
                     stride_xm, stride_xk, stride_wg, stride_wk, stride_wn, stride_ym, stride_yn,
                     SWIGLU: tl.constexpr, PRECISION: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        tile = tl.program_id(0)
        pid_n = tl.program_id(1)
        segment = tl.load(tiles_ptr + tile).to(tl.int64)
        row_start = tl.load(tiles_ptr + num_tiles + tile)
        row_end = tl.load(tiles_ptr + 2 * num_tiles + tile)
        rows = row_start.to(tl.int64) + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < row_end
        col_ok = cols < N
        w_base = w_ptr + segment * stride_wg
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & col_ok[None, :]
            w = tl.load(w_base + ks[:, None] * stride_wk + cols[None, :] * stride_wn, mask=w_mask, other=0.0)
            acc += tl.dot(x, w, input_precision=PRECISION)
            if SWIGLU:
                # The up half of the stacked matrix sits N columns to the right of the gate half.
                w_up = tl.load(w_base + ks[:, None] * stride_wk + (cols[None, :] + N) * stride_wn,
                               mask=w_mask, other=0.0)
                acc_up += tl.dot(x, w_up, input_precision=PRECISION)
        if SWIGLU:
            acc = acc * tl.sigmoid(acc) * acc_up
        tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn,
                 acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    return grouped_gemm


def _launch_shape(rows: torch.Tensor, segment_counts: list[int]) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for this call."""
    if rows.device.type != "cuda":
        return 16, 16, 16, 1, 1  # the interpreter: the smallest shapes tl.dot accepts
    busy = [c for c in segment_counts if c] or [1]
    mean_rows = sum(busy) / len(busy)
    # Short segments waste most of a tall tile: match the tile height to the typical segment.
    block_m = 16 if mean_rows <= 16 else 32 if mean_rows <= 32 else 64
    if rows.dtype == torch.float32:  # 4-byte tiles: keep two weight tiles per stage in shared memory
        return block_m, 64, 32, 4, 3
    return block_m, 128, 64, 8, 3


def grouped_gemm_triton(rows: torch.Tensor, segment_counts: list[int], weights: torch.Tensor, out_cols: int,
                        swiglu_epilogue: bool, launch: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """One launch over all segments: rows [R, K] x weights [S, K, out_cols (x2 when swiglu)] -> [R, out_cols].

    launch: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) to override the built-in choice.
    """
    out = rows.new_empty(rows.shape[0], out_cols)
    if rows.shape[0] == 0:
        return out
    block_m, block_n, block_k, num_warps, num_stages = launch or _launch_shape(rows, segment_counts)
    table = tile_table(segment_counts, block_m)
    num_tiles = len(table[0])
    tiles = torch.tensor(table, dtype=torch.int32)
    if rows.device.type == "cuda":
        tiles = tiles.pin_memory().to(rows.device, non_blocking=True)
    # fp32 inputs: full-precision dot (matches torch's default fp32 matmul); 16-bit inputs use the
    # tensor cores' native path.
    precision = "ieee" if rows.dtype == torch.float32 else None
    grid = (num_tiles, -(-out_cols // block_n))
    _triton_kernel()[grid](
        rows, weights, out, tiles, num_tiles, rows.shape[1], out_cols,
        rows.stride(0), rows.stride(1), weights.stride(0), weights.stride(1), weights.stride(2),
        out.stride(0), out.stride(1),
        SWIGLU=swiglu_epilogue, PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages)
    return out


def grouped_swiglu_triton(rows: torch.Tensor, segment_counts: list[int], w13: torch.Tensor,
                          w2: torch.Tensor, launch: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """Two launches per layer: gate|up with the SwiGLU epilogue, then down."""
    ffn = w2.shape[1]
    hidden_act = grouped_gemm_triton(rows, segment_counts, w13, ffn, swiglu_epilogue=True, launch=launch)
    return grouped_gemm_triton(hidden_act, segment_counts, w2, w2.shape[2], swiglu_epilogue=False, launch=launch)


def grouped_swiglu(kernel: str):
    """The expert-compute function for a kernel name ("torch" or "triton")."""
    return grouped_swiglu_triton if kernel == "triton" else grouped_swiglu_torch
