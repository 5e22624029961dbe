"""The transformers probe on each MoE architecture the pinned transformers has, against routing
recomputed from the router logits by our own code (tiny_models.select)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moewatch.runtime.engines import transformers_probe as tp
from moewatch.telemetry import Window

import tiny_models


def test_the_pinned_transformers_has_every_architecture():
    assert tiny_models.AVAILABLE == list(tiny_models.ARCHS)


def _batches():
    g = torch.Generator().manual_seed(3)
    padded = torch.randint(0, 256, (3, 11), generator=g)
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, 7:] = 0  # right padding: these tokens route but are not real
    mask[2, 4:] = 0
    plain = torch.randint(0, 256, (2, 6), generator=g)
    return [(padded, mask), (plain, None)]


@pytest.mark.parametrize("arch", list(tiny_models.ARCHS))
def test_counts_equal_routing_recomputed_from_router_logits(arch):
    model = tiny_models.build(arch)
    batches = _batches()
    num_experts = tiny_models.router_modules(model)[0].num_experts
    expected = tiny_models.recompute(model, arch, batches, num_experts)
    windows: list[Window] = []
    probe = tp.attach(model, window_steps=1, sinks=[windows.append], model_name=f"tiny-{arch}")
    with torch.no_grad():
        for ids, mask in batches:
            model(input_ids=ids, attention_mask=mask)
    probe.detach()
    assert len(windows) == 2
    got = sum(w.expert_tokens for w in windows)
    np.testing.assert_array_equal(got, expected)
    first = windows[0]
    assert first.runtime == "transformers" and first.model == f"tiny-{arch}"
    assert first.num_layers == expected.shape[0] and first.top_k == 2
    assert [int(w.step_tokens.sum()) for w in windows] == [11 + 7 + 4, 12]
    assert first.extra["layer_ids"] == [i for i, _ in tp.find_routers(model)]
    # Only logical counts are seen: rank-level counts and layer timings are absent, not zero.
    assert first.slot_tokens is None and first.sent_tokens is None and first.layer_seconds is None


def test_detach_restores_the_model_and_flushes_the_partial_window(tmp_path):
    model = tiny_models.build("qwen3_moe")
    ids = torch.randint(0, 256, (2, 5))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    hooks_before = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    probe = tp.attach(model, window_dir=str(tmp_path), window_steps=100)
    with torch.no_grad():
        during = model(input_ids=ids).logits
    assert not list(tmp_path.iterdir())  # window not due yet
    probe.detach()
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == hooks_before
    torch.testing.assert_close(before, during)
    torch.testing.assert_close(before, after)
    files = sorted(tmp_path.iterdir())
    assert [f.suffix for f in files] == [".json"]  # one window, renamed into place: no .tmp left
    window = Window.from_json(files[0].read_text())
    assert window.steps == 1 and int(window.expert_tokens.sum()) == 2 * 5 * 2 * window.num_layers
    json.loads(files[0].read_text())


def test_cached_generation_counts_each_computed_token_once():
    model = tiny_models.build("mixtral")
    prompt = torch.randint(0, 256, (1, 6))
    windows: list[Window] = []
    probe = tp.attach(model, window_steps=1000, sinks=[windows.append])
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    probe.detach()
    # Prefill computes the prompt, each decode step one new token; the last token is never fed back.
    fed = out[:, :-1]
    expected = tiny_models.recompute(model, "mixtral", [(fed, None)], 8)
    np.testing.assert_array_equal(windows[0].expert_tokens, expected)
    assert windows[0].steps == 4 and list(windows[0].step_tokens) == [6, 1, 1, 1]


def test_attach_refuses_bad_input():
    with pytest.raises(ValueError, match="no MoE router"):
        tp.attach(torch.nn.Linear(2, 2), sinks=[print])
    model = tiny_models.build("olmoe")
    probe = tp.attach(model, sinks=[print])
    with pytest.raises(ValueError, match="already attached"):
        tp.attach(model, sinks=[print])
    tp.detach(model)
    tp.detach(model)  # a second detach is a no-op
    probe.detach()
