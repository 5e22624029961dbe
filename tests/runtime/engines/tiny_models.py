"""Tiny random-weight Hugging Face MoE models, and routing recomputed from router logits by our own
code (the reference the engine adapters are checked against)."""

from __future__ import annotations

import numpy as np
import torch
import transformers

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)

# arch -> (config class name, extra config, selection rule)
ARCHS = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2), "softmax"),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=32, decoder_sparse_step=1,
                                         mlp_only_layers=[]), "softmax"),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                         decoder_sparse_step=1, mlp_only_layers=[], head_dim=16), "softmax"),
    "olmoe": ("OlmoeConfig", dict(num_experts=8, num_experts_per_tok=2), "softmax"),
    "deepseek_v3": ("DeepseekV3Config", dict(num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                                             first_k_dense_replace=1, moe_intermediate_size=32, n_shared_experts=1,
                                             kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                                             qk_nope_head_dim=8, v_head_dim=16), "grouped"),
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=8, num_experts_per_tok=2, head_dim=16,
                                     layer_types=["full_attention"] * 3, sliding_window=16), "logits"),
}
AVAILABLE = [arch for arch, (cls, _, _) in ARCHS.items() if hasattr(transformers, cls)]


def build(arch: str, seed: int = 0) -> torch.nn.Module:
    cls_name, extra, _ = ARCHS[arch]
    config = getattr(transformers, cls_name)(**{**COMMON, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # routers start at zero weights in some classes: give them real choices
        for name, param in model.named_parameters():
            if name.endswith((".gate.weight", ".router.weight", ".router.bias")):
                param.normal_(0.0, 1.0)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.1)
    return model.eval()


def select(rule: str, logits: torch.Tensor, top_k: int, router: torch.nn.Module) -> torch.Tensor:
    """[N, k] expert ids from router logits [N, E], by the model family's published rule."""
    logits = logits.float()
    if rule in ("softmax", "logits"):  # softmax is monotone: its top-k are the logits' top-k
        return torch.topk(logits, top_k, dim=-1).indices
    scores = logits.sigmoid() + router.e_score_correction_bias.float()
    groups = router.num_group
    per_group = scores.view(scores.shape[0], groups, -1)
    group_score = per_group.topk(2, dim=-1).values.sum(-1)
    keep = torch.zeros_like(group_score, dtype=torch.bool)
    keep.scatter_(1, group_score.topk(router.topk_group, dim=-1).indices, True)
    masked = per_group.masked_fill(~keep[..., None], float("-inf")).view(scores.shape[0], -1)
    return masked.topk(top_k, dim=-1).indices


def router_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for _, m in model.named_modules() if type(m).__name__.lower().endswith("topkrouter")]


def recompute(model: torch.nn.Module, arch: str, batches, num_experts: int) -> np.ndarray:
    """[L, E] pairs per MoE layer and expert over `batches` of (input_ids [B, S], mask [B, S] or None),
    from the router logits that each router produced (padding left out)."""
    rule = ARCHS[arch][2]
    routers = router_modules(model)
    logits: dict[int, torch.Tensor] = {}
    hooks = [r.register_forward_hook(lambda m, a, out, i=i: logits.__setitem__(i, out[0].detach()))
             for i, r in enumerate(routers)]
    counts = np.zeros((len(routers), num_experts), dtype=np.int64)
    try:
        with torch.no_grad():
            for ids, mask in batches:
                model(input_ids=ids, attention_mask=mask)
                keep = torch.ones(ids.numel(), dtype=torch.bool) if mask is None else mask.reshape(-1).bool()
                for i, r in enumerate(routers):
                    chosen = select(rule, logits[i].reshape(ids.numel(), -1), r.top_k, r)[keep]
                    counts[i] += np.bincount(chosen.reshape(-1).numpy(), minlength=num_experts)
    finally:
        for h in hooks:
            h.remove()
    return counts
