"""Shared test helpers: seeded random inputs and the float64 oracle with its gradients."""

from __future__ import annotations

import torch

from ringmoe.attention import AttentionSpec, attention_reference


def random_qkv(seed, batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, dtype=torch.float32, scale=1.0):
    """Seeded normal q (B, Sq, H, D), k, v (B, Sk, Hkv, D) and an upstream gradient dout; never zeros."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads, head_dim, generator=gen, dtype=torch.float64) * scale
    k = torch.randn(batch, seqlen_k, kv_heads, head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, seqlen_k, kv_heads, head_dim, generator=gen, dtype=torch.float64)
    dout = torch.randn(batch, seqlen_q, heads, head_dim, generator=gen, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype), dout.to(dtype)


def reference_with_grads(q, k, v, dout, spec: AttentionSpec, dtype=torch.float64):
    """Oracle (out, lse, dq, dk, dv), computed in ``dtype`` from the given inputs."""
    leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    out, lse = attention_reference(*leaves, spec, compute_dtype=dtype)
    out.backward(dout.to(dtype))
    return out.detach(), lse.detach(), *(x.grad for x in leaves)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max |a - b| in float64, over finite entries of b; 0 for empty tensors."""
    if a.numel() == 0:
        return 0.0
    a, b = a.detach().double(), b.detach().double()
    finite = torch.isfinite(b)
    return (a[finite] - b[finite]).abs().max().item() if finite.any() else 0.0
