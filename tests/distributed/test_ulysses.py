"""Ulysses and the Ulysses x ring hybrid (USP) on gloo ranks, against the float64 oracle.

Every rank builds the same seeded full tensors, takes its shard under the layout over all U x R ranks,
runs the attention and checks its output, lse and the gradients of q, k, v (and the sinks: each rank holds
its heads' share, their sum is the oracle's) against the same rows of the oracle.  U x R in {1x1, 2x1, 1x2,
3x1, 2x2, 4x1, 1x4}, every layout, GQA with the K/V heads split and repeated, windows, softcap; packed
documents of odd lengths; bfloat16 within twice plain PyTorch's error; bad heads refused before any
transfer on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ringmoe.attention import AttentionSpec, attention_reference
from ringmoe.parallel import RingStats, make_mesh, shard
from ringmoe.parallel.launch import RankFailed, spawn
from ringmoe.parallel.ulysses import ulysses_attn_func, usp_attn_func, usp_attn_varlen_func
from ringmoe.parallel.varlen import shard_varlen, varlen_positions
from tests.helpers import assert_group_still_works, max_err, oracle_with_sinks, random_qkv, reference_with_grads


# (ulysses, ring, layout, causal, window, softcap, heads, kv_heads, sinks, chunk)
CASES = {
    1: [(1, 1, "zigzag", True, (-1, -1), 0.0, 4, 2, False, 5)],
    2: [(2, 1, "striped", True, (-1, -1), 0.0, 4, 2, True, 7),
        (2, 1, "zigzag", False, (3, 2), 0.0, 4, 1, False, 4),
        (1, 2, "zigzag", True, (-1, -1), 0.0, 4, 2, False, 3)],
    3: [(3, 1, "zigzag", True, (-1, -1), 0.0, 6, 3, True, 5),
        (3, 1, "striped", True, (4, 0), 0.0, 3, 1, False, 7),
        (1, 3, "contiguous", True, (-1, -1), 5.0, 6, 2, False, 3)],
    4: [(2, 2, "zigzag", True, (-1, -1), 0.0, 4, 1, True, 3),
        (2, 2, "striped", True, (5, 0), 0.0, 4, 2, False, 5),
        (2, 2, "contiguous", False, (-1, -1), 3.0, 8, 4, False, 3),
        (4, 1, "contiguous", False, (-1, -1), 0.0, 8, 2, True, 3),
        (1, 4, "striped", True, (-1, -1), 0.0, 4, 2, False, 3)],
}


def _dense_rank(rank, world):
    errors = []
    for case in CASES[world]:
        u, r, layout, causal, window, softcap, heads, kv_heads, use_sinks, chunk = case
        mesh = make_mesh(cp=world, ulysses=u)
        seqlen = 2 * world * chunk
        seed = hash(case) % 2**31
        q, k, v, dout = random_qkv(seed, 2, seqlen, seqlen, heads, kv_heads, 8, torch.float64)
        sinks = torch.randn(heads, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        sinks = sinks if use_sinks else None
        spec = AttentionSpec(8**-0.5, causal, window[0], window[1], softcap=softcap)
        want = oracle_with_sinks(q, k, v, sinks, dout, spec)
        local = [shard(x, world, rank, layout).requires_grad_() for x in (q, k, v)]
        mine_sinks = sinks.clone().requires_grad_() if sinks is not None else None
        stats = RingStats()
        out, lse = usp_attn_func(*local, mesh.ulysses_group, mesh.ring_group, causal=causal, layout=layout,
                                 return_lse=True, backend="blockwise", window_size=window, softcap=softcap,
                                 sinks=mine_sinks, stats=stats)
        (torch.sum(out * shard(dout, world, rank, layout)) + 0.25 * lse.sum()).backward()
        for name, g, w, dim in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *(x.grad for x in local)), want,
                                   (1, 2, 1, 1, 1)):
            err = max_err(g, shard(w, world, rank, layout, dim=dim))
            assert err < 1e-10, f"rank {rank} {case}: {name} {err:.3g}"
            errors.append(err)
        if sinks is not None:
            total = mine_sinks.grad.clone()
            dist.all_reduce(total)
            assert max_err(total, want[5]) < 1e-10, f"rank {rank} {case}: dsinks"
        exchanges = [s for s in stats.forward if s["step"] == "all_to_all"]
        assert len(exchanges) == (0 if u == 1 else 3)  # q, k, v in one; out; lse
        if u > 1:  # (U - 1) / U of q, k, v (K/V repeated to U heads when fewer) go to the other members
            kv_sent = max(kv_heads, u)
            per_head = 2 * (seqlen // world) * 8 * 8
            assert exchanges[0]["bytes_sent"] == per_head * (heads + 2 * kv_sent) * (u - 1) // u
    return max(errors)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ulysses_and_the_hybrid_match_the_oracle(world):
    assert all(e < 1e-10 for e in spawn(_dense_rank, world, timeout=300))


DOCS = [1, 7, 30, 2, 13, 5]  # 58 tokens


def _varlen_rank(rank, world, u, layout, causal, heads, kv_heads):
    mesh = make_mesh(cp=world, ulysses=u)
    gen = torch.Generator().manual_seed(world * 10 + u)
    total = sum(DOCS)
    q, k, v, dout = (torch.randn(total, h, 8, generator=gen, dtype=torch.float64)
                     for h in (heads, kv_heads, kv_heads, heads))
    cu = torch.tensor([0] + list(torch.tensor(DOCS).cumsum(0)), dtype=torch.int32)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    outs, lses = [], []
    bounds = cu.tolist()
    for a, b in zip(bounds, bounds[1:]):
        o, lse = attention_reference(*(x[None, a:b] for x in leaves), AttentionSpec(8**-0.5, causal=causal))
        outs.append(o[0])
        lses.append(lse[0])
    torch.cat(outs).backward(dout)
    want = [torch.cat(outs).detach(), torch.cat(lses, dim=-1).detach(), *(x.grad for x in leaves)]
    mine = [shard_varlen(x, cu, world, rank, layout).requires_grad_() for x in (q, k, v)]
    out, lse = usp_attn_varlen_func(*mine, cu, max(DOCS), mesh.ulysses_group, mesh.ring_group, causal=causal,
                                    layout=layout, return_lse=True, backend="blockwise")
    out.backward(shard_varlen(dout, cu, world, rank, layout))
    rows = varlen_positions(cu, world, rank, layout)
    expected = [want[0][rows], want[1][:, rows], want[2][rows], want[3][rows], want[4][rows]]
    errors = [max_err(g, e) for g, e in zip([out, lse, *(x.grad for x in mine)], expected)]
    assert max(errors) < 1e-10, f"rank {rank}: out/lse/dq/dk/dv errors {errors}"
    return max(errors)


@pytest.mark.parametrize("world,u,layout,causal,heads,kv_heads", [
    (2, 2, "zigzag", True, 4, 2), (3, 3, "striped", True, 6, 3), (4, 2, "zigzag", True, 4, 2),
    (4, 2, "striped", False, 4, 1), (4, 4, "contiguous", True, 8, 2)])
def test_packed_documents_of_odd_lengths_match_the_per_document_oracle(world, u, layout, causal, heads, kv_heads):
    spawn(_varlen_rank, world, u, layout, causal, heads, kv_heads, timeout=180)


def _bfloat16_rank(rank, world):
    mesh = make_mesh(cp=world, ulysses=2)
    seqlen = 2 * world * 8
    q, k, v, dout = random_qkv(31, 1, seqlen, seqlen, 4, 2, 16, torch.bfloat16)
    spec = AttentionSpec(16**-0.5, causal=True)
    exact = reference_with_grads(q, k, v, dout, spec)
    plain = reference_with_grads(q, k, v, dout, spec, dtype=torch.bfloat16)
    local = [shard(x, world, rank, "zigzag").requires_grad_() for x in (q, k, v)]
    out = usp_attn_func(*local, mesh.ulysses_group, mesh.ring_group, causal=True, layout="zigzag")
    out.backward(shard(dout, world, rank, "zigzag"))
    assert out.dtype == torch.bfloat16
    for name, ours, e, p in zip(("out", "dq", "dk", "dv"), (out, *(x.grad for x in local)),
                                (exact[0], *exact[2:]), (plain[0], *plain[2:])):
        e, p = shard(e, world, rank, "zigzag"), shard(p, world, rank, "zigzag")
        assert max_err(ours, e) <= 2 * max_err(p, e) + 1e-6, f"rank {rank} {name}"
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_bfloat16_within_twice_plain_pytorch(world):
    assert all(spawn(_bfloat16_rank, world, timeout=180))


def _bad_heads_rank(rank, world, heads, kv_heads):
    q, k, v, _ = random_qkv(2, 1, 4 * world, 4 * world, heads, kv_heads, 8, torch.float64)
    local = [shard(x, world, rank, "zigzag") for x in (q, k, v)]
    try:
        ulysses_attn_func(*local)
    except ValueError as error:
        return str(error), assert_group_still_works(world)
    return None, None


@pytest.mark.parametrize("heads,kv_heads,named", [(3, 1, "q heads (3)"), (4, 3, None), (6, 3, "k/v heads (3)")])
def test_heads_that_do_not_split_are_refused_on_every_rank_before_any_transfer(heads, kv_heads, named):
    if named is None:  # 4 q heads over 3 k/v heads is no GQA at all: check_qkv names it
        named = "multiple of k/v heads"
    results = spawn(_bad_heads_rank, 2, heads, kv_heads, timeout=60)
    assert all(message is not None and named in message and ok for message, ok in results)


def _mismatched_rank(rank, world):
    mesh = make_mesh(cp=world, ulysses=2)
    seqlen = 8 * world if rank != 3 else 16 * world  # the last rank of the second Ulysses group differs
    q, k, v, _ = random_qkv(2, 1, seqlen, seqlen, 4, 2, 8, torch.float64)
    local = [shard(x, world, rank, "zigzag") for x in (q, k, v)]
    try:
        usp_attn_func(*local, mesh.ulysses_group, mesh.ring_group)
    except ValueError as error:
        return str(error)
    return None


def test_ranks_that_disagree_all_raise_in_the_two_dimensional_grid():
    messages = spawn(_mismatched_rank, 4, timeout=60)
    assert all(m is not None and "one shape and dtype" in m for m in messages), messages


def _bad_mesh_rank(rank, world):
    make_mesh(cp=world, ulysses=3)


def test_a_mesh_whose_ulysses_degree_does_not_divide_cp_is_refused():
    with pytest.raises(RankFailed, match="ulysses"):
        spawn(_bad_mesh_rank, 2, timeout=60)


def _mla_rank(rank, world, u, layout, causal, docs):
    """MLA by Ulysses x ring (latents gathered, each rank expanding its heads) vs the float64 MLA oracle, dense
    (docs None) or packed documents; dW_kvb summed over the ranks."""
    from ringmoe.parallel.ring_mla import LatentBlocks
    from ringmoe.parallel.ulysses import usp_mla_attn_func
    from tests.distributed.test_ring_mla import HEADS, NOPE, ROPE, V, _inputs

    mesh = make_mesh(cp=world, ulysses=u)
    seqlen = sum(docs) if docs else 2 * world * 3
    q, latent, k_rope, w, dout = _inputs(world * 10 + u, seqlen)
    leaves = [x.clone().requires_grad_() for x in (q, latent, k_rope, w)]
    k, v = LatentBlocks(leaves[3], HEADS, NOPE, V).unpack(torch.cat([leaves[1], leaves[2]], dim=-1))
    spec = AttentionSpec((NOPE + ROPE) ** -0.5, causal)
    if docs:  # row 0 only, attention inside each document
        bounds = [0] + list(torch.tensor(docs).cumsum(0).tolist())
        want = torch.cat([attention_reference(leaves[0][:1, a:b], k[:1, a:b], v[:1, a:b], spec)[0]
                          for a, b in zip(bounds, bounds[1:])], dim=1)[..., :V]
        want.backward(dout[:1])
    else:
        want = attention_reference(leaves[0], k, v, spec)[0][..., :V]
        want.backward(dout)
    weight = w.clone().requires_grad_()
    if docs:
        cu = torch.tensor(bounds, dtype=torch.int32)
        mine = [shard_varlen(x[0], cu, world, rank, layout).requires_grad_() for x in (q, latent, k_rope)]
        out = usp_mla_attn_func(*mine, weight, V, mesh.ulysses_group, mesh.ring_group, causal=causal, layout=layout,
                                backend="blockwise", cu_seqlens=cu, max_seqlen=max(docs))
        out.backward(shard_varlen(dout[0], cu, world, rank, layout))
        rows = varlen_positions(cu, world, rank, layout)
        expected = [want[0][rows], *(x.grad[0][rows] for x in leaves[:3])]
    else:
        mine = [shard(x, world, rank, layout).requires_grad_() for x in (q, latent, k_rope)]
        out = usp_mla_attn_func(*mine, weight, V, mesh.ulysses_group, mesh.ring_group, causal=causal, layout=layout,
                                backend="blockwise")
        out.backward(shard(dout, world, rank, layout))
        expected = [shard(x, world, rank, layout) for x in (want, *(x.grad for x in leaves[:3]))]
    for name, got, e in zip(("out", "dq", "dlatent", "dk_rope"), (out, *(x.grad for x in mine)), expected):
        assert max_err(got, e) < 1e-10, f"rank {rank} u={u} {layout} docs={docs}: {name} {max_err(got, e):.3g}"
    grad_w = weight.grad.clone()
    dist.all_reduce(grad_w)
    assert max_err(grad_w, leaves[3].grad) < 1e-10, f"rank {rank}: dW_kvb"
    return True


@pytest.mark.parametrize("world, u, layout, causal, docs", [
    (2, 2, "zigzag", True, None), (4, 2, "striped", True, None), (4, 4, "contiguous", False, None),
    (2, 2, "zigzag", True, [5, 1, 12, 3]), (4, 2, "zigzag", True, [5, 1, 12, 3])])
def test_mla_through_ulysses_and_the_hybrid_moves_latents_and_matches_the_oracle(world, u, layout, causal, docs):
    assert all(spawn(_mla_rank, world, u, layout, causal, docs, timeout=180))
