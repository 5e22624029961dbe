"""SGLang's own recorder code, imported once per session (its import pulls in much of SGLang: slow).

SGLang does not run on this CPU machine, but the pure-Python pieces that write its dumps do: the
accumulators of python/sglang/srt/eplb/expert_distribution.py under a published test config
(`override_server_args`), and its file writer `_dump_to_file`. A missing SGLang is an import error
here, so under CI it fails the tests rather than skipping them (the Makefile installs it).

Its /metrics heatmap likewise: SGLang's own collector (ExpertDispatchCollector, in prometheus-client's
default registry as SGLang uses it), filled by SGLang's own `_handle_metric_eplb_heatmap`, served over
HTTP on 127.0.0.1.
"""

from __future__ import annotations

import socket
import types
import warnings

import numpy as np
import pytest
from prometheus_client import REGISTRY, start_http_server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def sglang_recorder():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch
        import torch.distributed as dist
        from sglang.srt import runtime_context
        from sglang.srt.eplb import expert_distribution

    # The stat accumulator all-reduces its buffer over the EP group: a one-rank gloo group stands in.
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)

    class Recorder:
        """Drives SGLang's accumulators the way its recorder does: append per pass, dump on request."""

        ed = expert_distribution

        @staticmethod
        def metadata(physical_to_logical_map, ep_size):
            pmap = torch.as_tensor(physical_to_logical_map)
            # The fields of ExpertLocationMetadata the accumulators read.
            return types.SimpleNamespace(num_layers=pmap.shape[0], num_physical_experts=pmap.shape[1],
                                         num_logical_experts=int(pmap.max()) + 1, ep_size=ep_size,
                                         physical_to_logical_map=pmap)

        @staticmethod
        def dump(folder, monkeypatch, mode, metadata, rank, passes, buffer_size=-1):
            """passes: [(forward_pass_id, global_physical_count [L, P])]; writes SGLang's file."""
            monkeypatch.setenv("SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR", str(folder))
            with runtime_context._CONTEXT.override_server_args(
                    expert_distribution_recorder_mode=mode, expert_distribution_recorder_buffer_size=buffer_size):
                acc = expert_distribution._Accumulator.init_new(metadata, rank)
                # The first stat dump frees the CUDA cache, a call the CPU torch lacks.
                acc._first_dump = False
                for pass_id, counts in passes:
                    acc.append(pass_id, "primary",
                               {"global_physical_count": torch.as_tensor(counts, dtype=torch.int32)}, {})
                acc.dump("file")

    return Recorder


@pytest.fixture
def sglang_heatmap(sglang_recorder, monkeypatch):
    """(url, record, restart): record(counts [L, W]) is one sampled pass through SGLang's own heatmap
    code; restart() is a new server process (a new collector: its counters start from zero)."""
    from sglang.srt.observability.metrics_collector import ExpertDispatchCollector

    monkeypatch.setenv("SGLANG_EPLB_HEATMAP_COLLECTION_INTERVAL", "1")  # sample every pass
    handle = sglang_recorder.ed._UtilizationRateAccumulatorMixin._handle_metric_eplb_heatmap
    server, thread = start_http_server(0, addr="127.0.0.1", registry=REGISTRY)
    state = {"recorder": None}

    def start(ep_size: int) -> None:
        state["recorder"] = types.SimpleNamespace(
            _expert_location_metadata=types.SimpleNamespace(ep_size=ep_size, num_layers=0),
            _expert_dispatch_collector=ExpertDispatchCollector(ep_size), _metric_heatmap_collection_counter=0)

    def record(gpu_physical_count) -> None:
        counts = np.asarray(gpu_physical_count)
        if state["recorder"] is None:
            start(counts.shape[1])
        state["recorder"]._expert_location_metadata.num_layers = counts.shape[0]
        # Host counts: with a torch tensor, a single-process prometheus-client registry aliases the
        # running sum of the buckets (`acc += tensor` in place), so every bucket would read the total.
        # SGLang serves its metrics in multiprocess mode, where values are written as floats.
        handle(state["recorder"], counts.astype(np.int64))

    def restart() -> None:
        REGISTRY.unregister(state["recorder"]._expert_dispatch_collector.eplb_gpu_physical_count)
        start(state["recorder"]._expert_location_metadata.ep_size)

    url = f"http://127.0.0.1:{server.server_port}/metrics"
    try:
        yield url, record, restart
    finally:
        if state["recorder"] is not None:
            REGISTRY.unregister(state["recorder"]._expert_dispatch_collector.eplb_gpu_physical_count)
        server.shutdown()
        server.server_close()
        thread.join(5)
