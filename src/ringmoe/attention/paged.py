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

__all__ = ["paged_attention", "invariant_causal_attention"]

KEY_TILE = 64


def invariant_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: int = 16) -> torch.Tensor:
    """Causal attention whose every query row is computed the same way whatever the other rows are.

    q (n, heads, D): the last n positions of a sequence whose keys are k, v (ctx, kv_heads, D).
    Keys are taken in fixed tiles of KEY_TILE from position 0, queries in padded tiles of ``rows``,
    every product a batched GEMM of one shape, and the online softmax runs over the key tiles in
    order: a row's result depends only on its own query and the keys it sees, not on how many
    queries share the call or where the chunk starts.  Masked entries add exact zeros.
    """
    n, heads, dim = q.shape
    ctx, kv_heads = k.shape[0], k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    scale = dim**-0.5
    group = heads // kv_heads
    keys = k.to(acc).repeat_interleave(group, dim=1).transpose(0, 1)    # (H, ctx, D)
    values = v.to(acc).repeat_interleave(group, dim=1).transpose(0, 1)
    pad_k = -(-ctx // KEY_TILE) * KEY_TILE - ctx
    keys = torch.nn.functional.pad(keys, (0, 0, 0, pad_k))
    values = torch.nn.functional.pad(values, (0, 0, 0, pad_k))
    out = torch.empty(n, heads, dim, dtype=acc, device=q.device)
    key_pos = torch.arange(keys.shape[1], device=q.device)
    for q0 in range(0, n, rows):
        tile = q[q0:q0 + rows].to(acc).transpose(0, 1)                 # (H, <=rows, D)
        real = tile.shape[1]
        tile = torch.nn.functional.pad(tile, (0, 0, 0, rows - real))
        query_pos = ctx - n + q0 + torch.arange(rows, device=q.device)  # padded rows: later positions
        m = torch.full((heads, rows, 1), float("-inf"), dtype=acc, device=q.device)
        total = torch.zeros(heads, rows, 1, dtype=acc, device=q.device)
        o = torch.zeros(heads, rows, dim, dtype=acc, device=q.device)
        last = min(int(query_pos[real - 1]) + 1, ctx)
        for k0 in range(0, last, KEY_TILE):
            s = torch.bmm(tile, keys[:, k0:k0 + KEY_TILE].transpose(1, 2)) * scale     # (H, rows, KEY_TILE)
            visible = key_pos[k0:k0 + KEY_TILE][None, :] <= query_pos[:, None]
            visible &= key_pos[k0:k0 + KEY_TILE][None, :] < ctx
            s = s.masked_fill(~visible, float("-inf"))
            new_m = torch.maximum(m, s.amax(-1, keepdim=True))
            alpha = torch.exp(m - new_m)
            p = torch.exp(s - new_m)
            total = total * alpha + p.sum(-1, keepdim=True)
            o = o * alpha + torch.bmm(p, values[:, k0:k0 + KEY_TILE])
            m = new_m
        out[q0:q0 + real] = (o / total).transpose(0, 1)[:real]
    return out.to(q.dtype)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: list[int],
                    cache_seqlens: list[int], block_tables: list[list[int]], backend: str = "auto",
                    deterministic: bool = False) -> torch.Tensor:
    """q (total_q, heads, head_dim) -> out (total_q, heads, head_dim), causal within each sequence.

    The CPU path gathers each sequence's blocks into contiguous K/V and runs the chosen
    FlashAttention backend on it (the gathered copy is the sequence's context, not N x N);
    deterministic=True uses ``invariant_causal_attention`` instead.
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
        if deterministic:
            out[q0:q1] = invariant_causal_attention(q[q0:q1], k, v)
        else:
            out[q0:q1] = flash_attn_func(q[None, q0:q1], k[None], v[None], causal=True, backend=backend)[0]
    return out
