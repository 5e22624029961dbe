"""SGLang 0.5.23's own runtime state on the CPU, for the hook's tests: its published server
configuration (`runtime_context._CONTEXT.override_server_args`, then `initialize_moe_config`, as a
scheduler process does), this process's ranks (`get_parallel().override`), and its real
expert-distribution recorder (`ExpertDistributionRecorder.init_new`, published with
`set_global_expert_distribution_recorder`) over an expert-location metadata of the fields it reads.

The one stand-in: SGLang's `get_device()` raises without an accelerator, so the recorder's gatherer
buffers are placed on the CPU. A one-rank gloo group stands in for the EP group its stat dump
all-reduces over.
"""

from __future__ import annotations

import contextlib
import socket
import types
import warnings

import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import torch.distributed as dist
    from sglang.srt import runtime_context
    from sglang.srt.eplb import expert_distribution
    from sglang.srt.layers.moe import utils as moe_utils


SPY_CALLS: list = []


def spy_hooks(config):
    """A --forward-hooks factory (`sglang_server:spy_hooks`): records the layer of every call a hook gets."""
    return lambda module, inputs, output: SPY_CALLS.append(module.layer_id)


def _gloo() -> bool:
    """A one-rank gloo group for the recorder's all-reduce; True when this call made it (the caller
    then destroys it, so a later test in the same process can make its own)."""
    if dist.is_initialized():
        return False
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return True


def metadata(pmap: torch.Tensor, ep_size: int):
    """The ExpertLocationMetadata fields SGLang's recorder reads."""
    L, P = pmap.shape
    return types.SimpleNamespace(num_layers=L, num_physical_experts=P, num_logical_experts=int(pmap.max()) + 1,
                                 ep_size=ep_size, num_local_physical_experts=P // ep_size,
                                 physical_to_logical_map=pmap)


@contextlib.contextmanager
def server(monkeypatch, *, ranks: dict | None = None, recorder_pmap: torch.Tensor | None = None,
           recording: bool = False, **server_args):
    """Inside: SGLang's configuration published with `server_args`, this process's `ranks`, and,
    with `recorder_pmap`, a real recorder (mode from server_args) published as SGLang's global one.
    Yields the recorder (or None)."""
    made_group = _gloo()
    monkeypatch.setattr(expert_distribution, "get_device", lambda *a, **k: "cpu")
    previous = expert_distribution.get_global_expert_distribution_recorder()
    flags = runtime_context.get_flags().moe
    saved_flags = {name: getattr(flags, name) for name in ("a2a_backend", "runner_backend", "deepep_mode", "tbo_enabled")}
    with runtime_context._CONTEXT.override_server_args(**server_args):
        moe_utils.initialize_moe_config()
        with runtime_context.get_parallel().override(**(ranks or {})):
            recorder = None
            if recorder_pmap is not None:
                ep_size = server_args.get("ep_size", 1)
                recorder = expert_distribution.ExpertDistributionRecorder.init_new(
                    metadata(recorder_pmap, ep_size), (ranks or {}).get("moe_ep_rank", 0))
                expert_distribution.set_global_expert_distribution_recorder(recorder)
                if recording:
                    recorder.start_record()
            try:
                yield recorder
            finally:
                expert_distribution.set_global_expert_distribution_recorder(previous)
                for name, value in saved_flags.items():  # initialize_moe_config's process-wide flags
                    setattr(flags, name, value)
                if made_group:
                    dist.destroy_process_group()


def cuda_graph_setup_functions(*names: str) -> dict:
    """Functions of SGLang's installed model_runner_components/cuda_graph_setup.py, compiled from its
    source with the names they use bound to SGLang's own objects (importing the module pulls in
    SGLang's OpenAI server, whose dependencies this environment leaves out)."""
    import ast
    import importlib.util
    from pathlib import Path

    from sglang.srt.distributed.device_communicators import pynccl_allocator
    from sglang.srt.model_executor import hook_manager

    spec = importlib.util.find_spec("sglang.srt.model_executor")
    path = Path(spec.submodule_search_locations[0]) / "model_runner_components" / "cuda_graph_setup.py"
    tree = ast.parse(path.read_text())
    wanted = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    assert sorted(n.name for n in wanted) == sorted(names), f"{path} lacks one of {names}"
    namespace = {"register_forward_hooks": hook_manager.register_forward_hooks,
                 "prealloc_symmetric_memory_pool": pynccl_allocator.prealloc_symmetric_memory_pool,
                 "get_observability": runtime_context.get_observability, "get_exec": runtime_context.get_exec,
                 "__name__": "sglang.srt.model_executor.model_runner_components.cuda_graph_setup"}
    module = ast.Module(body=wanted, type_ignores=[])
    exec(compile(module, str(path), "exec"), namespace)
    namespace["__source__"] = {n.name: ast.get_source_segment(path.read_text(), n) for n in wanted}
    return namespace
