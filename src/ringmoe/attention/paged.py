"""Attention of packed new tokens against a paged KV cache (flash-attn's ``block_table`` convention).

k_cache, v_cache: (num_blocks, block_size, kv_heads, head_dim), in the model's dtype, or uint8 e4m3 codes (the FP8
KV cache: ``kv_scales`` = (k_scale, v_scale), 0-dim float32 tensors, and a cached value is code x scale; blocks are
decoded as they are gathered, so only the keys a call reads exist in floats).  Sequence b owns the blocks
``block_table[b, :ceil(cache_seqlens[b] / block_size)]`` in order; its keys are positions
0 .. cache_seqlens[b] - 1 (the new tokens' K/V already written), and its queries are the rows
cu_seqlens_q[b] : cu_seqlens_q[b + 1] of q, the *last* positions of the sequence: the causal mask
is aligned bottom-right, so query i of n sees keys up to cache_seqlens[b] - n + i.
"""

from __future__ import annotations

import importlib.util

import torch

from ..float8 import decode_e4m3
from .api import flash_attn_func
from .paged_cpu import applies as _kernel_applies, native as _kernel_native, paged_cached_attention
from .sinks import add_sinks

__all__ = ["paged_attention", "paged_decode", "invariant_causal_attention", "read_cache"]

KEY_TILE = 128


def read_cache(cache: torch.Tensor, index: torch.Tensor, scale: torch.Tensor | None,
               dtype: torch.dtype) -> torch.Tensor:
    """Blocks ``index`` of a cache (num_blocks, block_size, heads, D) -> (len(index), block_size, heads, D) in
    ``dtype``: decoded from e4m3 codes with ``scale`` when the cache holds them (scale not None)."""
    blocks = cache.index_select(0, index)
    return blocks.to(dtype) if scale is None else decode_e4m3(blocks, scale, dtype)


