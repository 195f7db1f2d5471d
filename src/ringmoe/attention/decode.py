"""Attention for decoding: a few new queries against every cached key, GQA without copying K/V.

With one query per sequence the work is two matrix-vector products per head,
bound by reading the cache.  Query heads are grouped by the K/V head they share
(q viewed as (batch, kv_heads, group * seqlen_q, head_dim)), so each cached key
is read once per K/V head instead of being repeated for every query head.  The
scores (batch, heads, seqlen_q, seqlen_k) are materialised: use this for a
handful of queries, flash_attn_func for long ones.
"""

from __future__ import annotations

import torch

from .api import check_qkv

__all__ = ["decode_attention"]


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     softmax_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked attention of q to all of k, v: (out, lse).

    q (batch, seqlen_q, heads, head_dim); k, v (batch, seqlen_k, kv_heads, head_dim), seqlen_k may be 0.
    out (batch, seqlen_q, heads, head_dim) in q's dtype; lse (batch, heads, seqlen_q) float32
    (float64 for float64 inputs), -inf with out 0 when there is no key.
    """
    check_qkv(q, k, v)
    batch, seqlen_q, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    acc = torch.promote_types(q.dtype, torch.float32)
    # (B, Sq, Hkv, G, D) -> (B, Hkv, G * Sq, D): rows of one K/V head together
    qg = q.to(acc).reshape(batch, seqlen_q, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    qg = qg.reshape(batch, kv_heads, group * seqlen_q, head_dim)
    scores = (qg @ k.to(acc).permute(0, 2, 3, 1)) * scale            # (B, Hkv, G * Sq, Sk)
    lse = torch.logsumexp(scores, dim=-1)                              # -inf for an empty cache
    probs = torch.exp(scores - lse.unsqueeze(-1))
    out = probs @ v.to(acc).permute(0, 2, 1, 3)                        # (B, Hkv, G * Sq, D)
    out = out.reshape(batch, kv_heads, group, seqlen_q, head_dim).permute(0, 3, 1, 2, 4)
    out = out.reshape(batch, seqlen_q, heads, head_dim).to(q.dtype)
    return out, lse.reshape(batch, heads, seqlen_q)
