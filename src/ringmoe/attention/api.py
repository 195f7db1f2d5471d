"""Public FlashAttention entry points with flash-attn's signatures and layout."""

from __future__ import annotations

import math
from numbers import Integral, Real

import torch

from .kernels import attention_with_kernel, check_backend, resolve_kernel
from .mask import AttentionSpec, default_scale
from .sinks import check_sinks

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "make_spec", "check_qkv"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HEAD_DIM = 256


def make_spec(
    head_dim: int, softmax_scale: float | None, causal: bool, window_size, softcap: float
) -> AttentionSpec:
    """Validate the attention options and resolve them into an AttentionSpec."""
    if softmax_scale is None:
        softmax_scale = default_scale(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, Real) or not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be a finite number or None, got {softmax_scale!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if (
        not isinstance(window_size, (tuple, list))
        or len(window_size) != 2
        or not all(isinstance(w, Integral) and not isinstance(w, bool) for w in window_size)
        or any(w < -1 for w in window_size)
    ):
        raise ValueError(f"window_size must be a pair of ints >= -1 (-1 = unbounded), got {window_size!r}")
    if isinstance(softcap, bool) or not isinstance(softcap, Real) or not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be a finite number >= 0, got {softcap!r}")
    return AttentionSpec(
        softmax_scale=float(softmax_scale),
        causal=causal,
        window_left=int(window_size[0]),
        window_right=int(window_size[1]),
        softcap=float(softcap),
    )


def check_qkv(q, k, v, *, varlen: bool = False) -> None:
    """Raise TypeError/ValueError naming the offending argument.

    Dense: q (batch, seqlen_q, heads, head_dim), k/v (batch, seqlen_k, kv_heads, head_dim).
    Varlen: the same without the batch dimension.
    """
    ndim = 3 if varlen else 4
    layout = "(total, heads, head_dim)" if varlen else "(batch, seqlen, heads, head_dim)"
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != ndim:
            raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(x.shape)}")
        if x.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if not varlen and q.shape[0] != k.shape[0]:
        raise ValueError(f"q batch {q.shape[0]} != k batch {k.shape[0]}")
    heads, head_dim = q.shape[-2], q.shape[-1]
    kv_heads = k.shape[-2]
    if k.shape[-1] != head_dim:
        raise ValueError(f"k head_dim {k.shape[-1]} != q head_dim {head_dim}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    if heads < 1:
        raise ValueError(f"q must have at least one head, got shape {tuple(q.shape)}")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"q heads ({heads}) must be a multiple of k/v heads ({kv_heads}) (GQA/MQA)")


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    backend: str = "auto",
    sinks: torch.Tensor | None = None,
):
    """Exact attention, tiled; flash-attn's ``flash_attn_func`` semantics.

    q (batch, seqlen_q, heads, head_dim); k, v (batch, seqlen_k, kv_heads, head_dim),
    heads % kv_heads == 0; float16/bfloat16/float32/float64 (accumulation in float32,
    float64 stays float64); head_dim <= 256.
    causal and window_size are aligned to the bottom-right corner when seqlen_q != seqlen_k.
    Returns out (batch, seqlen_q, heads, head_dim) in q's dtype, and with
    return_lse=True also lse (batch, heads, seqlen_q): float32 (float64 for
    float64 inputs), natural log, -inf for rows that see no key (their out is 0).
    backend: "auto" | "blockwise" | "triton" | "native" | "reference".
    sinks: optional (heads,) float tensor, gpt-oss's attention sinks: a logit per head that joins the
    softmax's denominator only (see ``sinks.py``); differentiable; the returned lse includes it.
    """
    check_qkv(q, k, v)
    check_sinks(sinks, q.shape[2], q)
    spec = make_spec(q.shape[-1], softmax_scale, causal, window_size, softcap)
    kernel = resolve_kernel(backend, q, k, spec)
    out, lse = attention_with_kernel(q, k, v, kernel, spec, sinks)
    return (out, lse) if return_lse else out


def _check_cu_seqlens(name: str, cu: torch.Tensor, total: int, max_seqlen) -> list[int]:
    if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be a 1-D int32 tensor of batch+1 prefix sums, got {cu!r}")
    bounds = cu.tolist()
    if bounds[0] != 0 or any(b < a for a, b in zip(bounds, bounds[1:])) or bounds[-1] != total:
        raise ValueError(f"{name} must start at 0, never decrease, and end at {total}; got {bounds}")
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    if not isinstance(max_seqlen, Integral) or max_seqlen < longest:
        raise ValueError(f"max_seqlen for {name} must be an int >= the longest sequence ({longest}), got {max_seqlen!r}")
    return bounds


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    backend: str = "auto",
    sinks: torch.Tensor | None = None,
):
    """Attention over a packed batch of variable-length sequences (flash-attn's varlen API).

    q (total_q, heads, head_dim); k, v (total_k, kv_heads, head_dim);
    cu_seqlens_q/k: int32 (batch + 1,) prefix sums; sequence b uses rows
    cu_seqlens_q[b]:cu_seqlens_q[b+1] of q against its own keys, masks aligned
    bottom-right per sequence.  Returns out (total_q, heads, head_dim) and with
    return_lse=True lse (heads, total_q).  sinks: as in ``flash_attn_func``.
    """
    check_qkv(q, k, v, varlen=True)
    check_sinks(sinks, q.shape[1], q)
    bounds_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q)
    bounds_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)
    if len(bounds_q) != len(bounds_k):
        raise ValueError(f"cu_seqlens_q ({len(bounds_q)}) and cu_seqlens_k ({len(bounds_k)}) must have equal length")
    spec = make_spec(q.shape[-1], softmax_scale, causal, window_size, softcap)
    check_backend(backend)
    outs, lses = [], []
    for (q0, q1), (k0, k1) in zip(zip(bounds_q, bounds_q[1:]), zip(bounds_k, bounds_k[1:])):
        qs, ks, vs = q[q0:q1].unsqueeze(0), k[k0:k1].unsqueeze(0), v[k0:k1].unsqueeze(0)
        kernel = resolve_kernel(backend, qs, ks, spec)
        out, lse = attention_with_kernel(qs, ks, vs, kernel, spec, sinks)
        outs.append(out[0])
        lses.append(lse[0])
    out, lse = torch.cat(outs, dim=0), torch.cat(lses, dim=-1)
    return (out, lse) if return_lse else out
