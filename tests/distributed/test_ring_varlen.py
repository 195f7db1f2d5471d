"""Varlen ring attention: packed documents split by the layout, against a float64 per-document oracle.

Every rank builds the same seeded packed tensors, takes its rows with shard_varlen, runs the ring and
checks its output and its gradients against the same rows of the oracle (world sizes 1-4, every layout,
documents of length 1, shorter than the number of chunks, and longer than a whole shard)."""

from __future__ import annotations

import pytest
import torch

from ringmoe.attention import AttentionSpec, attention_reference
from ringmoe.parallel.launch import RankFailed, spawn
from ringmoe.parallel.varlen import ring_flash_attn_varlen_func, shard_varlen, unshard_varlen, varlen_positions

DOCS = [1, 7, 30, 2, 13, 5]  # 58 tokens


def _packed(seed, docs, heads=4, kv_heads=2, dim=16):
    gen = torch.Generator().manual_seed(seed)
    total = sum(docs)
    q = torch.randn(total, heads, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(total, kv_heads, dim, generator=gen, dtype=torch.float64)
    v = torch.randn(total, kv_heads, dim, generator=gen, dtype=torch.float64)
    dout = torch.randn(total, heads, dim, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0] + list(torch.tensor(docs).cumsum(0)), dtype=torch.int32)
    return q, k, v, dout, cu


def _oracle(q, k, v, dout, cu, causal):
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    outs, lses = [], []
    bounds = cu.tolist()
    for a, b in zip(bounds, bounds[1:]):
        o, lse = attention_reference(*(x[None, a:b] for x in leaves), AttentionSpec(q.shape[-1] ** -0.5, causal=causal))
        outs.append(o[0])
        lses.append(lse[0])
    out = torch.cat(outs)
    out.backward(dout)
    return out.detach(), torch.cat(lses, dim=-1), *(x.grad for x in leaves)


def _varlen_rank(rank, world, layout, causal, seed, docs):
    q, k, v, dout, cu = _packed(seed, docs)
    want = _oracle(q, k, v, dout, cu, causal)
    mine = [shard_varlen(x, cu, world, rank, layout) for x in (q, k, v)]
    leaves = [x.clone().requires_grad_() for x in mine]
    out, lse = ring_flash_attn_varlen_func(*leaves, cu, max(docs), causal=causal, layout=layout, return_lse=True,
                                           backend="blockwise")
    out.backward(shard_varlen(dout, cu, world, rank, layout))
    got = [out, lse, *(x.grad for x in leaves)]
    rows = varlen_positions(cu, world, rank, layout)
    expected = [want[0][rows], want[1][:, rows], want[2][rows], want[3][rows], want[4][rows]]
    errors = [(g - e).abs().max().item() if g.numel() else 0.0 for g, e in zip(got, expected)]
    assert max(errors) < 1e-10, f"rank {rank}: out/lse/dq/dk/dv errors {errors}"
    return out.detach()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["zigzag", "striped", "contiguous"])
def test_varlen_ring_matches_the_per_document_oracle(world, layout):
    outs = spawn(_varlen_rank, world, layout, True, 10 + world, DOCS, timeout=120)
    q, k, v, dout, cu = _packed(10 + world, DOCS)
    assert torch.allclose(unshard_varlen(outs, cu, layout), _oracle(q, k, v, dout, cu, True)[0], atol=1e-10)


@pytest.mark.parametrize("world", [2, 3])
def test_varlen_ring_without_causal_mask_and_with_ranks_holding_nothing(world):
    spawn(_varlen_rank, world, "zigzag", False, 3, DOCS, timeout=120)
    spawn(_varlen_rank, world, "striped", True, 4, [1, 2], timeout=120)  # 3 tokens: some ranks hold none


def test_shard_and_unshard_round_trip_with_uneven_chunks():
    x = torch.arange(58)
    cu = torch.tensor([0, 1, 8, 38, 40, 53, 58], dtype=torch.int32)
    for layout in ("zigzag", "striped", "contiguous"):
        parts = [shard_varlen(x, cu, 4, r, layout) for r in range(4)]
        assert sorted(torch.cat(parts).tolist()) == list(range(58))
        assert max(len(p) for p in parts) - min(len(p) for p in parts) <= len(cu)  # at most one per document
        assert torch.equal(unshard_varlen(parts, cu, layout), x)


def _mismatched_rank(rank, world):
    docs = DOCS if rank == 0 else DOCS[::-1]
    q, k, v, _, cu = _packed(1, docs)
    mine = [shard_varlen(x, cu, world, rank, "zigzag") for x in (q, k, v)]
    try:
        ring_flash_attn_varlen_func(*mine, cu, max(docs))
    except ValueError as error:
        return str(error)
    return None


def test_ranks_with_different_documents_all_raise():
    messages = spawn(_mismatched_rank, 2, timeout=60)
    assert all(m is not None and "same global cu_seqlens" in m for m in messages)


def _wrong_rows_rank(rank, world):
    q, k, v, _, cu = _packed(1, DOCS)
    ring_flash_attn_varlen_func(q[:5], k[:5], v[:5], cu, max(DOCS))


def test_wrong_local_rows_are_named():
    with pytest.raises(RankFailed, match="holds .* rows of these documents"):
        spawn(_wrong_rows_rank, 2, timeout=60)
