"""moewatch on a Hugging Face transformers MoE model: `attach(model, ...)` counts what each router
chose through forward hooks and writes the same Windows (runtime "transformers") into the same sinks
as the vLLM plugin; `detach()` flushes the last window and removes every hook, leaving the model as
it was.

Routers are found by what they are, not by architecture: modules whose class name ends in
`TopKRouter` / `TopkRouter` (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3, GPT-OSS in
transformers 5), whose forward returns (logits, weights, top-k ids [N, k]). A step is one forward of
the whole model; its real tokens are those the attention mask keeps (the last S columns of the mask
for the S tokens fed, so cached decoding counts only the new tokens), padding is left out.

Measured: pairs per MoE layer and logical expert, tokens per step, wall time per step (perf_counter
after the forward; on a GPU that is launch time, so it is left out there). Absent: per-layer and
phase timings, rank-level counts (one process holds every expert).
"""

from __future__ import annotations

import re
import time
from typing import Callable, Sequence

import torch

from moewatch.telemetry import Window

from .clock import EventClock, cuda_event_factory
from .common import EngineRecorder, EngineSettings, PairWeights

RUNTIME_NAME = "transformers"
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def find_routers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """[(decoder layer index, router module)] in layer order."""
    found = []
    for name, module in model.named_modules():
        if type(module).__name__.lower().endswith("topkrouter"):
            match = _LAYER_INDEX.search(name + ".")
            found.append((int(match.group(1)) if match else len(found), module))
    return sorted(found, key=lambda item: item[0])


def _num_experts(router: torch.nn.Module) -> int:
    for attr in ("num_experts", "n_routed_experts", "num_local_experts"):
        if isinstance(getattr(router, attr, None), int):
            return getattr(router, attr)
    return int(router.weight.shape[0])


class TransformersProbe:
    """The hooks on one model; build it with `attach`."""

    def __init__(self, model: torch.nn.Module, settings: EngineSettings, *, model_name: str | None = None,
                 sinks: Sequence[Callable[[Window], object]] = ()):
        routers = find_routers(model)
        if not routers:
            raise ValueError("model: no MoE router module (a *TopKRouter) found")
        experts = {_num_experts(r) for _, r in routers}
        top_ks = {int(r.top_k) for _, r in routers}
        if len(experts) != 1 or len(top_ks) != 1:
            raise ValueError(f"model: routers disagree on experts {sorted(experts)} or top-k {sorted(top_ks)}")
        self.model = model
        param = next(model.parameters())
        config = getattr(model, "config", None)
        hidden = int(getattr(config, "hidden_size", 0) or routers[0][1].weight.shape[1])
        name = model_name or getattr(config, "name_or_path", "") or getattr(config, "model_type", "") or "model"
        self._weights = PairWeights(1, top_ks.pop(), param.device)  # unused: counts are added per step
        self.recorder = EngineRecorder(
            settings, runtime=RUNTIME_NAME, model=str(name), top_k=self._weights.top_k,
            hidden_bytes=hidden * param.element_size(), num_experts=experts.pop(), weights=self._weights,
            time_steps=param.device.type == "cpu", sinks=sinks,
            clock=EventClock(cuda_event_factory()) if param.device.type == "cuda" else None)
        self._pair_mask: torch.Tensor | None = None
        self._handles = [model.register_forward_pre_hook(self._begin, with_kwargs=True),
                         model.register_forward_hook(self._end, always_call=True)]
        for layer_id, router in routers:
            counter = self.recorder.counter(layer_id)
            self._handles.append(router.register_forward_hook(self._router_hook(counter)))

    # --- hooks -------------------------------------------------------------------------------------
    def _begin(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        shape = tuple(ids.shape) if ids is not None else tuple(embeds.shape[:2])
        batch, seq = shape if len(shape) == 2 else (1, shape[-1])
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] == batch and mask.shape[1] >= seq:
            keep = mask[:, -seq:].reshape(-1).to(torch.int64)
        else:
            keep = torch.ones(batch * seq, dtype=torch.int64, device=self._weights.tensor.device)
        # Per pair, token-major: the router's ids [B*S, k] line up with this after a flatten.
        self._pair_mask = keep.repeat_interleave(self._weights.top_k)
        # The token count is read on the host once per step (transformers runs eagerly anyway).
        self.recorder.begin_step(int(keep.sum()) if mask is not None else batch * seq)

    def _router_hook(self, counter):
        def hook(module, args, output) -> None:
            if self._pair_mask is None:
                return
            ids = output[2].reshape(-1)
            if ids.shape[0] == self._pair_mask.shape[0]:
                counter.counts.index_add_(0, ids, self._pair_mask)
        return hook

    def _end(self, module, args, output) -> None:
        if self._pair_mask is None:
            return
        self._pair_mask = None
        self.recorder.end_step()

    # --- lifecycle ---------------------------------------------------------------------------------
    def flush(self) -> Window | None:
        return self.recorder.flush()

    def detach(self) -> None:
        """Flush the last window, close the sinks, remove every hook."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.recorder.close()
        if _ATTACHED.get(id(self.model)) is self:
            del _ATTACHED[id(self.model)]


_ATTACHED: dict[int, TransformersProbe] = {}


def attach(model: torch.nn.Module, *, socket: str | None = None, window_dir: str | None = None,
           window_steps: int | None = None, window_seconds: float | None = None, model_name: str | None = None,
           ep_group: str = "ep0", sinks: Sequence[Callable[[Window], object]] = ()) -> TransformersProbe:
    """Count `model`'s routing into Windows sent to the agent's `socket`, written into `window_dir`,
    and/or handed to `sinks`. Without any of the three, the MOEWATCH_* environment decides; a window
    lasts `window_steps` forwards (50 when neither length is given) or `window_seconds`."""
    if id(model) in _ATTACHED:
        raise ValueError("model: already attached; detach() it first")
    if socket is None and window_dir is None and not sinks:
        settings = EngineSettings.from_env()
        if settings is None:
            raise ValueError("socket: give socket, window_dir or sinks (or set MOEWATCH_SOCKET / MOEWATCH_WINDOW_DIR)")
    else:
        if window_steps is None and window_seconds is None:
            window_steps = 50
        settings = EngineSettings(socket=socket, window_dir=window_dir, window_steps=window_steps,
                                  window_seconds=window_seconds, model=model_name, ep_group=ep_group)
    probe = TransformersProbe(model, settings, model_name=model_name or settings.model, sinks=sinks)
    _ATTACHED[id(model)] = probe
    return probe


def detach(model: torch.nn.Module) -> None:
    """Detach the probe attached to `model` (no-op when none is)."""
    probe = _ATTACHED.get(id(model))
    if probe is not None:
        probe.detach()
