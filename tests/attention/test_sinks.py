"""Attention sinks against the float64 oracle that treats the sink as a real key (a score column of
sinks[h] with a zero value): every backend, forward and gradients (q, k, v and the sinks), the lse's
gradient, rows that see no key, varlen, and half precision by flash-attn's rule."""

from __future__ import annotations

import pytest
import torch

from ringmoe import flash_attn_func
from ringmoe.attention import AttentionSpec, attention_reference, flash_attn_varlen_func
from ringmoe.attention.triton_flash import interpreting
from tests.helpers import max_err, random_qkv

# (batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, causal, window)
CASES = [
    (1, 1, 1, 2, 1, 16, False, (-1, -1)),
    (2, 37, 37, 4, 2, 16, True, (-1, -1)),
    (1, 53, 29, 4, 2, 32, True, (-1, -1)),    # seqlen_q > seqlen_k: rows without keys see only the sink
    (1, 29, 77, 2, 2, 24, False, (-1, -1)),   # seqlen_q < seqlen_k
    (1, 61, 61, 4, 1, 16, True, (9, -1)),     # causal sliding window (gpt-oss's window layers)
]
IDS = [f"q{c[1]}-k{c[2]}-h{c[3]}/{c[4]}-{'causal' if c[6] else 'full'}-w{c[7]}" for c in CASES]
BACKENDS = ["blockwise", "native", "reference"] + (["triton"] if interpreting() or torch.cuda.is_available() else [])


def _sinks(heads, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed + 100)
    return (torch.randn(heads, generator=gen, dtype=torch.float64) * 2).to(dtype)


def _oracle(q, k, v, sinks, dout, dlse_weight, spec):
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v, sinks)]
    out, lse = attention_reference(*leaves[:3], spec, sinks=leaves[3])
    (torch.sum(out * dout.double()) + dlse_weight * lse.sum()).backward()
    return out.detach(), lse.detach(), *(x.grad for x in leaves)


def _run(q, k, v, sinks, dout, dlse_weight, case, backend):
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    out, lse = flash_attn_func(*leaves[:3], causal=case[6], window_size=case[7], return_lse=True, backend=backend,
                               sinks=leaves[3])
    (torch.sum(out * dout) + dlse_weight * lse.sum()).backward()
    return out.detach(), lse.detach(), *(x.grad for x in leaves)


@pytest.mark.parametrize("dlse_weight", [0.0, 0.3])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_sinks_match_the_oracle(case, backend, dlse_weight):
    b, sq, sk, h, hkv, d, causal, window = case
    if backend == "native" and window != (-1, -1):
        pytest.skip("the native kernel has no windows (auto falls back to blockwise)")
    dtype = torch.float32 if backend == "triton" else torch.float64
    q, k, v, dout = random_qkv(sq * 7 + sk, b, sq, sk, h, hkv, d, dtype=dtype)
    sinks = _sinks(h, sq, dtype)
    spec = AttentionSpec(d**-0.5, causal, window[0], window[1])
    got = _run(q, k, v, sinks, dout, dlse_weight, case, backend)
    want = _oracle(q, k, v, sinks, dout, dlse_weight, spec)
    atol = 2e-4 if dtype == torch.float32 else 1e-10
    for name, a, e in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), got, want):
        assert torch.isfinite(a).all(), name
        assert max_err(a, e) <= atol, f"{name}: {max_err(a, e):.3g}"


def test_rows_without_keys_see_only_the_sink():
    q, k, v, _ = random_qkv(3, 1, 9, 4, 2, 2, 8, dtype=torch.float64)
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float64)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True, sinks=sinks)
    empty = slice(0, 5)  # bottom-right causal: the first 5 of 9 rows see none of the 4 keys
    assert torch.equal(out[:, empty], torch.zeros_like(out[:, empty]))
    assert torch.equal(lse[:, :, empty], sinks[None, :, None].expand(1, 2, 5))


def test_varlen_sinks_per_sequence():
    gen = torch.Generator().manual_seed(11)
    lengths = [3, 1, 20, 8]
    total = sum(lengths)
    q = torch.randn(total, 4, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(total, 2, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(total, 2, 16, generator=gen, dtype=torch.float64)
    sinks = torch.randn(4, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0, 3, 4, 24, 32], dtype=torch.int32)
    out = flash_attn_varlen_func(q, k, v, cu, cu, 20, 20, causal=True, sinks=sinks)
    bounds = cu.tolist()
    for a, b in zip(bounds, bounds[1:]):
        want, _ = attention_reference(q[None, a:b], k[None, a:b], v[None, a:b], AttentionSpec(0.25, causal=True),
                                      sinks=sinks)
        assert max_err(out[a:b], want[0]) < 1e-12


def test_bfloat16_within_twice_plain_pytorch():
    q, k, v, _ = random_qkv(5, 1, 128, 128, 4, 2, 32, dtype=torch.bfloat16)
    sinks = _sinks(4, 5, torch.bfloat16)
    spec = AttentionSpec(32**-0.5, causal=True)
    exact, _ = attention_reference(q, k, v, spec, sinks=sinks)
    plain, _ = attention_reference(q, k, v, spec, compute_dtype=torch.bfloat16, sinks=sinks)
    for backend in ("blockwise", "native"):
        out = flash_attn_func(q, k, v, causal=True, backend=backend, sinks=sinks)
        assert max_err(out, exact) <= 2 * max_err(plain, exact), backend


def test_bad_sinks_are_refused_by_name():
    q, k, v, _ = random_qkv(0, 1, 4, 4, 2, 1, 8)
    with pytest.raises(ValueError, match="sinks must have shape \\(2,\\)"):
        flash_attn_func(q, k, v, sinks=torch.zeros(3))
    with pytest.raises(TypeError, match="sinks must be a floating"):
        flash_attn_func(q, k, v, sinks=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(TypeError, match="sinks must be a torch.Tensor"):
        flash_attn_func(q, k, v, sinks=[0.0, 0.0])