def invariant_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: int = 16,
                               window_left: int = -1, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention whose every query row is computed the same way whatever the other rows are.

    q (n, heads, D): the last n positions of a sequence whose keys are k, v (ctx, kv_heads, D).
    Queries are cut into padded tiles of ``rows`` and keys into tiles of KEY_TILE from position 0;
    each key tile meets every query tile in one batched GEMM whose items all have one shape, and the
    online softmax runs over the key tiles in order.  A row's result so depends only on its own query
    and the keys it sees, not on how many queries share the call or where the chunk starts: key
    tiles past a row's position are masked whole and add exact zeros (the running max is already
    finite from key 0, so the rescale factor is exp(0) = 1).  With a sliding window (``window_left``:
    a row sees keys down to its position - window_left) the tiles before a row's window leave its
    running max at -inf and its sums at exact zeros, so the same holds.  ``sinks`` (heads,) join the
    normaliser at the end.
    """
    n, heads, dim = q.shape
    ctx, kv_heads = k.shape[0], k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    group = heads // kv_heads
    tiles = -(-n // rows)
    pad_q, pad_k = tiles * rows - n, -(-ctx // KEY_TILE) * KEY_TILE - ctx
    queries = torch.nn.functional.pad(q.to(acc), (0, 0, 0, 0, 0, pad_q))            # (tiles * rows, H, D)
    queries = queries.view(tiles, rows, heads, dim).transpose(1, 2).contiguous()     # (tiles, H, rows, D)
    keys = torch.nn.functional.pad(k.to(acc).repeat_interleave(group, dim=1), (0, 0, 0, 0, 0, pad_k))
    values = torch.nn.functional.pad(v.to(acc).repeat_interleave(group, dim=1), (0, 0, 0, 0, 0, pad_k))
    keys, values = keys.permute(1, 2, 0)[None], values.transpose(0, 1)[None]           # (1, H, D, K), (1, H, K, D)
    first_pos = ctx - n                                                                # position of query row 0
    query_pos = (first_pos + torch.arange(tiles * rows, device=q.device)).view(tiles, 1, rows, 1)
    m = torch.full((tiles, heads, rows, 1), float("-inf"), dtype=acc, device=q.device)
    total = torch.zeros(tiles, heads, rows, 1, dtype=acc, device=q.device)
    out = torch.zeros(tiles, heads, rows, dim, dtype=acc, device=q.device)
    scale = dim**-0.5
    for k0 in range(0, ctx, KEY_TILE):
        # query tiles that end before this key tile see none of it: skipping them is exact (see above)
        t0 = max(0, (k0 - first_pos) // rows)
        key_pos = k0 + torch.arange(KEY_TILE, device=q.device)
        s = torch.matmul(queries[t0:], keys[..., k0:k0 + KEY_TILE]) * scale            # (tiles - t0, H, rows, K)
        visible = (key_pos <= query_pos[t0:]) & (key_pos < ctx)
        if window_left >= 0:
            visible &= key_pos >= query_pos[t0:] - window_left
        s = s.masked_fill(~visible, float("-inf"))
        new_m = torch.maximum(m[t0:], s.amax(-1, keepdim=True))
        new_m = torch.where(torch.isinf(new_m), torch.zeros_like(new_m), new_m)  # rows that saw no key yet
        alpha = torch.exp(m[t0:] - new_m)
        p = torch.exp(s - new_m)
        total[t0:] = total[t0:] * alpha + p.sum(-1, keepdim=True)
        out[t0:] = out[t0:] * alpha + torch.matmul(p, values[:, :, k0:k0 + KEY_TILE])
        m[t0:] = new_m
    if sinks is not None:  # the sink's exp(s - m) joins the denominator only
        total = total + torch.exp(sinks.to(acc)[None, :, None, None] - m)
    out = (out / total).transpose(1, 2).reshape(tiles * rows, heads, dim)
    return out[:n].to(q.dtype)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: list[int],
                    cache_seqlens: list[int], block_tables: list[list[int]], backend: str = "auto",
                    deterministic: bool | list[bool] = False, window_size: tuple[int, int] = (-1, -1),
                    sinks: torch.Tensor | None = None, batch_decodes: bool = True,
                    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q (total_q, heads, head_dim) -> out (total_q, heads, head_dim), causal within each sequence.

    backend "triton" (or "auto" on CUDA) runs the fused paged kernel (``triton_paged``), which reads
    the pages in place.  Otherwise each sequence's blocks are gathered into contiguous K/V and the
    chosen FlashAttention backend runs on them (the gathered copy is the sequence's context, not
    N x N); deterministic=True (or True for a sequence in a list) uses ``invariant_causal_attention``.
    window_size (flash-attn's, causal: (left, 0)) and sinks (heads,): as ``flash_attn_func`` (the fused
    kernel has neither: the gathered path runs them).  Sequences with one new token (decoding) run
    together, grouped by context length (``_buckets``); ``batch_decodes=False`` runs each alone, so its arithmetic
    never depends on the others (the engine's deterministic mode).  kv_scales: the FP8 cache's scales (see the
    module's docstring).
    """
    block_size = k_cache.shape[1]
    if len(cu_seqlens_q) != len(cache_seqlens) + 1 or len(block_tables) != len(cache_seqlens):
        raise ValueError("cu_seqlens_q must have one more entry than cache_seqlens and block_tables")
    fixed = deterministic if isinstance(deterministic, list) else [deterministic] * len(cache_seqlens)
    plain = window_size == (-1, -1) and sinks is None
    if not any(fixed) and plain and _use_triton(backend, q):
        return _triton(q, k_cache, v_cache, cu_seqlens_q, cache_seqlens, block_tables, kv_scales)
    out = torch.empty_like(q)
    singles = [b for b, context in enumerate(cache_seqlens)
               if cu_seqlens_q[b + 1] - cu_seqlens_q[b] == 1 and not fixed[b]]
    for group in (_buckets(singles, cache_seqlens, block_size) if batch_decodes else [[b] for b in singles]):
        rows = [cu_seqlens_q[b] for b in group]  # one new token per sequence (decoding)
        out[rows] = _decode_batch(q[rows], k_cache, v_cache, [cache_seqlens[b] for b in group],
                                  [block_tables[b] for b in group], window_size[0], sinks, kv_scales)
    done = set(singles)
    for b, context in enumerate(cache_seqlens):
        q0, q1 = cu_seqlens_q[b], cu_seqlens_q[b + 1]
        if q1 == q0 or b in done:
            continue
        if q1 - q0 > context:
            raise ValueError(f"sequence {b}: {q1 - q0} new tokens but only {context} cached positions")
        # entries given back under a sliding window (-1) read block 0 instead: those keys are masked
        blocks = torch.tensor(block_tables[b][: -(-context // block_size)], dtype=torch.long, device=q.device)
        blocks = blocks.clamp(min=0)
        k_scale, v_scale = kv_scales or (None, None)
        k = read_cache(k_cache, blocks, k_scale, q.dtype).flatten(0, 1)[:context]
        v = read_cache(v_cache, blocks, v_scale, q.dtype).flatten(0, 1)[:context]
        if min(block_tables[b][: -(-context // block_size)], default=0) < 0:  # stale block 0 under a window:
            given_back = torch.tensor(block_tables[b][: -(-context // block_size)], device=q.device) < 0
            v = v.masked_fill(given_back.repeat_interleave(block_size)[:context, None, None], 0.0)  # zero, not NaN
        if fixed[b]:
            out[q0:q1] = invariant_causal_attention(q[q0:q1], k, v, window_left=window_size[0], sinks=sinks)
        else:
            out[q0:q1] = flash_attn_func(q[None, q0:q1], k[None], v[None], causal=True, backend=backend,
                                         window_size=window_size, sinks=sinks)[0]
    return out


def _buckets(singles: list[int], contexts: list[int], block_size: int, slack: float = 1.25) -> list[list[int]]:
    """Decoding sequences grouped by context length, so that padding a group to its longest context
    wastes at most ``slack`` - 1 of its work (plus a block): one call per group instead of per sequence."""
    groups: list[list[int]] = []
    for b in sorted(singles, key=lambda b: contexts[b]):
        if groups and contexts[b] <= slack * contexts[groups[-1][0]] + block_size:
            groups[-1].append(b)
        else:
            groups.append([b])
    return groups


def _decode_batch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, contexts: list[int],
                  tables: list[list[int]], window_left: int, sinks: torch.Tensor | None,
                  kv_scales: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """q (n, heads, D), each row the last position of its sequence -> out (n, heads, D): the rows' blocks
    gathered in one index_select, padded with block 0 (``paged_decode``)."""
    block_size = k_cache.shape[1]
    width = max(-(-c // block_size) for c in contexts)
    index = torch.zeros(len(contexts), width, dtype=torch.long)
    for row, (context, table) in enumerate(zip(contexts, tables)):
        used = table[: -(-context // block_size)]
        index[row, :len(used)] = torch.tensor(used, dtype=torch.long).clamp(min=0)
    # one row alone: exactly its context, so its arithmetic depends on nothing but its own keys
    length = contexts[0] if len(contexts) == 1 else width * block_size
    return paged_decode(q, k_cache, v_cache, index.to(q.device), torch.tensor(contexts, device=q.device), length,
                        window_left, sinks, kv_scales=kv_scales)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 contexts: torch.Tensor, length: int, window_left: int = -1, sinks: torch.Tensor | None = None,
                 new: tuple[torch.Tensor, torch.Tensor] | None = None,
                 kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                 fresh: torch.Tensor | None = None, by_block: bool = False, cached: torch.Tensor | None = None,
                 first: torch.Tensor | None = None, return_lse: bool = False, causal: bool = False):
    """New tokens against a paged cache, one query row each, in fixed-shape tensor ops (no host work: what the
    compiled decode step runs).

    q (n, heads, D): row r is position contexts[r] - 1 of its sequence; tables (n, width) int64 block ids
    (entries past a row's context: any valid block); contexts (n,) int64 keys per row, its own included
    (>= 1); length <= width * block_size: the keys read per row.  -> out (n, heads, D) in q's dtype.  Keys
    past a row's context, and before its window, are masked; K/V heads are shared without copies.

    ``new``: every row's K and V (n, kv_heads, D), not in the cache yet (the caller writes them after this
    read).  ``fresh`` (n, band) bool: fresh[r, j] says row r sees the new key of row r - j (j = 0: its own,
    always; default: its own only, band 1); they are the last positions of r's context, so r reads contexts[r] -
    fresh[r].sum() keys from the cache.  Several rows of one sequence (a token and its speculative drafts,
    consecutive positions and rows) so see each other causally: row j of a group sees the group's rows 0 .. j.
    Each row gathers only its band of new keys: no product mixes rows it does not see (a NaN in one request's
    K/V never reaches another's output).  The cached keys are attended as above and the new ones join by the
    online-softmax merge: with c = logsumexp of the cached scores and f that of the new keys' scores,
    lse = logaddexp(c, f), out = exp(c - lse) out_cached + exp(f - lse) out_new (exact; a row with no cached
    key has c = -inf).  In a compiled graph this keeps the gather of the cache apart from the write into it
    (a read after a compiled write searches the written slots for every key).
    With an FP8 cache (``kv_scales``) ``new`` is given as the caller will store it (its e4m3 round trip), so the
    row sees the same own key as a later step reading it from the cache.
    ``by_block`` (length a multiple of block_size; what the compiled step runs): the cached keys of two rows or more
    attended by ``paged_cpu``'s C kernel where it applies (a float32 query and cache on a CPU with the kernel
    library: each row's keys read where they lie, with the online softmax), else in tensor ops with the softmax's
    sum taken per block, then over the blocks (``_logsumexp_by_block``); otherwise one sum over the keys, whose bits
    the deterministic mode's kernels share.

    A cp rank's part of the attention (``cached`` and ``first`` given): the cache holds only the positions this rank
    keeps, so a row's cached keys are not its context minus its new keys; cached (n,) int64 says how many of the
    rank's cached keys a row reads, first (n,) int64 the first of them inside its window (0 without one), and
    ``fresh`` marks only the new keys this rank keeps (a row may see none: its part then has lse -inf and output
    0, never NaN); ``contexts`` stays each row's position + 1 (the window of the new keys).  ``return_lse``: (out,
    lse (n, heads) in the accumulation dtype), before ``sinks`` (added once the ranks' parts are merged).

    ``causal`` (with ``new``, ``fresh`` None, one process): the rows are consecutive positions of one sequence (a
    prompt chunk): row r sees the new keys of rows 0 .. r (inside its window) and the same cached keys as row 0,
    contexts[0] - 1 of them.  The new keys' part is then one product of the rows by all of them, (n, n) scores a
    head, masked causally: no gathered copy of a band per row (a chunk of n rows would gather n^2 keys).
    """
    n, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    acc = torch.promote_types(q.dtype, torch.float32)
    if causal and (new is None or fresh is not None or cached is not None):
        raise ValueError("paged_decode: causal takes the rows' new keys (new) and neither fresh nor cached")
    if new is not None and fresh is None and not causal:
        fresh = torch.ones(n, 1, dtype=torch.bool, device=q.device)
    partial = cached is not None  # a cp rank's part: a row may see no key at all here
    if cached is None:  # keys to read from the cache (causal: row r's new keys are its r + 1 last ones)
        cached = contexts - (0 if new is None else torch.arange(1, n + 1, device=q.device) if causal
                             else fresh.sum(1))
    if first is None:  # the first cached key inside the row's window
        first = (contexts - 1 - window_left).clamp(min=0) if window_left >= 0 else torch.zeros_like(contexts)
    cached = cached[:, None]
    group = heads // kv_heads
    scale = dim**-0.5
    qg = q.to(acc).view(n, kv_heads, group, dim)                                         # rows of one K/V head
    if by_block and kv_scales is None and (n > 1 or _kernel_native()) and _kernel_applies(q, k_cache, v_cache):
        # the C kernel reads each row's visible keys where they lie (``paged_cpu``): no gathered copy.  For a single
        # row (a compiled graph of its own) only where the kernel is registered from C (``paged_cpu.native``): a
        # call through the dispatcher into a Python kernel (~25 us a layer) cost more than the gather it saves (a
        # batch-1 step 0.91x, ``decode.json``); without Python, in one process the small preset's batch-1 step
        # 1.09-1.21x faster than with the gather
        out, lse = paged_cached_attention(q, k_cache, v_cache, tables, first, cached[:, 0].clamp(max=length), scale)
        out, lse = out.view(n, kv_heads, group, dim), lse.view(n, kv_heads, group)
    else:
        out, lse = _cached_part(qg, k_cache, v_cache, tables, first, cached, length, kv_scales, by_block, scale)
    if causal:
        new_out, new_lse = _causal_new_part(qg, new, contexts, window_left, scale)
        merged = torch.logaddexp(lse, new_lse)  # finite: every row sees its own key
        out = out * torch.exp(lse - merged)[..., None] + new_out * torch.exp(new_lse - merged)[..., None]
        lse = merged
    elif new is not None:
        band = fresh.shape[1]
        source = (torch.arange(n, device=q.device)[:, None] - torch.arange(band, device=q.device)).clamp(min=0)
        seen = fresh  # row s's new key sits at contexts[s] - 1, inside row r's window when >= contexts[r] - 1 - left
        if window_left >= 0:
            seen = seen & (contexts[source] >= contexts[:, None] - window_left)
        new_k = new[0].to(acc)[source]                                                    # (n, band, Hkv, D)
        new_v = new[1].to(acc)[source].masked_fill(~seen[:, :, None, None], 0.0)        # unseen: 0, not 0 * NaN
        # products of a few keys written as multiply-and-sum: compiled, they fuse into the kernels around them,
        # where an einsum is a batched GEMM call per product (at band 5 ~10 us each, two per layer)
        new_k, new_v = new_k.transpose(1, 2)[:, :, None], new_v.transpose(1, 2)[:, :, None]  # (n, Hkv, 1, band, D)
        new_scores = (qg[:, :, :, None, :] * new_k).sum(-1) * scale                        # (n, Hkv, G, band)
        new_scores = new_scores.masked_fill(~seen[:, None, None, :], float("-inf"))
        new_lse = torch.logsumexp(new_scores, dim=-1)  # finite where a row sees its own key (always, but on a cp rank)
        merged = torch.logaddexp(lse, new_lse)
        # what each side's scores are shifted by; on a cp rank a row may see no key here: -inf read as 0 (weights 0,
        # not NaN)
        new_shift, shift = (_finite(new_lse), _finite(merged)) if partial else (new_lse, merged)
        new_out = (torch.exp(new_scores - new_shift[..., None])[..., None] * new_v).sum(-2)  # (n, Hkv, G, D)
        out = out * torch.exp(lse - shift)[..., None] + new_out * torch.exp(new_lse - shift)[..., None]
        lse = merged
    out = out.reshape(n, heads, dim)
    if return_lse:
        return out.to(q.dtype), lse.reshape(n, heads)
    if sinks is not None:
        out, _ = add_sinks(out[None], lse.reshape(n, heads).T[None], sinks)
        out = out[0]
    return out.to(q.dtype)


def _causal_new_part(qg: torch.Tensor, new: tuple[torch.Tensor, torch.Tensor], contexts: torch.Tensor,
                     window_left: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``paged_decode``'s causal rows against their own new keys: qg (n, kv_heads, G, D) in the accumulation dtype,
    new = (K, V) (n, kv_heads, D) -> out (n, kv_heads, G, D), lse (n, kv_heads, G).  Row r sees row c's key for
    c <= r (and, under a window, contexts[c] >= contexts[r] - window_left).  Without a window: torch's CPU flash
    kernel (its causal tiles skip the keys past a row), which returns the lse too; on other devices and with a
    window: the (n, n) scores of every head, masked.  The rows are one sequence's: a value of a key a row does not
    see may still enter its product by a zero weight, so the sequence's own NaN can reach only its own rows."""
    n, kv_heads, group, dim = qg.shape
    acc = qg.dtype
    keys, values = (x.to(acc).transpose(0, 1)[:, None] for x in new)                    # (Hkv, 1, n, D)
    queries = qg.permute(1, 2, 0, 3)                                                     # (Hkv, G, n, D)
    if window_left < 0 and qg.device.type == "cpu":
        # (K/V heads shared by a view; the kernel reads them as (1, heads, n, D))
        keys, values = (x.expand(-1, group, -1, -1).reshape(1, kv_heads * group, n, dim) for x in (keys, values))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            queries.reshape(1, kv_heads * group, n, dim), keys, values, 0.0, True, scale=scale)[:2]
        out, lse = out.view(kv_heads, group, n, dim), lse.view(kv_heads, group, n)
    else:
        scores = torch.matmul(queries, keys.transpose(2, 3)) * scale                     # (Hkv, G, n, n)
        seen = contexts[None, :] <= contexts[:, None]                                    # (n, n): key c, row r
        if window_left >= 0:
            seen = seen & (contexts[None, :] >= contexts[:, None] - window_left)
        scores = torch.where(seen, scores, float("-inf"))
        peak = scores.amax(-1, keepdim=True)  # finite: a row sees its own key
        weights = torch.exp(scores - peak)
        total = weights.sum(-1, keepdim=True)
        out = torch.matmul(weights, values) / total                                      # (Hkv, G, n, D)
        lse = (peak + torch.log(total))[..., 0]
    return out.permute(2, 0, 1, 3), lse.permute(2, 0, 1)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf read as 0: what is subtracted from the scores of a row that sees no key (exp gives 0, not NaN)."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _cached_part(qg, k_cache, v_cache, tables, first, cached, length, kv_scales, by_block, scale):
    """``paged_decode``'s attention over the cached keys in tensor ops: qg (n, kv_heads, G, D) in the accumulation
    dtype -> out (n, kv_heads, G, D), lse (n, kv_heads, G) (-inf and a zero output for a row that sees no key)."""
    n, kv_heads, _, dim = qg.shape
    width, block_size = tables.shape[1], k_cache.shape[1]
    acc = qg.dtype
    flat = tables.reshape(-1)
    k_scale, v_scale = kv_scales or (None, None)
    keys = read_cache(k_cache, flat, k_scale, acc).view(n, width * block_size, kv_heads, dim)[:, :length]
    values = read_cache(v_cache, flat, v_scale, acc).view(n, width * block_size, kv_heads, dim)[:, :length]
    position = torch.arange(length, device=qg.device)
    visible = (position[None] < cached) & (position[None] >= first[:, None])
    # slots past a row's context hold whatever their block held before (another request's K/V, padding): a
    # zero weight times a stale NaN is NaN, so those values are zeroed, not only their scores masked
    values = values.masked_fill(~visible[:, :, None, None], 0.0)
    # keys and values head-major with whole rows of D (the gather copies contiguous rows; the products read
    # the keys transposed in place)
    keys, values = keys.transpose(1, 2).contiguous(), values.transpose(1, 2).contiguous()  # (n, Hkv, K, D)
    scores = torch.matmul(qg, keys.transpose(2, 3)) * scale                              # (n, Hkv, G, K)
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    lse = (_logsumexp_by_block(scores, block_size) if by_block
           else torch.logsumexp(scores, dim=-1))                                         # (n, Hkv, G)
    # a row with no key: weights 0, not NaN
    return torch.matmul(torch.exp(scores - _finite(lse)[..., None]), values), lse       # (n, Hkv, G, D)


def _logsumexp_by_block(scores: torch.Tensor, block_size: int) -> torch.Tensor:
    """logsumexp over the last dim of scores (..., K), K a multiple of block_size, -inf for a row of -inf: the sum
    of exponentials taken within each block first, then over the blocks.  Compiled, each sum is its own reduction,
    the longer one over K / block_size terms: inductor compiles a float32 sum of more than 4096 terms in another
    form and guards the graph on the length, so a single sum over the keys would make contexts past 4096 keys
    a second graph (here: past 4096 blocks)."""
    peak = _finite(scores.amax(-1, keepdim=True))
    blocks = torch.exp(scores - peak).unflatten(-1, (-1, block_size)).sum(-1)
    return torch.log(blocks.sum(-1)) + peak[..., 0]


def _use_triton(backend: str, q: torch.Tensor) -> bool:
    """auto: on CUDA when Triton is installed; "triton": always, or ValueError saying why it cannot run."""
    if backend == "auto":
        return (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
                and importlib.util.find_spec("triton") is not None)
    if backend != "triton":
        return False
    try:
        from . import triton_flash
    except ImportError as error:
        raise ValueError(f"backend='triton' needs Triton installed ({error})") from None
    reason = triton_flash.triton_unsupported(q, q, None)
    if reason is not None:
        raise ValueError(reason)
    return True


def _triton(q, k_cache, v_cache, cu_seqlens_q, cache_seqlens, block_tables, kv_scales):
    from .triton_paged import triton_paged_attention

    device = q.device
    width = max((len(t) for t in block_tables), default=1) or 1
    table = torch.zeros(len(block_tables), width, dtype=torch.int32)
    for row, blocks in enumerate(block_tables):
        table[row, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    lengths = [b - a for a, b in zip(cu_seqlens_q, cu_seqlens_q[1:])]
    return triton_paged_attention(q, k_cache, v_cache, torch.tensor(cu_seqlens_q, dtype=torch.int32, device=device),
                                  torch.tensor(cache_seqlens, dtype=torch.int32, device=device), table.to(device),
                                  max(lengths, default=1), kv_scales)
