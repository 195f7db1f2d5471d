"""Attention of packed new tokens against a paged KV cache (flash-attn's ``block_table`` convention).

k_cache, v_cache: (num_blocks, block_size, kv_heads, head_dim).  Sequence b owns the blocks
``block_table[b, :ceil(cache_seqlens[b] / block_size)]`` in order; its keys are positions
0 .. cache_seqlens[b] - 1 (the new tokens' K/V already written), and its queries are the rows
cu_seqlens_q[b] : cu_seqlens_q[b + 1] of q, the *last* positions of the sequence: the causal mask
is aligned bottom-right, so query i of n sees keys up to cache_seqlens[b] - n + i.
"""

from __future__ import annotations

import torch

from .api import flash_attn_func

__all__ = ["paged_attention"]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: list[int],
                    cache_seqlens: list[int], block_tables: list[list[int]], backend: str = "auto") -> torch.Tensor:
    """q (total_q, heads, head_dim) -> out (total_q, heads, head_dim), causal within each sequence.

    The CPU path gathers each sequence's blocks into contiguous K/V and runs the chosen
    FlashAttention backend on it (the gathered copy is the sequence's context, not N x N).
    """
    block_size = k_cache.shape[1]
    if len(cu_seqlens_q) != len(cache_seqlens) + 1 or len(block_tables) != len(cache_seqlens):
        raise ValueError("cu_seqlens_q must have one more entry than cache_seqlens and block_tables")
    out = torch.empty_like(q)
    for b, context in enumerate(cache_seqlens):
        q0, q1 = cu_seqlens_q[b], cu_seqlens_q[b + 1]
        if q1 == q0:
            continue
        if q1 - q0 > context:
            raise ValueError(f"sequence {b}: {q1 - q0} new tokens but only {context} cached positions")
        blocks = torch.tensor(block_tables[b][: -(-context // block_size)], dtype=torch.long, device=q.device)
        k = k_cache.index_select(0, blocks).flatten(0, 1)[:context]
        v = v_cache.index_select(0, blocks).flatten(0, 1)[:context]
        out[q0:q1] = flash_attn_func(q[None, q0:q1], k[None], v[None], causal=True, backend=backend)[0]
    return out
