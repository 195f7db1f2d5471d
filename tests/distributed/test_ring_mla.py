"""The ring that carries MLA latents, on gloo ranks, against a float64 oracle of MLA (the latent expanded on
one process, naive attention): every layout, world sizes 1-4, causal and not, forward and the gradients of
q, the latent, the RoPE key and W_kvb (each rank holds its share of dW_kvb: their sum is the oracle's).
The bytes it sends are those of the latents."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ringmoe.attention import AttentionSpec, attention_reference
from ringmoe.parallel import LAYOUTS, RingStats, ring_flash_attn_func, shard
from ringmoe.parallel.launch import spawn
from ringmoe.parallel.ring_mla import LatentBlocks, ring_mla_attn_func
from tests.helpers import assert_group_still_works

HEADS, NOPE, ROPE, V, RANK = 4, 8, 4, 6, 10


def _inputs(seed, seqlen, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, seqlen, HEADS, NOPE + ROPE, generator=gen, dtype=torch.float64)
    latent = torch.randn(2, seqlen, RANK, generator=gen, dtype=torch.float64)
    k_rope = torch.randn(2, seqlen, ROPE, generator=gen, dtype=torch.float64)
    w = torch.randn(HEADS * (NOPE + V), RANK, generator=gen, dtype=torch.float64) * 0.3
    dout = torch.randn(2, seqlen, HEADS, V, generator=gen, dtype=torch.float64)
    return [x.to(dtype) for x in (q, latent, k_rope, w, dout)]


def _oracle(q, latent, k_rope, w, dout, causal):
    leaves = [x.clone().requires_grad_() for x in (q, latent, k_rope, w)]
    k, v = LatentBlocks(leaves[3], HEADS, NOPE, V).unpack(torch.cat([leaves[1], leaves[2]], dim=-1))
    out, _ = attention_reference(leaves[0], k, v, AttentionSpec((NOPE + ROPE) ** -0.5, causal))
    out = out[..., :V]
    out.backward(dout)
    return out.detach(), *(x.grad for x in leaves)


def _check(rank, world):
    seqlen = 2 * world * 3
    for layout in LAYOUTS:
        for causal in (True, False):
            q, latent, k_rope, w, dout = _inputs(hash((world, layout, causal)) % 2**31, seqlen)
            want = _oracle(q, latent, k_rope, w, dout, causal)
            mine = [shard(x, world, rank, layout).requires_grad_() for x in (q, latent, k_rope)]
            weight = w.clone().requires_grad_()
            stats = RingStats()
            out = ring_mla_attn_func(*mine, weight, V, causal=causal, layout=layout, backend="blockwise", stats=stats)
            out.backward(shard(dout, world, rank, layout))
            for name, got, full in zip(("out", "dq", "dlatent", "dk_rope"), (out, *(x.grad for x in mine)),
                                       (want[0], *want[1:4])):
                err = (got - shard(full, world, rank, layout)).abs().max().item()
                assert err < 1e-10, f"rank {rank} {layout} causal={causal}: {name} error {err:.3g}"
            grad_w = weight.grad.clone()
            dist.all_reduce(grad_w)
            assert (grad_w - want[4]).abs().max() < 1e-10, f"rank {rank} {layout}: dW_kvb"
            sent = stats.totals()["bytes_sent"]
            block = 2 * (seqlen // world) * (RANK + ROPE) * 8
            assert sent % block == 0  # whole latent blocks, never expanded K/V (the last contiguous rank: none)
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_latent_ring_matches_the_mla_oracle(world):
    assert all(spawn(_check, world, timeout=240))


def _equals_expanded(rank, world):
    q, latent, k_rope, w, _ = _inputs(7, 8 * world, torch.float32)
    mine = [shard(x, world, rank, "zigzag") for x in (q, latent, k_rope)]
    latent_stats, dense_stats = RingStats(), RingStats()
    out = ring_mla_attn_func(*mine, w, V, stats=latent_stats)
    k, v = LatentBlocks(w, HEADS, NOPE, V).unpack(torch.cat(mine[1:], dim=-1))
    dense = ring_flash_attn_func(mine[0], k, v, stats=dense_stats)[..., :V]
    assert (out - dense).abs().max() < 1e-5
    return latent_stats.totals()["bytes_sent"], dense_stats.totals()["bytes_sent"]


def test_latent_ring_sends_latents_not_heads():
    for latent_bytes, dense_bytes in spawn(_equals_expanded, 2, timeout=60):
        # per token: rank + rope = 14 numbers against 2 x heads x (nope + rope) = 96 for K and padded V
        assert latent_bytes * 96 == dense_bytes * 14


def _packed(rank, world, layout):
    """Packed documents through the latent ring against the per-document oracle."""
    docs = [1, 7, 30, 2, 13, 5]
    total = sum(docs)
    q, latent, k_rope, w, dout = _inputs(world, total)
    q, latent, k_rope, dout = q[0], latent[0], k_rope[0], dout[0]
    cu = torch.tensor([0] + torch.tensor(docs).cumsum(0).tolist(), dtype=torch.int32)
    leaves = [x.clone().requires_grad_() for x in (q, latent, k_rope, w)]
    outs = []
    bounds = cu.tolist()
    for a, b in zip(bounds, bounds[1:]):
        k, v = LatentBlocks(leaves[3], HEADS, NOPE, V).unpack(torch.cat([leaves[1][None, a:b], leaves[2][None, a:b]], -1))
        o, _ = attention_reference(leaves[0][None, a:b], k, v, AttentionSpec((NOPE + ROPE) ** -0.5, causal=True))
        outs.append(o[0, ..., :V])
    torch.cat(outs).backward(dout)
    from ringmoe.parallel.varlen import shard_varlen, varlen_positions

    mine = [shard_varlen(x, cu, world, rank, layout).requires_grad_() for x in (q, latent, k_rope)]
    weight = w.clone().requires_grad_()
    out = ring_mla_attn_func(*mine, weight, V, layout=layout, backend="blockwise", cu_seqlens=cu, max_seqlen=30)
    out.backward(shard_varlen(dout, cu, world, rank, layout))
    rows = varlen_positions(cu, world, rank, layout)
    want = [torch.cat(outs).detach(), *(x.grad for x in leaves[:3])]
    for name, got, full in zip(("out", "dq", "dlatent", "dk_rope"), (out, *(x.grad for x in mine)), want):
        assert (got - full[rows]).abs().max() < 1e-10, f"rank {rank} {layout}: {name}"
    grad_w = weight.grad.clone()
    dist.all_reduce(grad_w)
    assert (grad_w - leaves[3].grad).abs().max() < 1e-10
    return True


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_latent_ring_over_packed_documents(world, layout):
    assert all(spawn(_packed, world, layout, timeout=120))


def _bad(rank, world):
    q, latent, k_rope, w, _ = _inputs(1, 8)
    with pytest.raises(ValueError, match="kv_b_weight"):
        ring_mla_attn_func(q, latent, k_rope, w[:-1], V)
    with pytest.raises(ValueError, match="latent"):
        ring_mla_attn_func(q, latent[:, :4], k_rope, w, V)
    return assert_group_still_works(world)


def test_bad_input_is_refused_before_any_transfer():
    assert all(spawn(_bad, 2, timeout=60))
