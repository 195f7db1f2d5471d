"""One decoder layer: x + Attention(RMSNorm(x)), then h + MLP(RMSNorm(h)); the MLP a MoE block or a dense SwiGLU.

Attention is GQA with RoPE (``Attention``) or DeepSeek's multi-head latent attention (``mla.LatentAttention``);
how it reaches its keys is the ``AttentionBackend`` the layer is given (dense, ring, packed, paged).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..batch_invariant import InvariantLinear
from ..moe import MoELayer
from ..moe.experts import SharedExpert
from .attention_backend import AttentionBackend
from .config import ModelConfig
from .mla import LatentAttention
from .norms import RMSNorm
from .rope import apply_rope

__all__ = ["Attention", "DecoderLayer"]


class Attention(nn.Module):
    """GQA self-attention projections; the attention itself is the ``AttentionBackend`` the model is given.

    Optional, by the config: projection biases, qk-norm per head (Qwen3) or over the whole projection
    (OLMoE), and attention sinks (gpt-oss: ``sinks`` (heads,), taken by the backend through ``attention_options``).
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.q_proj = InvariantLinear(h, self.heads * d, bias=config.qkv_bias)
        self.k_proj = InvariantLinear(h, self.kv_heads * d, bias=config.qkv_bias)
        self.v_proj = InvariantLinear(h, self.kv_heads * d, bias=config.qkv_bias)
        self.o_proj = InvariantLinear(self.heads * d, h, bias=config.o_bias)
        self.full_qk_norm = config.qk_norm_full
        norm_q, norm_k = (self.heads * d, self.kv_heads * d) if config.qk_norm_full else (d, d)
        self.q_norm = RMSNorm(norm_q, config.rms_eps) if config.qk_norm or config.qk_norm_full else None
        self.k_norm = RMSNorm(norm_k, config.rms_eps) if config.qk_norm or config.qk_norm_full else None
        self.sinks = nn.Parameter(torch.zeros(self.heads)) if config.attention_sinks else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionBackend, index: int):
        b, s, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.full_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, s, self.heads, self.head_dim)
        k = k.view(b, s, self.kv_heads, self.head_dim)
        v = v.view(b, s, self.kv_heads, self.head_dim)
        if self.q_norm is not None and not self.full_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attention.attend(index, q, k, v)
        return self.o_proj(out.reshape(b, s, self.heads * self.head_dim))


def _mlp(config: ModelConfig, index: int, ep_group) -> nn.Module:
    """Layer ``index``'s MLP: the MoE block, or a dense SwiGLU on the config's dense layers."""
    if not config.is_moe(index):
        return SharedExpert(config.hidden_size, config.dense_ffn_size)
    return MoELayer(config.hidden_size, config.ffn_size, config.num_experts, config.top_k,
                    router=config.router, normalize_topk=config.normalize_topk,
                    capacity_factor=config.capacity_factor, group=ep_group, overlap_chunks=config.overlap_chunks,
                    shared_ffn_size=config.shared_ffn_size, shared_gated=config.shared_gated,
                    router_bias=config.router_bias, expert_bias=config.expert_bias,
                    swiglu_limit=config.swiglu_limit, swiglu_alpha=config.swiglu_alpha, n_group=config.n_group,
                    topk_group=config.topk_group, routed_scaling_factor=config.routed_scaling_factor)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int, ep_group):
        super().__init__()
        self.index = index
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_eps)
        self.self_attn = LatentAttention(config) if config.mla else Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_eps)
        self.mlp = _mlp(config, index, ep_group)

    @property
    def is_moe(self) -> bool:
        return isinstance(self.mlp, MoELayer)

    def forward(self, x, cos, sin, attention: AttentionBackend):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, attention, self.index)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_static(self, x, cos, sin, attention: AttentionBackend):
        """``forward`` in fixed-shape ops (the MoE block's ``forward_static``): (x, the routing or None)."""
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, attention, self.index)
        if not self.is_moe:
            return h + self.mlp(self.post_attention_layernorm(h)), None
        y, routing = self.mlp.forward_static(self.post_attention_layernorm(h)[0])
        return h + y[None], routing
