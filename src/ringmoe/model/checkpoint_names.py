"""How transformers names a MoE checkpoint's tensors, and ringmoe's names for them.

Routers (``mlp.gate`` / ``block_sparse_moe.gate``) are ringmoe's ``mlp.router``; shared experts (Qwen2-MoE's
``shared_expert`` and its gate, DeepSeek's ``shared_experts``) are ``mlp.shared``; experts come per expert
(``experts.{e}.w1|w2|w3`` or ``gate_proj|up_proj|down_proj``) or fused (``experts.gate_up_proj``,
``experts.down_proj`` and their biases).  DeepSeek-V3's multi-token prediction modules are the checkpoint's layers
past the last (``model.layers.{L}.*`` for L = num_hidden_layers): ringmoe's ``mtp_layers.{L}.*``; their copies of the
embedding and the output head (``embed_tokens``, ``shared_head.head``) are the main model's and are not read.
"""

from __future__ import annotations

import re

import torch

__all__ = ["ROUTER", "EXPERT", "FUSED", "SHARED", "ROLE", "ringmoe_name", "expect_shape", "is_loaded"]

MOE = r"layers\.(\d+)\.(?:mlp|block_sparse_moe)\."
ROUTER = re.compile(MOE + r"gate\.weight$")
EXPERT = re.compile(MOE + r"experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
FUSED = re.compile(MOE + r"experts\.(gate_up_proj|down_proj)(_bias)?$")
SHARED = re.compile(MOE + r"shared_experts?(_gate)?\.")
LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.*)$")
SHARED_COPIES = ("embed_tokens.", "shared_head.head.")
ROLE = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


def is_loaded(name: str, num_layers: int, mtp_layers: int) -> bool:
    """Whether a model of ``num_layers`` layers and ``mtp_layers`` MTP modules reads checkpoint tensor ``name``: not
    the layers past its MTP modules (a checkpoint's MTP layer is read only when asked for), nor the MTP layers'
    copies of the embedding and head."""
    m = LAYER.match(name)
    if m is None or int(m.group(1)) < num_layers:
        return True
    return int(m.group(1)) < num_layers + mtp_layers and not m.group(2).startswith(SHARED_COPIES)


def ringmoe_name(name: str, num_layers: int | None = None) -> str:
    """A checkpoint tensor's name in ringmoe's module tree (routers, shared experts renamed; experts as they are;
    with ``num_layers``, a layer past the last is an MTP module: ``mtp_layers.{index}``)."""
    short = name.removeprefix("model.")
    if (m := ROUTER.search(short)) is not None:
        short = short[:m.start()] + f"layers.{m.group(1)}.mlp.router.weight"
    if SHARED.search(short) is not None:  # Qwen2-MoE's shared expert and its gate, DeepSeek's shared experts
        short = (short.replace("shared_expert_gate.", "shared.gate.").replace("shared_experts.", "shared.")
                 .replace("shared_expert.", "shared."))
    if num_layers is not None and (m := LAYER.match(short)) is not None and int(m.group(1)) >= num_layers:
        short = "mtp_" + short
    return short


def expect_shape(name: str, tensor: torch.Tensor, shape) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the config expects "
                         f"{tuple(shape)}")
