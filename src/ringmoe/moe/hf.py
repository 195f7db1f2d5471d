"""Copying transformers' MoE blocks into MoELayer (weights and routing rule)."""

from __future__ import annotations

import torch

__all__ = ["layer_from_hf"]


def _expert_weights(experts) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up (E, 2F, H), down (E, H, F)) from fused (v5) or per-expert (v4: w1 gate, w3 up, w2 down) experts."""
    if hasattr(experts, "gate_up_proj"):
        return experts.gate_up_proj.detach(), experts.down_proj.detach()
    gate_up, down = [], []
    for expert in experts:
        if hasattr(expert, "w1"):
            gate, up, dn = expert.w1.weight, expert.w3.weight, expert.w2.weight
        else:
            gate, up, dn = expert.gate_proj.weight, expert.up_proj.weight, expert.down_proj.weight
        gate_up.append(torch.cat([gate, up]).detach())
        down.append(dn.detach())
    return torch.stack(gate_up), torch.stack(down)


SUPPORTED = ("MixtralSparseMoeBlock", "Qwen3MoeSparseMoeBlock", "DeepseekV3MoE")


def layer_from_hf(cls, block, capacity_factor):
    name = type(block).__name__
    if name not in SUPPORTED:
        raise ValueError(f"from_hf supports {', '.join(SUPPORTED)}, got {name}")
    gate = block.gate
    router_weight = gate.weight.detach()
    num_experts, hidden = router_weight.shape
    gate_up, down = _expert_weights(block.experts)
    ffn = down.shape[-1]
    if name == "MixtralSparseMoeBlock":
        kwargs = dict(router="softmax_topk", normalize_topk=True)
        top_k = block.top_k
    elif name == "Qwen3MoeSparseMoeBlock":
        kwargs = dict(router="softmax_topk", normalize_topk=bool(gate.norm_topk_prob))
        top_k = gate.top_k
    else:  # DeepseekV3MoE
        shared = block.shared_experts
        kwargs = dict(
            router="sigmoid_bias",
            normalize_topk=bool(gate.norm_topk_prob),
            n_group=gate.num_group if hasattr(gate, "num_group") else gate.n_group,
            topk_group=gate.topk_group,
            routed_scaling_factor=gate.routed_scaling_factor,
            shared_ffn_size=shared.down_proj.weight.shape[1],
        )
        top_k = gate.top_k
    layer = cls(hidden, ffn, num_experts, top_k, capacity_factor=capacity_factor, **kwargs)
    layer = layer.to(dtype=gate_up.dtype, device=gate_up.device)
    with torch.no_grad():
        layer.router.weight.copy_(router_weight)
        layer.experts.gate_up.copy_(gate_up)
        layer.experts.down.copy_(down)
        if name == "DeepseekV3MoE":
            layer.router.correction_bias.copy_(gate.e_score_correction_bias.float())
            for proj in ("gate_proj", "up_proj", "down_proj"):
                getattr(layer.shared, proj).weight.copy_(getattr(block.shared_experts, proj).weight)
    return layer
