"""torch's own fused flash-attention kernel for CPUs, as a ringmoe block kernel.

``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` returns the
output and the natural-log lse, and its backward takes them back, so it can
serve as the per-block kernel of ring attention too.  It knows only "no mask"
and top-left causal on its own inputs; other causal offsets are reduced to
those by slicing (see ``_causal_slices``).  Windows and softcap are not
supported here: ``backend="auto"`` then falls back to the blockwise kernel.

float16 and bfloat16 inputs are computed in float32 (like every ringmoe
kernel accumulates): the results are then float32, so partial results that
ring attention adds up are not rounded to half precision block by block.
"""

from __future__ import annotations

import torch

from .blockwise import blockwise_backward, compute_dtype
from .mask import AttentionSpec

__all__ = ["native_forward", "native_backward", "native_unsupported"]


def _causal_slices(spec: AttentionSpec, seqlen_q: int, seqlen_k: int) -> tuple[bool, int, int] | None:
    """Reduce the mask to (top-left causal?, first row that sees keys, keys used), or None.

    Causal row i sees keys j <= i + offset.  If offset >= seqlen_k - 1 every row
    sees every key (no mask).  If offset <= 0, rows below -offset see nothing and
    rows [-offset, Sq) against keys [0, Sq + offset) form a square with plain
    top-left causal masking.  Offsets in between would need two calls; unsupported.
    """
    if not spec.causal:
        return False, 0, seqlen_k
    offset = spec.resolve_offset(seqlen_q, seqlen_k)
    if offset >= seqlen_k - 1:
        return False, 0, seqlen_k
    if offset <= 0 and seqlen_q + offset <= seqlen_k:
        return True, min(seqlen_q, -offset), max(0, seqlen_q + offset)
    return None


def native_unsupported(q: torch.Tensor, k: torch.Tensor, spec: AttentionSpec) -> str | None:
    """Why the native kernel cannot run these inputs, or None if it can."""
    if q.device.type != "cpu":
        return "backend='native' wraps torch's CPU flash-attention kernel; on GPUs use backend='triton'"
    if spec.softcap > 0:
        return "backend='native' does not support softcap"
    if spec.window_left >= 0 or (spec.window_right >= 0 and not spec.causal):
        return "backend='native' does not support sliding windows"
    if _causal_slices(spec, q.shape[1], k.shape[1]) is None:
        return "backend='native' supports causal masks only when seqlen_q >= seqlen_k"
    return None


def _repeat_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    """(B, S, Hkv, D) -> (B, S, Hkv * group, D), head h reading kv head h // group."""
    return x if group == 1 else x.repeat_interleave(group, dim=2)


def native_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, Sq, H, D); k, v (B, Sk, Hkv, D).  Returns out (B, Sq, H, D), lse (B, H, Sq): float32 (float64 for float64)."""
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, kv_heads = k.shape[1], k.shape[2]
    causal, row0, nkeys = _causal_slices(spec, seqlen_q, seqlen_k)
    dtype = compute_dtype(q.dtype)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    out = torch.zeros_like(q)
    lse = torch.full((batch, heads, seqlen_q), float("-inf"), dtype=dtype, device=q.device)
    if row0 < seqlen_q and nkeys > 0:
        group = heads // kv_heads
        qs = q[:, row0:].transpose(1, 2)
        ks = _repeat_kv(k[:, :nkeys], group).transpose(1, 2)
        vs = _repeat_kv(v[:, :nkeys], group).transpose(1, 2)
        o, l = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qs, ks, vs, 0.0, causal, scale=spec.softmax_scale
        )
        out[:, row0:] = o.transpose(1, 2)
        lse[:, :, row0:] = l
    return out, lse


def native_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    spec: AttentionSpec,
    dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients through torch's CPU flash backward, float32 (float64 for float64).

    ``out``/``lse`` may be those of a larger attention.  A gradient on lse is not
    part of torch's kernel; it goes to the blockwise backward.
    """
    if dlse is not None:
        return blockwise_backward(dout, q, k, v, out, lse, spec, dlse)
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    causal, row0, nkeys = _causal_slices(spec, seqlen_q, seqlen_k)
    dtype = lse_dtype = compute_dtype(q.dtype)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    if row0 < seqlen_q and nkeys > 0:

        def heads_first(x):
            return x[:, row0:].to(dtype).transpose(1, 2)

        g_q, g_k, g_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            heads_first(dout),
            heads_first(q),
            _repeat_kv(k[:, :nkeys], group).transpose(1, 2),
            _repeat_kv(v[:, :nkeys], group).transpose(1, 2),
            heads_first(out),
            lse[:, :, row0:].to(lse_dtype).contiguous(),
            0.0,
            causal,
            scale=spec.softmax_scale,
        )
        dq[:, row0:] = g_q.transpose(1, 2)
        # GQA: a kv head's gradient is the sum over the query heads that read it.
        dk[:, :nkeys] = g_k.transpose(1, 2).reshape(batch, nkeys, kv_heads, group, head_dim).sum(3)
        dv[:, :nkeys] = g_v.transpose(1, 2).reshape(batch, nkeys, kv_heads, group, head_dim).sum(3)
    return dq, dk, dv
