"""Merging two partial attention results with the online-softmax rule.

If (out_a, lse_a) is attention of some queries over key set A and (out_b, lse_b)
over a disjoint key set B, then attention over A u B is

    lse = log(exp(lse_a) + exp(lse_b)) = m + log(exp(lse_a - m) + exp(lse_b - m))
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

with m = max(lse_a, lse_b), so no exponent ever exceeds 0.  A side that saw no
key has lse -inf and weight exactly 0; if both did, the result is (0, -inf).
"""

from __future__ import annotations

import torch

__all__ = ["merge_attention"]


def merge_attention(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results over disjoint key sets.

    out_*: (batch, seqlen, heads, head_dim), any float dtype.
    lse_*: (batch, heads, seqlen), float32 or float64, natural log, -inf for empty rows.
    Returns (out, lse): out in the promoted float dtype of the inputs (at least
    float32), lse in the dtype of lse_a.
    """
    if out_a.shape != out_b.shape:
        raise ValueError(f"out_a {tuple(out_a.shape)} and out_b {tuple(out_b.shape)} must have the same shape")
    if lse_a.shape != lse_b.shape:
        raise ValueError(f"lse_a {tuple(lse_a.shape)} and lse_b {tuple(lse_b.shape)} must have the same shape")
    expected = (out_a.shape[0], out_a.shape[2], out_a.shape[1])
    if tuple(lse_a.shape) != expected:
        raise ValueError(f"lse must be (batch, heads, seqlen) = {expected}, got {tuple(lse_a.shape)}")
    acc = torch.promote_types(torch.promote_types(out_a.dtype, out_b.dtype), torch.float32)
    lse_dtype = torch.promote_types(lse_a.dtype, lse_b.dtype)
    lse_a, lse_b = lse_a.to(lse_dtype), lse_b.to(lse_dtype)
    m = torch.maximum(lse_a, lse_b)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # both -inf -> weights 0
    w_a = torch.exp(lse_a - m_safe)
    w_b = torch.exp(lse_b - m_safe)
    total = w_a + w_b
    lse = m_safe + torch.log(total)  # log(0) = -inf when both sides are empty
    inv = torch.where(total > 0, 1.0 / total, torch.zeros_like(total))
    # (B, H, S) -> (B, S, H, 1) to weight (B, S, H, D)
    w_a = (w_a * inv).transpose(1, 2).unsqueeze(-1).to(acc)
    w_b = (w_b * inv).transpose(1, 2).unsqueeze(-1).to(acc)
    out = out_a.to(acc) * w_a + out_b.to(acc) * w_b
    return out, lse.to(lse_a.dtype)
