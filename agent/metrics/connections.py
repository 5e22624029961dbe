"""Families the receiver and the HTTP server write: frames in, frames refused, connections refused
or closed by the agent."""

from __future__ import annotations

from .family import Counter, families_of

FRAMES_RECEIVED_TOTAL = Counter("moewatch_frames_received_total", ("type",), "Frames received, by type.")
FRAMES_REJECTED_TOTAL = Counter(
    "moewatch_frames_rejected_total", ("reason",),
    "Frames rejected (malformed, oversized, out_of_order, stale_epoch, invalid_window...).")
CONNECTIONS_REFUSED_TOTAL = Counter(
    "moewatch_connections_refused_total", ("reason",),
    "Runtime connections refused at accept (max_connections, out_of_descriptors) or HTTP "
    "connections refused (http_max_connections).")
CONNECTIONS_CLOSED_TOTAL = Counter(
    "moewatch_connections_closed_total", ("reason",),
    "Runtime connections the agent closed on a peer (slow_reader, frame_deadline, buffer_budget, "
    "hello_deadline, hello_evicted).")

FAMILIES = families_of(globals())
