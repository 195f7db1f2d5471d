"""How transformers names a MoE checkpoint's tensors, and ringmoe's names for them.

Routers (``mlp.gate`` / ``block_sparse_moe.gate``) are ringmoe's ``mlp.router``; shared experts (Qwen2-MoE's
``shared_expert`` and its gate, DeepSeek's ``shared_experts``) are ``mlp.shared``; experts come per expert
(``experts.{e}.w1|w2|w3`` or ``gate_proj|up_proj|down_proj``) or fused (``experts.gate_up_proj``,
``experts.down_proj`` and their biases).
"""

from __future__ import annotations

import re

import torch

__all__ = ["ROUTER", "EXPERT", "FUSED", "SHARED", "ROLE", "ringmoe_name", "expect_shape"]

MOE = r"layers\.(\d+)\.(?:mlp|block_sparse_moe)\."
ROUTER = re.compile(MOE + r"gate\.weight$")
EXPERT = re.compile(MOE + r"experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
FUSED = re.compile(MOE + r"experts\.(gate_up_proj|down_proj)(_bias)?$")
SHARED = re.compile(MOE + r"shared_experts?(_gate)?\.")
ROLE = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


def ringmoe_name(name: str) -> str:
    """A checkpoint tensor's name in ringmoe's module tree (routers, shared experts renamed; experts as they are)."""
    short = name.removeprefix("model.")
    if (m := ROUTER.search(short)) is not None:
        short = f"layers.{m.group(1)}.mlp.router.weight"
    if SHARED.search(short) is not None:  # Qwen2-MoE's shared expert and its gate, DeepSeek's shared experts
        short = (short.replace("shared_expert_gate.", "shared.gate.").replace("shared_experts.", "shared.")
                 .replace("shared_expert.", "shared."))
    return short


def expect_shape(name: str, tensor: torch.Tensor, shape) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the config expects "
                         f"{tuple(shape)}")
