"""Attention sinks (gpt-oss): a learned logit per head that joins the softmax's denominator only.

A sink behaves like one extra key whose score is ``sinks[h]`` for every query of head h and whose
value is zero.  Over the real keys the attention is unchanged up to a factor: with lse the
log-sum-exp of a row's scores and s the sink,

    lse' = log(exp(lse) + exp(s))             (the sink added to the normaliser)
    out' = out * exp(lse - lse')              (out has weight exp(lse - lse') among all "keys")

A row that sees no key has lse = -inf: lse' = s and out' = 0 (never NaN).  Because the sink's value is
zero, the usual flash backward from the *final* (out', lse') is already right for q, k and v: every
probability exp(score - lse') is the true one, and D = rowsum(dout * out') has no sink term.  The
sink's own gradient is its softmax entry times (dlse - D):

    d loss / d s_h = sum over rows of head h of exp(s_h - lse') * (dlse - dout . out')

Kernels, the ring and the decode path compute (out, lse) over their keys as before, add the sink once
with ``add_sinks`` at the very end (never per block or per rank), and in backward call
``sinks_grad`` next to the kernel's backward.
"""

from __future__ import annotations

import torch

__all__ = ["check_sinks", "add_sinks", "sinks_grad"]


def check_sinks(sinks, heads: int, like: torch.Tensor) -> None:
    """TypeError/ValueError naming ``sinks`` unless it is a floating (heads,) tensor on ``like``'s device."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a torch.Tensor of shape (heads,) or None, got {type(sinks).__name__}")
    if not sinks.is_floating_point():
        raise TypeError(f"sinks must be a floating tensor, got {sinks.dtype}")
    if tuple(sinks.shape) != (heads,):
        raise ValueError(f"sinks must have shape ({heads},) (one logit per query head), got {tuple(sinks.shape)}")
    if sinks.device != like.device:
        raise ValueError(f"sinks must be on {like.device}, got {sinks.device}")


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out', lse') with the sink in the normaliser.

    out (batch, seqlen, heads, head_dim), lse (batch, heads, seqlen) float32/float64, sinks (heads,).
    out' keeps out's dtype (computed in lse's precision), lse' lse's dtype.
    """
    s = sinks.detach().to(lse.dtype)[None, :, None]
    total = torch.logaddexp(lse, s)
    keep = torch.exp(lse - total)                                    # 0 where lse = -inf
    scaled = out.to(torch.promote_types(out.dtype, lse.dtype)) * keep.transpose(1, 2).unsqueeze(-1)
    return scaled.to(out.dtype), total


def sinks_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor,
               dlse: torch.Tensor | None = None) -> torch.Tensor:
    """d loss / d sinks (heads,) in sinks' dtype, from the final (out', lse') and the incoming dout, dlse."""
    acc = lse.dtype
    d = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)         # (batch, heads, seqlen)
    if dlse is not None:
        d = d - torch.where(torch.isinf(lse), torch.zeros_like(lse), dlse.to(acc))
    p_sink = torch.exp(sinks.detach().to(acc)[None, :, None] - lse)
    return -(p_sink * d).sum(dim=(0, 2)).to(sinks.dtype)
