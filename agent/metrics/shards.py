"""Families of the shard merge (agent/shards.py): windows merged from the shards of a sharded EP
group, shards missing at the deadline or refused, sequences held, and engine rebalance calls whose
digests differ across shards."""

from __future__ import annotations

from typing import TYPE_CHECKING

from moewatch.shards import DISAGREEMENTS

from .family import GROUP, Counter, Gauge, families_of

if TYPE_CHECKING:
    from .state import MetricsState

SHARD_WINDOWS_TOTAL = Counter(
    "moewatch_shard_windows_total", (*GROUP, "outcome"),
    "Windows merged from a sharded group's shards: complete (every shard in) or partial (merged at the "
    "deadline, limits.shard_deadline_windows, without the shards still missing or refused).")
SHARDS_MISSING_TOTAL = Counter(
    "moewatch_shards_missing_total", GROUP,
    "Shards a merged window lacked because they had not arrived by the deadline (named in the window's "
    "extra.shards and as the missing-evidence kind shards).")
SHARDS_REFUSED_TOTAL = Counter(
    "moewatch_shards_refused_total", (*GROUP, "reason"),
    "Shards left out of their window: late_shard (arrived after its sequence was merged), duplicate_shard, "
    "count_mismatch, sizes_mismatch, map_mismatch, epoch_mismatch (disagreed with the other shards of its "
    "sequence), invalid_merge (the merged window broke the contract).")
SHARD_SEQUENCES_PENDING = Gauge(
    "moewatch_shard_sequences_pending", GROUP,
    "Window sequences of a sharded group held waiting for their shards.")
DIGEST_MISMATCHES_TOTAL = Counter(
    "moewatch_engine_rebalance_digest_mismatches_total", GROUP,
    "Engine rebalance calls whose digest (inputs, settings and result of the policy call) differed across "
    "the shards of the group: ranks that may hold different maps.")

FAMILIES = families_of(globals())

LATE_SHARD = "late_shard"
DUPLICATE_SHARD = "duplicate_shard"
INVALID_MERGE = "invalid_merge"
REFUSAL_REASONS = (LATE_SHARD, DUPLICATE_SHARD, *DISAGREEMENTS, INVALID_MERGE)  # a bounded label set
OUTCOMES = ("complete", "partial")


def init_group(state: MetricsState, group: tuple[str, str]) -> None:
    """A sharded group's counters start at 0, so an alert's increase() sees the first event."""
    for outcome in OUTCOMES:
        state[SHARD_WINDOWS_TOTAL].inc((*group, outcome), 0)
    for reason in REFUSAL_REASONS:
        state[SHARDS_REFUSED_TOTAL].inc((*group, reason), 0)
    state[SHARDS_MISSING_TOTAL].inc(group, 0)
    state[DIGEST_MISMATCHES_TOTAL].inc(group, 0)
    state[SHARD_SEQUENCES_PENDING].set(group, 0)
