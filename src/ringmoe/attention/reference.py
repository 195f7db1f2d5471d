"""The naive oracle: attention with the full score matrix, in float64.

Every kernel in ringmoe is tested against this function.  It materialises the
(seqlen_q, seqlen_k) score matrix per head, so it is for tests and small inputs.
It is differentiable through plain autograd.
"""

from __future__ import annotations

import torch

from .mask import AttentionSpec

__all__ = ["attention_reference"]


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: AttentionSpec,
    compute_dtype: torch.dtype = torch.float64,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Naive attention.

    q (batch, seqlen_q, heads, head_dim); k, v (batch, seqlen_k, kv_heads, head_dim).
    Returns out (batch, seqlen_q, heads, head_dim) and lse (batch, heads, seqlen_q),
    both in ``compute_dtype``.  Rows that see no key give out 0 and lse -inf.
    sinks (heads,): one more score column per head, always visible, whose value is zero.
    """
    if sinks is not None:
        return _with_sink_column(q, k, v, spec, compute_dtype, sinks)
    batch, seqlen_q, heads, _ = q.shape
    seqlen_k = k.shape[1]
    if seqlen_k == 0:  # no keys at all: every row sees none
        # a sum over an empty slice: zeros that stay in q's graph (its gradient is zero, never NaN)
        out = q.to(compute_dtype)[..., :0].sum(-1, keepdim=True).expand(batch, seqlen_q, heads, v.shape[-1])
        lse = torch.full((batch, heads, seqlen_q), float("-inf"), dtype=compute_dtype, device=q.device)
        return out, lse
    scores, vh = _masked_scores(q, k, v, spec, compute_dtype)
    # Softmax by hand so empty rows (all -inf) give out 0, lse -inf and finite gradients.
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    weights = torch.exp(scores - row_max)
    total = weights.sum(dim=-1, keepdim=True)
    seen = total > 0
    total_safe = torch.where(seen, total, torch.ones_like(total))
    probs = weights / total_safe
    lse = torch.where(seen, row_max + torch.log(total_safe), torch.full_like(total, float("-inf")))
    out = torch.matmul(probs, vh).transpose(1, 2)
    return out, lse.squeeze(-1)


def _masked_scores(q, k, v, spec, compute_dtype):
    """Scores (B, H, Sq, Sk) after scale, softcap and mask (-inf where hidden), and V per query head (B, H, Sk, D)."""
    seqlen_q, heads, seqlen_k, kv_heads = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
    group = heads // kv_heads
    qh = q.to(compute_dtype).transpose(1, 2)  # (B, H, Sq, D)
    kh = k.to(compute_dtype).transpose(1, 2).repeat_interleave(group, dim=1)
    vh = v.to(compute_dtype).transpose(1, 2).repeat_interleave(group, dim=1)
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * spec.softmax_scale
    if spec.softcap > 0:
        scores = spec.softcap * torch.tanh(scores / spec.softcap)
    if spec.is_masked:
        visible = spec.tile_mask(0, seqlen_q, 0, seqlen_k, seqlen_q, seqlen_k, q.device)
        scores = scores.masked_fill(~visible, float("-inf"))
    return scores, vh


def _with_sink_column(q, k, v, spec, compute_dtype, sinks):
    """The sink as a real key: a score column of sinks[h] and a zero value row, then plain softmax."""
    batch, seqlen_q, heads, _ = q.shape
    scores, vh = _masked_scores(q, k, v, spec, compute_dtype)
    sink = sinks.to(compute_dtype)[None, :, None, None].expand(batch, heads, seqlen_q, 1)
    scores = torch.cat([scores, sink], dim=-1)
    values = torch.cat([vh, torch.zeros_like(vh[:, :, :1])], dim=2)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.softmax(scores, dim=-1), values).transpose(1, 2)
    return out, lse
