"""Who sends to whom, and when: Aurora's ordering of one all-to-all exchange.

An all-to-all over W ranks moves matrix[i, j] rows from rank i to rank j (the diagonal stays local).
With every rank on its own link of rate B (bytes per second, the same in and out), no order can end
before max(largest row sum, largest column sum) x row bytes / B: the busiest sender must push its
rows out and the busiest receiver must take its rows in ([aurora]). Sent all at once, receivers take
several senders at once and share their link among them, while other links idle.

`aurora_schedule` reaches the bound in the ideal: the off-diagonal matrix is padded with dummy
transfers until every row and column sums to the bound, and the padded matrix is split into rounds,
each a perfect matching (every rank sends to exactly one rank and receives from exactly one) that
moves the same amount on every pair it uses (Birkhoff-von Neumann). Every round picks the matching
whose smallest entry is largest (bottleneck matching), so rounds are few (at most W^2 - 2W + 2) and
the heaviest transfers go first. Rounds then lose their dummy parts: a rank whose part of a round is
dummy idles for it. A pair's rows may be split over several rounds, in row order.

Sizes: W ranks, R rounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class A2ASchedule:
    """Rounds of one exchange: in round r rank i sends amount[r, i] rows to rank dest[r, i] (-1 and 0:
    it sends nothing) starting at row offset[r, i] of its block for that rank. Each rank receives
    from at most one rank per round (source is dest's inverse)."""

    dest: np.ndarray  # [R, W] int64, -1 where the rank sends nothing in the round
    amount: np.ndarray  # [R, W] int64 rows
    offset: np.ndarray  # [R, W] int64 first row of the chunk within the (i, dest) block

    @property
    def num_rounds(self) -> int:
        return int(self.dest.shape[0])

    def source(self) -> np.ndarray:
        """[R, W] the rank each rank receives from in each round (-1: none)."""
        R, W = self.dest.shape
        src = np.full((R, W), -1, dtype=np.int64)
        rounds, senders = np.nonzero(self.dest >= 0)
        src[rounds, self.dest[rounds, senders]] = senders
        return src

    def round_rows(self) -> np.ndarray:
        """[R] the largest chunk of each round: its length when rounds run one after another."""
        return self.amount.max(axis=1) if self.num_rounds else np.zeros(0, dtype=np.int64)


def offdiagonal(matrix: np.ndarray) -> np.ndarray:
    """[W, W] -> the same with the diagonal (local rows, never on a link) set to zero, int64."""
    m = np.array(matrix, dtype=np.int64, copy=True)
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise ValueError(f"matrix: expected a square [W, W] array, got shape {list(m.shape)}")
    if np.any(m < 0):
        raise ValueError("matrix: row counts must be non-negative")
    np.fill_diagonal(m, 0)
    return m


def transfer_bound(matrix: np.ndarray) -> int:
    """[W, W] rows rank i sends rank j -> max(largest row sum, largest column sum) off the diagonal:
    Aurora's lower bound on the exchange, in rows (times row bytes over the link rate: seconds)."""
    m = offdiagonal(matrix)
    if m.size == 0:
        return 0
    return int(max(m.sum(axis=1).max(), m.sum(axis=0).max()))


def transfer_bound_seconds(matrix: np.ndarray, row_bytes: float, rank_bytes_per_second) -> float:
    """[W, W] rows, bytes per row, [W] each rank's link rate (the same out and in) -> the bound in
    seconds: the slowest of any rank pushing out its row or taking in its column at its own rate."""
    m = offdiagonal(matrix).astype(np.float64)
    rates = np.asarray(rank_bytes_per_second, dtype=np.float64)
    if rates.shape != (m.shape[0],) or np.any(~np.isfinite(rates)) or np.any(rates <= 0):
        raise ValueError(f"rank_bytes_per_second: expected {m.shape[0]} positive rates")
    if m.size == 0:
        return 0.0
    return float(max((m.sum(axis=1) / rates).max(), (m.sum(axis=0) / rates).max()) * row_bytes)


def _pad_to_bound(m: np.ndarray, bound: int) -> np.ndarray:
    """Dummy rows [W, W] that bring every row and column of m to `bound` (north-west corner rule)."""
    W = m.shape[0]
    row_left = bound - m.sum(axis=1)
    col_left = bound - m.sum(axis=0)
    pad = np.zeros_like(m)
    i = j = 0
    while i < W and j < W:
        take = min(row_left[i], col_left[j])
        pad[i, j] += take
        row_left[i] -= take
        col_left[j] -= take
        if row_left[i] == 0:
            i += 1
        if col_left[j] == 0:
            j += 1
    return pad


def _perfect_matching(allowed: np.ndarray) -> np.ndarray | None:
    """[W, W] bool -> [W] column matched to each row using only allowed cells, or None (augmenting paths)."""
    W = allowed.shape[0]
    match_col = np.full(W, -1, dtype=np.int64)  # row matched to each column

    def augment(row: int, seen: np.ndarray) -> bool:
        for col in np.flatnonzero(allowed[row]):
            if seen[col]:
                continue
            seen[col] = True
            if match_col[col] < 0 or augment(int(match_col[col]), seen):
                match_col[col] = row
                return True
        return False

    for row in range(W):
        if not augment(row, np.zeros(W, dtype=bool)):
            return None
    match_row = np.empty(W, dtype=np.int64)
    match_row[match_col] = np.arange(W)
    return match_row


def _bottleneck_matching(padded: np.ndarray) -> np.ndarray:
    """The perfect matching on positive cells whose smallest cell is largest: [W] column per row."""
    values = np.unique(padded[padded > 0])
    lo, hi = 0, len(values) - 1  # a matching exists at values[0] (Birkhoff: equal row and column sums)
    best = _perfect_matching(padded >= values[0])
    while lo < hi:
        mid = (lo + hi + 1) // 2
        found = _perfect_matching(padded >= values[mid])
        if found is None:
            hi = mid - 1
        else:
            lo, best = mid, found
    return best


def aurora_schedule(matrix: np.ndarray) -> A2ASchedule:
    """[W, W] rows rank i sends rank j -> the rounds that finish at `transfer_bound` when each round's
    chunks move in parallel and rounds follow each other (module docstring). Deterministic: every
    rank that plans from the same matrix gets the same rounds."""
    real = offdiagonal(matrix)
    W = real.shape[0]
    bound = transfer_bound(real)
    dests, amounts, offsets = [], [], []
    if bound > 0:
        padded = real + _pad_to_bound(real, bound)
        left = real.copy()  # real rows not yet scheduled, per pair
        sent = np.zeros_like(real)  # real rows already scheduled, per pair (the next chunk's offset)
        senders = np.arange(W)
        while padded.any():
            cols = _bottleneck_matching(padded)
            step = int(padded[senders, cols].min())
            padded[senders, cols] -= step
            # Real rows go first in each cell; what is left of the step is dummy.
            chunk = np.minimum(left[senders, cols], step)
            if chunk.any():
                dests.append(np.where(chunk > 0, cols, -1))
                amounts.append(chunk.copy())
                offsets.append(np.where(chunk > 0, sent[senders, cols], 0))
                left[senders, cols] -= chunk
                sent[senders, cols] += chunk
    if not dests:
        empty = np.zeros((0, W), dtype=np.int64)
        return A2ASchedule(empty, empty.copy(), empty.copy())
    dest, amount, offset = np.stack(dests), np.stack(amounts), np.stack(offsets)
    order = np.argsort(-amount.max(axis=1), kind="stable")  # heaviest round first
    return A2ASchedule(dest[order].astype(np.int64), amount[order].astype(np.int64), offset[order].astype(np.int64))


def matching_rounds(matrix: np.ndarray) -> A2ASchedule:
    """[W, W] -> rounds that move every pair whole (no splitting): each round the matching of the
    heaviest transfers left (a maximum-weight assignment), heaviest round first. Often W - 1 rounds
    on near-uniform traffic against up to W^2 - 2W + 2 for `aurora_schedule`, at the price of ending
    above the bound when a round's transfers differ in size (the sum of each round's largest)."""
    from scipy.optimize import linear_sum_assignment

    left = offdiagonal(matrix)
    W = left.shape[0]
    dests, amounts = [], []
    while left.any():
        rows, cols = linear_sum_assignment(-left.astype(np.float64))
        chunk = left[rows, cols]
        dest = np.where(chunk > 0, cols, -1)
        dests.append(dest[np.argsort(rows)])
        amounts.append(chunk[np.argsort(rows)].copy())
        left[rows, cols] = 0
    if not dests:
        empty = np.zeros((0, W), dtype=np.int64)
        return A2ASchedule(empty, empty.copy(), empty.copy())
    dest, amount = np.stack(dests).astype(np.int64), np.stack(amounts).astype(np.int64)
    return A2ASchedule(dest, amount, np.zeros_like(amount))


def plan_exchange(matrix: np.ndarray, round_cost_rows: float = 0.0) -> A2ASchedule:
    """The rounds to run: `aurora_schedule` (ends at the bound) unless the whole-transfer rounds of
    `matching_rounds` are predicted faster once each round's fixed cost (round_cost_rows: a round's
    synchronisation, in rows' worth of link time) is counted. With no round cost: always Aurora's."""
    bound_plan = aurora_schedule(matrix)
    if round_cost_rows <= 0 or bound_plan.num_rounds == 0:
        return bound_plan
    whole = matching_rounds(matrix)

    def cost(plan: A2ASchedule) -> float:
        return float(plan.round_rows().sum()) + round_cost_rows * plan.num_rounds

    return whole if cost(whole) < cost(bound_plan) else bound_plan


def fair_share_seconds(matrix: np.ndarray, row_bytes: float, link_bytes_per_second: float) -> float:
    """Seconds for every transfer of [W, W] started at once, each rank's link (out and in, rate
    link_bytes_per_second) shared max-min fairly among its live transfers (the fluid model of an
    unscheduled exchange: what TCP converges to at best, with no loss or incast collapse)."""
    m = offdiagonal(matrix).astype(np.float64) * row_bytes
    if link_bytes_per_second <= 0:
        raise ValueError("link_bytes_per_second must be positive")
    W = m.shape[0]
    t = 0.0
    while (m > 0).any():
        live = m > 0
        rate = np.zeros_like(m)
        fixed = np.zeros_like(live)
        out_left = np.full(W, float(link_bytes_per_second))
        in_left = np.full(W, float(link_bytes_per_second))
        while (live & ~fixed).any():  # progressive filling: the tightest link fixes its flows
            free = live & ~fixed
            out_n, in_n = free.sum(axis=1), free.sum(axis=0)
            out_share = np.where(out_n > 0, out_left / np.maximum(out_n, 1), np.inf)
            in_share = np.where(in_n > 0, in_left / np.maximum(in_n, 1), np.inf)
            share = min(out_share.min(), in_share.min())
            tight = np.zeros_like(live)
            tight[np.isclose(out_share, share), :] = True
            tight[:, np.isclose(in_share, share)] = True
            newly = free & tight
            rate[newly] = share
            fixed |= newly
            out_left -= np.where(newly, share, 0.0).sum(axis=1)
            in_left -= np.where(newly, share, 0.0).sum(axis=0)
        dt = float((m[live] / rate[live]).min())
        m = np.where(live, np.maximum(m - rate * dt, 0.0), 0.0)
        m[m < 1e-9 * row_bytes] = 0.0
        t += dt
    return t


def exchange_seconds(matrices: np.ndarray, row_bytes: float, link_bytes_per_second: float,
                     schedule: str) -> np.ndarray:
    """[L, W, W] rows per layer -> [L] predicted seconds of one exchange each: "aurora" at the bound,
    "none" by the fair-share fluid model. Multiply by two for dispatch plus combine."""
    mats = np.asarray(matrices)
    if schedule == "aurora":
        return np.array([transfer_bound(m) * row_bytes / link_bytes_per_second for m in mats])
    if schedule == "none":
        return np.array([fair_share_seconds(m, row_bytes, link_bytes_per_second) for m in mats])
    raise ValueError(f"schedule: expected 'none' or 'aurora', got {schedule!r}")
