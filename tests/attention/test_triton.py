"""The Triton kernels, run by Triton's interpreter on CPU, against the float64 oracle."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from ringmoe import flash_attn_func  # noqa: E402
from ringmoe.attention import AttentionSpec  # noqa: E402
from ringmoe.attention.triton_flash import interpreting  # noqa: E402
from tests.helpers import max_err, random_qkv, reference_with_grads  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting() and not torch.cuda.is_available(),
                                reason="needs a GPU or TRITON_INTERPRET=1")

# (batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, causal, window, softcap)
CASES = [
    (1, 1, 1, 1, 1, 8, False, (-1, -1), 0.0),
    (2, 37, 37, 4, 2, 16, True, (-1, -1), 0.0),
    (1, 29, 53, 3, 1, 24, True, (-1, -1), 0.0),   # MQA, seqlen_q < seqlen_k, head_dim padded to 32
    (1, 53, 29, 2, 2, 16, True, (-1, -1), 0.0),   # seqlen_q > seqlen_k: empty rows
    (2, 33, 50, 4, 2, 24, False, (5, 3), 0.0),    # two-sided window
    (1, 45, 45, 2, 1, 32, True, (7, -1), 0.0),    # sliding window, causal
    (1, 40, 29, 2, 2, 32, False, (-1, -1), 4.0),  # softcap
]
IDS = [f"q{c[1]}-k{c[2]}-h{c[3]}/{c[4]}-d{c[5]}-{'causal' if c[6] else 'full'}-w{c[7]}-cap{c[8]}" for c in CASES]


def _run(q, k, v, dout, case):
    _, _, _, _, _, _, causal, window, softcap = case
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = flash_attn_func(*leaves, causal=causal, window_size=window, softcap=softcap, return_lse=True,
                               backend="triton")
    out.backward(dout)
    return out.detach(), lse, *(x.grad for x in leaves)


def _spec(case):
    return AttentionSpec(case[5] ** -0.5, case[6], case[7][0], case[7][1], case[8])


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_triton_float32_matches_reference(case):
    q, k, v, dout = random_qkv(CASES.index(case) + 100, *case[:6])
    want = reference_with_grads(q, k, v, dout, _spec(case))
    got = _run(q, k, v, dout, case)
    assert torch.equal(torch.isinf(got[1]), torch.isinf(want[1]))
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert name == "lse" or torch.isfinite(g).all(), name
        assert max_err(g, w) < 2e-5, f"{name}: {max_err(g, w):.3g}"


@pytest.mark.parametrize("case", [CASES[1], CASES[4], CASES[6]], ids=[IDS[1], IDS[4], IDS[6]])
def test_triton_float16_within_twice_plain_pytorch(case):
    q, k, v, dout = random_qkv(CASES.index(case) + 200, *case[:6], dtype=torch.float16)
    spec = _spec(case)
    exact = reference_with_grads(q, k, v, dout, spec)
    plain = reference_with_grads(q, k, v, dout, spec, dtype=torch.float16)
    got = _run(q, k, v, dout, case)
    assert got[0].dtype == torch.float16
    for name, g, p, e in zip(("out", "lse", "dq", "dk", "dv"), got, plain, exact):
        assert max_err(g, e) <= 2 * max_err(p, e) + 1e-6, f"{name}: {max_err(g, e):.3g} vs {max_err(p, e):.3g}"


def test_triton_gradient_through_lse():
    q, k, v, dout = random_qkv(7, 1, 21, 21, 2, 1, 16)
    weight = torch.randn(1, 2, 21)
    grads = []
    for backend in ("triton", "reference"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out, lse = flash_attn_func(*leaves, causal=True, return_lse=True, backend=backend)
        ((out * dout).sum() + (lse * weight).sum()).backward()
        grads.append([x.grad for x in leaves])
    for a, b in zip(*grads):
        assert max_err(a, b) < 2e-5


def test_triton_rejects_float64():
    q = torch.randn(1, 4, 1, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="float16, bfloat16 and float32"):
        flash_attn_func(q, q, q, backend="triton")
