"""Multi-head latent attention (DeepSeek-V2/V3), expanded form.

Queries: q = W_qb RMSNorm(W_qa x) (or W_q x without q compression), per head [q_nope | q_rope].
Keys and values come from one compressed latent per token: [c | k_rope] = W_kva x, c normalised, then
W_kvb c = per head [k_nope | v]; k_rope (one per token, shared by all heads) carries RoPE.  A head's
key is [k_nope | k_rope] and its score q_nope.k_nope + q_rope.k_rope, scaled by 1/sqrt(nope + rope)
(times YaRN's mscale^2 when the scaling says so).  Here the latent is expanded into per-head K and V
and the ordinary attention paths run (kernels, paged cache, the ring where it is chosen): V is padded with zeros to the key
width so K and V share a shape, and the padding is cut from the output (exact: zero columns of V give
zero columns of the output).

Under context parallelism a backend with ``latent_ring`` carries the latent and the RoPE key around
the ring instead of K and V (``parallel/ring_mla.py``); a backend with ``absorbed`` (the engine's latent
cache) attends in the latent space.

RoPE is DeepSeek's interleaved layout: pairs (x0, x1), (x2, x3)... turn together, so the rope part is
de-interleaved ([even | odd]) and rotated by the usual half-split rule.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..batch_invariant import InvariantLinear, linear
from .config import ModelConfig
from .norms import RMSNorm
from .rope import apply_rope

__all__ = ["LatentAttention", "mla_softmax_factor"]


def mla_softmax_factor(config: ModelConfig) -> float:
    """YaRN's mscale^2 on the softmax scale (DeepSeek: when mscale_all_dim is set), else 1."""
    scaling = dict(config.rope_scaling)
    if scaling.get("rope_type") != "yarn" or not scaling.get("mscale_all_dim"):
        return 1.0
    factor = float(scaling["factor"])
    mscale = 1.0 if factor <= 1 else 0.1 * scaling["mscale_all_dim"] * math.log(factor) + 1.0
    return mscale * mscale


class LatentAttention(nn.Module):
    """MLA with transformers' DeepseekV3Attention names; the backend sees expanded per-head q, k, v (or latents)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        h, heads = config.hidden_size, config.num_heads
        self.heads, self.nope, self.rope = heads, config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.rank, self.interleave = config.v_head_dim, config.kv_lora_rank, config.rope_interleave
        qk = self.nope + self.rope
        if config.q_lora_rank is None:
            self.q_proj = InvariantLinear(h, heads * qk, bias=False)
        else:
            self.q_a_proj = InvariantLinear(h, config.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, 1e-6)
            self.q_b_proj = InvariantLinear(config.q_lora_rank, heads * qk, bias=False)
        self.kv_a_proj_with_mqa = InvariantLinear(h, self.rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6)
        self.kv_b_proj = InvariantLinear(self.rank, heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = InvariantLinear(heads * self.v_dim, h, bias=False)
        self.sinks = None
        # the kernels scale by 1/sqrt(nope + rope); YaRN's extra factor goes on the queries
        self.q_factor = mla_softmax_factor(config)

    def _absorbed(self, q, latent, k_rope, attention, index):
        """Attention in the latent space (serving: the cache holds [c | k_r] per token, one "K/V head").

        q_nope_h . (W_uk,h c) = (W_uk,h^T q_nope_h) . c and sum_t p_t W_uv,h c_t = W_uv,h sum_t p_t c_t, so
        each head's query becomes [W_uk,h^T q_nope_h | q_rope_h] against keys [c | k_r], the values are the
        same vectors (their first kv_lora_rank columns are used), and W_uv,h maps the result out.  The
        kernels scale by 1/sqrt(rank + rope): the queries are rescaled to MLA's 1/sqrt(nope + rope).
        """
        b, s = q.shape[:2]
        w = self.kv_b_proj.weight.view(self.heads, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w[:, :self.nope], w[:, self.nope:]                               # (H, nope, R), (H, v, R)
        # per head, through ``linear`` so that the engine's deterministic mode keeps rows independent
        q_latent = torch.stack([linear(q[:, :, h, :self.nope], w_uk[h].t()) for h in range(self.heads)], dim=2)
        width = self.rank + self.rope
        queries = torch.cat([q_latent, q[..., self.nope:]], dim=-1) * math.sqrt(width / (self.nope + self.rope))
        keys = torch.cat([latent, k_rope[:, :, 0]], dim=-1)[:, :, None]               # (b, s, 1, R + rope)
        out = attention.attend(index, queries, keys, keys)[..., :self.rank]                      # (b, s, H, R)
        out = torch.stack([linear(out[:, :, h], w_uv[h]) for h in range(self.heads)], dim=2)
        return self.o_proj(out.reshape(b, s, self.heads * self.v_dim))

    def _rope(self, x, cos, sin):
        if self.interleave:
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return apply_rope(x, cos, sin)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention, index: int):
        b, s, _ = x.shape
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(b, s, self.heads, self.nope + self.rope)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_rope = self._rope(q[..., self.nope:], cos, sin)
        k_rope = self._rope(k_rope.view(b, s, 1, self.rope), cos, sin)
        q = torch.cat([q[..., :self.nope], q_rope], dim=-1)
        if self.q_factor != 1.0:
            q = q * self.q_factor
        if attention.absorbed:  # the engine's latent cache: K/V never expanded
            return self._absorbed(q, latent, k_rope, attention, index)
        if attention.latent_ring:  # the ring carries (latent, RoPE key) and expands on every rank
            out = attention.attend_latent(index, q, latent, k_rope[:, :, 0], self.kv_b_proj.weight, self.v_dim)
            return self.o_proj(out.reshape(b, s, self.heads * self.v_dim))
        k_nope, v = self.kv_b_proj(latent).view(b, s, self.heads, self.nope + self.v_dim).split(
            [self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(b, s, self.heads, self.rope)], dim=-1)
        v = torch.nn.functional.pad(v, (0, self.nope + self.rope - self.v_dim))
        out = attention.attend(index, q, k, v)[..., :self.v_dim]
        return self.o_proj(out.reshape(b, s, self.heads * self.v_dim))
