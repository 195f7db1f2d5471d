"""``paged_decode(..., causal=True)``: a prompt chunk's rows against the request's cached keys and the chunk's own new
keys, causally, against a float64 oracle of the whole sequence's attention (GQA, windows, sinks, an empty and a
partial cache, odd lengths and block sizes); in float32 within the flash-attn rule, and compiled equal to its
eager call."""

from __future__ import annotations

import pytest
import torch

from ringmoe.attention.paged import paged_decode


def _case(seed, start, n, heads, kv_heads, dim, block_size, dtype=torch.float64):
    """A request whose first ``start`` positions are cached (blocks scattered over the cache, stale values in the
    slots past them) and a chunk of ``n`` new rows at positions start .. start + n - 1."""
    gen = torch.Generator().manual_seed(seed)
    width = max(1, -(-start // block_size))
    blocks = width + 5
    k_cache = torch.randn(blocks, block_size, kv_heads, dim, generator=gen, dtype=dtype)
    v_cache = torch.randn(blocks, block_size, kv_heads, dim, generator=gen, dtype=dtype)
    table = torch.randperm(blocks, generator=gen)[:width]
    q = torch.randn(n, heads, dim, generator=gen, dtype=dtype)
    new = (torch.randn(n, kv_heads, dim, generator=gen, dtype=dtype),
           torch.randn(n, kv_heads, dim, generator=gen, dtype=dtype))
    sinks = torch.randn(heads, generator=gen, dtype=dtype)
    return q, k_cache, v_cache, table, new, sinks


def _oracle(q, k_cache, v_cache, table, new, start, window, sinks, scale):
    """Row r (position start + r) over the keys [max(0, p - window), p] of the sequence: the cached ones, then
    the chunk's; sinks join the softmax's normaliser.  float64, one row and head at a time."""
    n, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    keys = torch.cat([k_cache[table].flatten(0, 1)[:start], new[0]]).double()
    values = torch.cat([v_cache[table].flatten(0, 1)[:start], new[1]]).double()
    out = torch.zeros(n, heads, dim, dtype=torch.float64)
    for r in range(n):
        position = start + r
        low = max(0, position - window) if window >= 0 else 0
        for h in range(heads):
            kv = h // (heads // kv_heads)
            scores = keys[low:position + 1, kv] @ q[r, h].double() * scale
            if sinks is not None:
                scores = torch.cat([scores, sinks[h:h + 1].double()])
            weights = torch.softmax(scores, 0)[:position + 1 - low]
            out[r, h] = weights @ values[low:position + 1, kv]
    return out


def _run(q, k_cache, v_cache, table, new, start, window, sinks, dtype=None, compiled=False):
    dtype = dtype or q.dtype
    n = q.shape[0]
    block_size = k_cache.shape[1]
    tables = table[None].expand(n, -1).contiguous()
    contexts = torch.arange(start + 1, start + n + 1)
    length = tables.shape[1] * block_size

    def attend(q, k_cache, v_cache, tables, contexts, k, v, sinks):
        return paged_decode(q, k_cache, v_cache, tables, contexts, length, window, sinks, new=(k, v), by_block=True,
                            causal=True)

    fn = torch.compile(attend, dynamic=True, fullgraph=True) if compiled else attend
    cast = [x.to(dtype) for x in (q, k_cache, v_cache)]
    return fn(*cast[:3], tables, contexts, new[0].to(dtype), new[1].to(dtype),
              None if sinks is None else sinks.to(dtype))


CASES = [  # seed, cached keys, rows, heads, kv heads, head dim, block size, window, sinks
    (0, 0, 7, 4, 2, 16, 4, -1, False),
    (1, 13, 9, 6, 3, 20, 5, -1, False),
    (2, 37, 33, 8, 2, 32, 16, 10, True),
    (3, 5, 2, 2, 1, 9, 1, 3, False),
    (4, 64, 17, 4, 4, 24, 8, -1, True),
    (5, 0, 40, 4, 2, 16, 16, 7, False),
]


@pytest.mark.parametrize("seed,start,n,heads,kv_heads,dim,block_size,window,with_sinks", CASES)
def test_causal_rows_match_the_float64_oracle(seed, start, n, heads, kv_heads, dim, block_size, window, with_sinks):
    q, k_cache, v_cache, table, new, sinks = _case(seed, start, n, heads, kv_heads, dim, block_size)
    sinks = sinks if with_sinks else None
    want = _oracle(q, k_cache, v_cache, table, new, start, window, sinks, dim**-0.5)
    got = _run(q, k_cache, v_cache, table, new, start, window, sinks)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("seed,start,n,heads,kv_heads,dim,block_size,window,with_sinks", CASES[:4])
def test_float32_causal_rows_keep_the_flash_attn_rule(seed, start, n, heads, kv_heads, dim, block_size, window,
                                                      with_sinks):
    """float32 (torch's CPU flash kernel without a window, the masked scores with one; the cache through the C
    kernel where it runs): error vs float64 at most twice that of plain float32 attention of the whole sequence."""
    q, k_cache, v_cache, table, new, sinks = _case(seed, start, n, heads, kv_heads, dim, block_size)
    sinks = sinks if with_sinks else None
    want = _oracle(q, k_cache, v_cache, table, new, start, window, sinks, dim**-0.5)
    got = _run(q, k_cache, v_cache, table, new, start, window, sinks, torch.float32)
    plain_error = (_float32_oracle(q, k_cache, v_cache, table, new, start, window, sinks, dim**-0.5) - want).abs().max()
    assert (got.double() - want).abs().max() <= 2 * plain_error + 1e-7


def _float32_oracle(q, k_cache, v_cache, table, new, start, window, sinks, scale):
    """The whole sequence's attention in plain float32 tensor ops (masked scores, softmax): the flash-attn rule's
    reference error."""
    n, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    keys = torch.cat([k_cache[table].flatten(0, 1)[:start], new[0]]).float()
    values = torch.cat([v_cache[table].flatten(0, 1)[:start], new[1]]).float()
    keys, values = (x.repeat_interleave(heads // kv_heads, 1).transpose(0, 1) for x in (keys, values))  # (H, K, D)
    scores = q.float().transpose(0, 1) @ keys.transpose(1, 2) * scale                                  # (H, n, K)
    position = torch.arange(start, start + n)[:, None]
    key = torch.arange(start + n)[None]
    seen = (key <= position) & ((key >= position - window) if window >= 0 else True)
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.float()[:, None, None].expand(-1, n, 1)], -1)
    weights = torch.softmax(scores, -1)[..., :start + n]
    return (weights @ values).transpose(0, 1).double()


@pytest.mark.parametrize("window", [-1, pytest.param(5, marks=pytest.mark.slow)])  # (the masked form: tensor ops)
def test_compiled_causal_rows_equal_their_eager_call(window):
    """Compiled whole (one graph: torch's CPU flash kernel is an operator of it) equal to the eager call."""
    q, k_cache, v_cache, table, new, sinks = _case(6, 21, 12, 4, 2, 16, 8, torch.float32)
    eager = _run(q, k_cache, v_cache, table, new, 21, window, sinks)
    compiled = _run(q, k_cache, v_cache, table, new, 21, window, sinks, compiled=True)
    torch.testing.assert_close(compiled, eager, atol=2e-6, rtol=0)


def test_causal_refuses_band_masks_and_a_cp_ranks_counts():
    q, k_cache, v_cache, table, new, _ = _case(7, 4, 3, 2, 1, 8, 4)
    tables, contexts = table[None].expand(3, -1), torch.arange(5, 8)
    with pytest.raises(ValueError, match="causal"):
        paged_decode(q, k_cache, v_cache, tables, contexts, 4, new=new, fresh=torch.ones(3, 1, dtype=torch.bool),
                     causal=True)
    with pytest.raises(ValueError, match="causal"):
        paged_decode(q, k_cache, v_cache, tables, contexts, 4, causal=True)
