"""Paged attention as one fused Triton kernel: packed new tokens against a paged KV cache (forward only).

One program per (query tile, head, sequence).  The program reads its sequence's slice of the
packed queries (cu_seqlens_q), walks the keys 0 .. cache_seqlens[b] - 1 in tiles of BLOCK_N,
finding each key's page through the sequence's row of the block table (flash-attn's
``block_table`` convention: key j lives at k_cache[block_table[b, j // page_size], j % page_size]),
and runs the online softmax in base 2.  Queries are the last positions of the sequence (causal,
bottom-right): query i of n sees keys up to cache_seqlens[b] - n + i.  GQA reads kv head h // group.

An FP8 cache (uint8 e4m3 codes, ``kv_scales``) is decoded tile by tile as the keys are read: the cache is read
at one byte per value and no float copy of it is made.

Runs on CUDA tensors, or on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, for tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..float8_triton import e4m3
from .triton_flash import _dot

__all__ = ["triton_paged_attention"]


@triton.jit
def _paged_forward(Q, KC, VC, O, CU_Q, CTX, TABLES, K_SCALE, V_SCALE,
                   stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_ot, stride_oh, stride_tb,
                   group, scale,
                   PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   HEAD_DIM: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(CU_Q + b)
    n_q = tl.load(CU_Q + b + 1) - q_start
    if start_m < n_q:
        ctx = tl.load(CTX + b)
        offset = ctx - n_q  # absolute position of query row 0
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        q_mask = (offs_m[:, None] < n_q) & (offs_d[None, :] < HEAD_DIM)
        q = tl.load(Q + (q_start + offs_m[:, None]) * stride_qt + h * stride_qh + offs_d[None, :], mask=q_mask,
                    other=0.0)
        kv_head = h // group
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        hi = tl.minimum(ctx, offset + tl.minimum(start_m + BLOCK_M, n_q))  # keys some row of the tile sees
        for start_n in range(0, hi, BLOCK_N):
            cols = start_n + tl.arange(0, BLOCK_N)
            inside = cols < hi
            page = tl.load(TABLES + b * stride_tb + cols // PAGE, mask=inside, other=0)
            rows = page[:, None] * stride_kb + (cols % PAGE)[:, None] * stride_ks + kv_head * stride_kh
            kv_mask = inside[:, None] & (offs_d[None, :] < HEAD_DIM)
            if FP8:  # e4m3 codes x the layer's scales, in q's dtype
                k = (e4m3(tl.load(KC + rows + offs_d[None, :], mask=kv_mask, other=0)) * tl.load(K_SCALE)).to(q.dtype)
                v = (e4m3(tl.load(VC + rows + offs_d[None, :], mask=kv_mask, other=0)) * tl.load(V_SCALE)).to(q.dtype)
            else:
                k = tl.load(KC + rows + offs_d[None, :], mask=kv_mask, other=0.0)
                v = tl.load(VC + rows + offs_d[None, :], mask=kv_mask, other=0.0)
            s = _dot(q, tl.trans(k), IEEE) * (scale * 1.4426950408889634)
            visible = (cols[None, :] <= offs_m[:, None] + offset) & inside[None, :]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(O + (q_start + offs_m[:, None]) * stride_ot + h * stride_oh + offs_d[None, :],
                 out.to(O.dtype.element_ty), mask=q_mask)


def triton_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, cache_seqlens: torch.Tensor, block_table: torch.Tensor,
                           max_seqlen_q: int, kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                           softmax_scale: float | None = None) -> torch.Tensor:
    """q (total_q, heads, D); k_cache, v_cache (num_blocks, page_size, kv_heads, D) in q's dtype, or uint8 e4m3
    codes with kv_scales (k_scale, v_scale) 0-dim float32; cu_seqlens_q (B + 1,) int32; cache_seqlens (B,) int32;
    block_table (B, max_blocks) int32 -> out (total_q, heads, D) in q's dtype."""
    total, heads, dim = q.shape
    kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    q, k_cache, v_cache = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
    block_table = block_table.contiguous()
    out = torch.empty_like(q)
    fp8 = kv_scales is not None
    k_scale, v_scale = (s.float().reshape(1) for s in kv_scales) if fp8 else (out, out)  # unread without FP8
    block_m = 16
    block_n = 16
    grid = (triton.cdiv(max(max_seqlen_q, 1), block_m), heads, cu_seqlens_q.numel() - 1)
    _paged_forward[grid](
        q, k_cache, v_cache, out, cu_seqlens_q, cache_seqlens, block_table, k_scale, v_scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), block_table.stride(0),
        heads // kv_heads, dim**-0.5 if softmax_scale is None else softmax_scale,
        PAGE=page, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(dim)), HEAD_DIM=dim,
        IEEE=q.dtype == torch.float32, FP8=fp8,
    )
    return out
