"""Sliding windows and attention sinks in ring attention, on gloo ranks, against the float64 oracle.

Windows smaller than a shard, a few shards wide, and larger than the sequence; causal and two-sided;
every layout; world sizes 1-4; forward, the lse and the gradients of q, k, v and the sinks (each rank
holds its rows' share of the sinks' gradient: their sum is the oracle's).  Under the contiguous layout
a window shorter than a shard stops the ring after one step: the bytes sent are counted."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ringmoe.attention import AttentionSpec, attention_reference
from ringmoe.parallel import LAYOUTS, RingStats, ring_flash_attn_func, shard
from ringmoe.parallel.launch import spawn
from ringmoe.parallel.varlen import ring_flash_attn_varlen_func, shard_varlen, varlen_positions
from tests.helpers import assert_group_still_works, max_err, oracle_with_sinks, random_qkv

CHUNK = 3  # tokens per layout chunk: shards of 6 tokens


def _check(rank, world):
    seqlen = 2 * world * CHUNK
    shard_len = seqlen // world
    windows = [((2, 0), True), ((shard_len - 1, 0), True), ((2 * shard_len + 1, 0), True), ((seqlen + 5, 0), True),
               ((1, 2), False), ((4, -1), False)]
    worst = 0.0
    for layout in LAYOUTS:
        for (window, causal) in windows:
            for use_sinks in (False, True):
                seed = hash((world, layout, window, causal, use_sinks)) % 2**31
                q, k, v, dout = random_qkv(seed, 2, seqlen, seqlen, 4, 2, 8, torch.float64)
                sinks = torch.randn(4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
                sinks = sinks if use_sinks else None
                spec = AttentionSpec(8**-0.5, causal, window[0], window[1])
                want = oracle_with_sinks(q, k, v, sinks, dout, spec)
                local = [shard(x, world, rank, layout).requires_grad_() for x in (q, k, v)]
                mine_sinks = sinks.clone().requires_grad_() if sinks is not None else None
                stats = RingStats()
                out, lse = ring_flash_attn_func(*local, causal=causal, layout=layout, return_lse=True,
                                                backend="blockwise", window_size=window, sinks=mine_sinks, stats=stats)
                (torch.sum(out * shard(dout, world, rank, layout)) + 0.25 * lse.sum()).backward()
                got = (out, lse, *(x.grad for x in local))
                for name, g, w, dim in zip(("out", "lse", "dq", "dk", "dv"), got, want, (1, 2, 1, 1, 1)):
                    err = max_err(g, shard(w, world, rank, layout, dim=dim))
                    assert err < 1e-10, f"rank {rank} {layout} window {window} causal {causal} sinks {use_sinks}: {name} {err:.3g}"
                    worst = max(worst, err)
                if sinks is not None:
                    total = mine_sinks.grad.clone()
                    dist.all_reduce(total)
                    assert max_err(total, want[5]) < 1e-10, f"rank {rank} {layout} {window}: dsinks"
                if layout == "contiguous" and causal and window[0] < shard_len:
                    # only the previous shard can be in reach: two steps, one transfer per direction
                    assert len(stats.forward) == min(world, 2), stats.forward
    return worst


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_windows_and_sinks_match_the_oracle(world):
    assert all(w < 1e-10 for w in spawn(_check, world, timeout=300))


def _bytes(rank, world, window):
    q, k, v, _ = random_qkv(1, 1, 4096, 4096, 2, 1, 16, torch.float32)
    local = [shard(x, world, rank, "contiguous") for x in (q, k, v)]
    stats = RingStats()
    ring_flash_attn_func(*local, causal=True, layout="contiguous", window_size=window, stats=stats)
    return stats.totals()["bytes_sent"], len(stats.forward)


def test_a_window_within_one_shard_stops_the_contiguous_ring_early():
    full = spawn(_bytes, 4, (-1, -1), timeout=120)
    windowed = spawn(_bytes, 4, (128, 0), timeout=120)
    assert [steps for _, steps in full] == [4] * 4 and [steps for _, steps in windowed] == [2] * 4
    block = windowed[0][0]
    # full causal: rank r passes on blocks 0..r (the last rank none); windowed: each rank but the last
    # sends its own block to its one neighbour, and nothing else travels
    assert [b for b, _ in full] == [block, 2 * block, 3 * block, 0]
    assert [b for b, _ in windowed] == [block, block, block, 0]


def _varlen(rank, world, layout):
    docs = [1, 7, 30, 2, 13, 5]
    gen = torch.Generator().manual_seed(world)
    total = sum(docs)
    q = torch.randn(total, 4, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(total, 2, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(total, 2, 8, generator=gen, dtype=torch.float64)
    dout = torch.randn(total, 4, 8, generator=gen, dtype=torch.float64)
    sinks = torch.randn(4, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0] + torch.tensor(docs).cumsum(0).tolist(), dtype=torch.int32)
    spec = AttentionSpec(8**-0.5, causal=True, window_left=4)
    outs = []
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    s = sinks.clone().requires_grad_()
    bounds = cu.tolist()
    for a, b in zip(bounds, bounds[1:]):
        o, _ = attention_reference(*(x[None, a:b] for x in leaves), spec, sinks=s)
        outs.append(o[0])
    torch.cat(outs).backward(dout)
    want = [torch.cat(outs).detach(), *(x.grad for x in leaves)]
    mine = [shard_varlen(x, cu, world, rank, layout).requires_grad_() for x in (q, k, v)]
    my_sinks = sinks.clone().requires_grad_()
    out = ring_flash_attn_varlen_func(*mine, cu, max(docs), layout=layout, backend="blockwise", window_size=(4, 0),
                                      sinks=my_sinks)
    out.backward(shard_varlen(dout, cu, world, rank, layout))
    rows = varlen_positions(cu, world, rank, layout)
    for name, g, w in zip(("out", "dq", "dk", "dv"), (out, *(x.grad for x in mine)), want):
        assert max_err(g, w[rows]) < 1e-10, f"rank {rank} {layout}: {name}"
    total_grad = my_sinks.grad.clone()
    dist.all_reduce(total_grad)
    assert max_err(total_grad, s.grad) < 1e-10
    return True


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_varlen_ring_windows_and_sinks(world, layout):
    assert all(spawn(_varlen, world, layout, timeout=120))


def _native_window(rank, world):
    q = torch.randn(1, 8, 2, 8)
    with pytest.raises(ValueError, match="native.*sliding windows"):
        ring_flash_attn_func(q, q, q, window_size=(3, 0), backend="native")
    with pytest.raises(ValueError, match="sinks must have shape"):
        ring_flash_attn_func(q, q, q, sinks=torch.zeros(3))
    return assert_group_still_works(world)


def test_bad_window_backend_and_sinks_refused_before_any_transfer():
    assert all(spawn(_native_window, 2, timeout=60))
