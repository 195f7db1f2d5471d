"""merge_attention (the online-softmax merge) and flash_attn_varlen_func."""

from __future__ import annotations

import pytest
import torch

from ringmoe import flash_attn_func, flash_attn_varlen_func, merge_attention
from ringmoe.attention import AttentionSpec, attention_reference
from tests.helpers import max_err, random_qkv, reference_with_grads


@pytest.mark.parametrize("split", [1, 37, 99])
def test_merge_of_disjoint_key_sets_equals_full_attention(split):
    q, k, v, _ = random_qkv(3, 2, 45, 100, 4, 2, 16, dtype=torch.float64)
    spec = AttentionSpec(0.25)
    out_a, lse_a = attention_reference(q, k[:, :split], v[:, :split], spec)
    out_b, lse_b = attention_reference(q, k[:, split:], v[:, split:], spec)
    out, lse = merge_attention(out_a, lse_a, out_b, lse_b)
    full_out, full_lse = attention_reference(q, k, v, spec)
    assert max_err(out, full_out) < 1e-12 and max_err(lse, full_lse) < 1e-12
    # order does not matter
    out2, lse2 = merge_attention(out_b, lse_b, out_a, lse_a)
    assert max_err(out2, out) < 1e-12 and max_err(lse2, lse) < 1e-12


def test_merge_handles_empty_sides_without_nan():
    gen = torch.Generator().manual_seed(0)
    out_a = torch.randn(1, 4, 2, 8, generator=gen)
    lse_a = torch.randn(1, 2, 4, generator=gen)
    lse_a[0, 0, 1] = float("-inf")
    out_a[0, 1, 0] = 0.0
    out_b = torch.randn(1, 4, 2, 8, generator=gen)
    lse_b = torch.randn(1, 2, 4, generator=gen)
    lse_b[0, 0, 1] = float("-inf")  # both empty on (head 0, row 1)
    lse_b[0, 1, 2] = float("-inf")  # only b empty on (head 1, row 2)
    out, lse = merge_attention(out_a, lse_a, out_b, lse_b)
    assert torch.isfinite(out).all()
    assert torch.isneginf(lse[0, 0, 1]) and torch.all(out[0, 1, 0] == 0)
    assert torch.allclose(out[0, 2, 1], out_a[0, 2, 1]) and torch.allclose(lse[0, 1, 2], lse_a[0, 1, 2])


def test_merge_is_stable_for_huge_lse():
    out_a, out_b = torch.ones(1, 1, 1, 2), -torch.ones(1, 1, 1, 2)
    lse_a, lse_b = torch.full((1, 1, 1), 1e4), torch.full((1, 1, 1), 1e4 + 1.0)
    out, lse = merge_attention(out_a, lse_a, out_b, lse_b)
    w = torch.sigmoid(torch.tensor(-1.0))  # weight of a
    assert torch.allclose(out, (w - (1 - w)) * torch.ones(1, 1, 1, 2))
    assert torch.isfinite(lse).all()


def test_merge_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="out_a"):
        merge_attention(torch.zeros(1, 2, 1, 4), torch.zeros(1, 1, 2), torch.zeros(1, 3, 1, 4), torch.zeros(1, 1, 3))
    with pytest.raises(ValueError, match="lse"):
        merge_attention(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1), torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", ["auto", "blockwise"])
def test_varlen_matches_per_sequence_reference(causal, backend):
    lens_q, lens_k = [5, 17, 1, 30], [9, 17, 4, 12]
    heads, kv_heads, d = 4, 2, 16
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(sum(lens_q), heads, d, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(sum(lens_k), kv_heads, d, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(sum(lens_k), kv_heads, d, generator=gen, dtype=torch.float64, requires_grad=True)
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32)
    out, lse = flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal, return_lse=True, backend=backend
    )
    dout = torch.randn_like(out)
    out.backward(dout)
    assert out.shape == q.shape and lse.shape == (heads, sum(lens_q))
    spec = AttentionSpec(d**-0.5, causal)
    for b in range(len(lens_q)):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        r_out, r_lse, r_dq, r_dk, r_dv = reference_with_grads(
            q[q0:q1].detach()[None], k[k0:k1].detach()[None], v[k0:k1].detach()[None], dout[q0:q1][None], spec
        )
        assert max_err(out[q0:q1], r_out[0]) < 1e-10
        assert max_err(lse[:, q0:q1], r_lse[0]) < 1e-10
        assert torch.equal(torch.isinf(lse[:, q0:q1]), torch.isinf(r_lse[0]))
        assert max_err(q.grad[q0:q1], r_dq[0]) < 1e-10
        assert max_err(k.grad[k0:k1], r_dk[0]) < 1e-10
        assert max_err(v.grad[k0:k1], r_dv[0]) < 1e-10


@pytest.mark.parametrize(
    "cu_q, max_q, match",
    [
        (torch.tensor([0, 3, 6], dtype=torch.int64), 3, "int32"),
        (torch.tensor([1, 3, 6], dtype=torch.int32), 3, "start at 0"),
        (torch.tensor([0, 4, 3], dtype=torch.int32), 4, "never decrease"),
        (torch.tensor([0, 3, 5], dtype=torch.int32), 3, "end at 6"),
        (torch.tensor([0, 3, 6], dtype=torch.int32), 2, "max_seqlen"),
    ],
)
def test_varlen_rejects_bad_cu_seqlens(cu_q, max_q, match):
    q = torch.randn(6, 2, 8)
    cu_k = torch.tensor([0, 3, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        flash_attn_varlen_func(q, q, q, cu_q, cu_k, max_q, 3)


def test_dense_and_varlen_agree_on_equal_lengths():
    q, k, v, _ = random_qkv(12, 3, 20, 20, 2, 2, 8)
    dense = flash_attn_func(q, k, v, causal=True)
    cu = torch.arange(0, 61, 20, dtype=torch.int32)
    packed = flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, 20, 20, causal=True)
    assert max_err(packed.view_as(dense), dense) < 1e-6


@pytest.mark.parametrize("heads,kv_heads,seqlen_q,seqlen_k", [(8, 2, 1, 37), (4, 4, 3, 1), (6, 1, 2, 203), (4, 2, 1, 0)])
def test_decode_attention_matches_reference_without_copying_kv(heads, kv_heads, seqlen_q, seqlen_k):
    from ringmoe.attention import AttentionSpec, attention_reference, decode_attention

    gen = torch.Generator().manual_seed(seqlen_k + heads)
    q = torch.randn(2, seqlen_q, heads, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(2, seqlen_k, kv_heads, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(2, seqlen_k, kv_heads, 16, generator=gen, dtype=torch.float64)
    out, lse = decode_attention(q, k, v, softmax_scale=0.3)
    if seqlen_k == 0:  # an empty cache shard: out 0, lse -inf, as flash-attn's empty rows
        assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
        return
    want_out, want_lse = attention_reference(q, k, v, AttentionSpec(0.3))
    assert torch.allclose(out, want_out, atol=1e-12) and torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    assert torch.allclose(lse[~torch.isinf(lse)], want_lse[~torch.isinf(want_lse)], atol=1e-12)
    assert not torch.isnan(out).any()
    out32, _ = decode_attention(q.float(), k.float(), v.float(), softmax_scale=0.3)
    assert out32.dtype == torch.float32 and torch.allclose(out32.double(), want_out, atol=1e-5)
