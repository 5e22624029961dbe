"""Test-only, for vLLM's CPU build serving with data parallelism (test_vllm_dp_serving.py puts this
folder on the engine processes' PYTHONPATH): vLLM 0.32.0's CPU communicator lacks the two variable-size
collectives its MoE layer calls under DP (`all_gatherv` in the all-gather dispatch, `reduce_scatterv`
in the combine: NotImplementedError on the first step with tokens). This gives the CPU communicator
both, over torch.distributed on its own group, as a GPU build's communicator has them; nothing else of
vLLM changes. Applied when vLLM imports its CPU communicator."""

import importlib.abc
import importlib.machinery
import sys

TARGET = "vllm.distributed.device_communicators.cpu_communicator"


def _all_gatherv(self, input_, dim=0, sizes=None):
    import torch

    assert dim == 0 and sizes is not None and len(sizes) == self.world_size, (dim, sizes)
    tensors = input_ if isinstance(input_, (list, tuple)) else [input_]
    most = max(sizes)
    out = []
    for tensor in tensors:
        padded = torch.zeros((most, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        padded[:tensor.shape[0]] = tensor
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, padded, group=self.device_group)
        out.append(torch.cat([part[:n] for part, n in zip(parts, sizes)]))
    return out if isinstance(input_, (list, tuple)) else out[0]


def _reduce_scatterv(self, input_, dim=-1, sizes=None):
    import torch

    dim = dim % input_.dim()
    assert dim == 0 and sizes is not None and sum(sizes) == input_.shape[0], (dim, sizes, input_.shape)
    total = input_.clone()
    torch.distributed.all_reduce(total, group=self.device_group)
    start = sum(sizes[:self.rank_in_group])
    return total[start:start + sizes[self.rank_in_group]].contiguous()


class _Patch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def patched(module):
            exec_module(module)
            module.CpuCommunicator.all_gatherv = _all_gatherv
            module.CpuCommunicator.reduce_scatterv = _reduce_scatterv

        spec.loader.exec_module = patched
        return spec


sys.meta_path.insert(0, _Patch())
