"""flash_attn_func against the float64 oracle: every backend, mask, shape and dtype."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ringmoe import flash_attn_func
from ringmoe.attention import AttentionSpec
from ringmoe.attention.blockwise import blockwise_backward, blockwise_forward
from ringmoe.attention.native import native_unsupported
from tests.helpers import max_err, random_qkv, reference_with_grads

# (batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, causal, window, softcap)
CASES = [
    (1, 1, 1, 2, 1, 16, False, (-1, -1), 0.0),
    (2, 17, 17, 4, 4, 32, True, (-1, -1), 0.0),
    (1, 113, 203, 4, 2, 64, True, (-1, -1), 0.0),  # seqlen_q < seqlen_k, GQA
    (1, 203, 113, 6, 2, 40, True, (-1, -1), 0.0),  # seqlen_q > seqlen_k: first rows see no key
    (2, 203, 203, 4, 1, 64, False, (32, 0), 0.0),  # MQA, sliding window
    (1, 97, 131, 4, 2, 24, False, (16, 8), 10.0),  # two-sided window + softcap
    (1, 64, 300, 2, 1, 128, True, (-1, -1), 30.0),
    (1, 50, 37, 2, 2, 256, False, (-1, -1), 0.0),  # largest head_dim
    (1, 1023, 1023, 2, 2, 64, True, (-1, -1), 0.0),  # several 512-wide tiles
]
IDS = [f"B{c[0]}-q{c[1]}-k{c[2]}-h{c[3]}/{c[4]}-d{c[5]}-{'causal' if c[6] else 'full'}-w{c[7]}-cap{c[8]}" for c in CASES]


def _spec(case):
    _, _, _, _, _, d, causal, window, softcap = case
    return AttentionSpec(d**-0.5, causal, window[0], window[1], softcap)


def _assert_matches(got, want, atol):
    (out, lse, dq, dk, dv), (r_out, r_lse, r_dq, r_dk, r_dv) = got, want
    assert torch.equal(torch.isinf(lse), torch.isinf(r_lse)), "rows without keys must have lse -inf exactly"
    assert torch.isfinite(out).all() and torch.isfinite(dq).all() and torch.isfinite(dk).all()
    for name, a, b in (("out", out, r_out), ("lse", lse, r_lse), ("dq", dq, r_dq), ("dk", dk, r_dk), ("dv", dv, r_dv)):
        assert max_err(a, b) <= atol, f"{name}: max error {max_err(a, b):.3g} > {atol}"


def _api_run(q, k, v, dout, case, backend):
    _, _, _, _, _, _, causal, window, softcap = case
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = flash_attn_func(
        *leaves, causal=causal, window_size=window, softcap=softcap, return_lse=True, backend=backend
    )
    out.backward(dout)
    return out.detach(), lse, *(x.grad for x in leaves)


@pytest.mark.parametrize("dtype, atol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("backend", ["blockwise", "native", "auto", "reference"])
def test_matches_float64_reference(case, backend, dtype, atol):
    seed = hash((case, backend, str(dtype))) % 2**31
    q, k, v, dout = random_qkv(seed, *case[:6], dtype=dtype)
    spec = _spec(case)
    want = reference_with_grads(q, k, v, dout, spec)
    if backend == "native" and native_unsupported(q, k, spec):
        with pytest.raises(ValueError, match="native"):
            flash_attn_func(q, k, v, causal=case[6], window_size=case[7], softcap=case[8], backend="native")
        return
    got = _api_run(q, k, v, dout, case, backend)
    assert got[0].dtype == dtype and got[0].shape == q.shape
    assert got[1].shape == (q.shape[0], q.shape[2], q.shape[1])
    _assert_matches(got, want, atol)


@pytest.mark.parametrize("case", CASES[:8], ids=IDS[:8])
def test_blockwise_small_tiles(case):
    """Force 16 x 32 tiles so every tile kind (empty, full, partial, first-key) is hit."""
    q, k, v, dout = random_qkv(7 + CASES.index(case), *case[:6], dtype=torch.float64)
    spec = _spec(case)
    out, lse = blockwise_forward(q, k, v, spec, block_q=16, block_k=32)
    grads = blockwise_backward(dout, q, k, v, out, lse, spec, None, block_q=16, block_k=32)
    _assert_matches((out, lse, *grads), reference_with_grads(q, k, v, dout, spec), 1e-10)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", [CASES[2], CASES[4], CASES[6]], ids=[IDS[2], IDS[4], IDS[6]])
@pytest.mark.parametrize("backend", ["blockwise", "auto"])
def test_low_precision_within_twice_plain_pytorch(case, dtype, backend):
    """flash-attn's rule: error vs float64 <= 2 x the error of plain PyTorch attention in that dtype."""
    q, k, v, dout = random_qkv(11, *case[:6], dtype=dtype)
    spec = _spec(case)
    exact = reference_with_grads(q, k, v, dout, spec, dtype=torch.float64)
    plain = reference_with_grads(q, k, v, dout, spec, dtype=dtype)
    got = _api_run(q, k, v, dout, case, backend)
    assert got[0].dtype == dtype
    for name, g, p, e in zip(("out", "lse", "dq", "dk", "dv"), got, plain, exact):
        ours, theirs = max_err(g, e), max_err(p, e)
        assert ours <= 2 * theirs + 1e-6, f"{name}: ours {ours:.3g} vs plain {dtype} {theirs:.3g}"


@pytest.mark.parametrize("backend", ["blockwise", "native"])
def test_large_logits_stay_finite_and_exact(backend):
    """Scores of order 1e4 (q scaled up): no overflow, and the result is float64's up to float32 rounding.

    At |s| ~ 1e4 one float32 rounding of a score is ~1e-3, so any float32 kernel
    (plain PyTorch included) moves the output by O(eps32 * max|s| * max|v|).
    """
    q, k, v, dout = random_qkv(5, 1, 600, 600, 2, 2, 32, dtype=torch.float32, scale=1e4 / 32**0.5)
    spec = AttentionSpec(32**-0.5, True)
    got = _api_run(q, k, v, dout, (1, 600, 600, 2, 2, 32, True, (-1, -1), 0.0), backend)
    exact = reference_with_grads(q, k, v, dout, spec)
    max_score = exact[1][torch.isfinite(exact[1])].abs().max().item()
    assert max_score > 5e3
    bound = 8 * 2.0**-24 * max_score * v.abs().max().item()
    for name, g, e in zip(("out", "lse"), got, exact):
        assert torch.isfinite(g).all(), name
        assert max_err(g, e) <= bound * (1 if name == "out" else 1 / v.abs().max().item()), name
    for name, g in zip(("dq", "dk", "dv"), got[2:]):
        assert torch.isfinite(g).all(), name


def test_growing_scores_force_online_rescaling():
    """Keys whose scores grow by >100 per tile: the fast path overflows and the exact path rescales."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 40, 2, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 256, 2, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(1, 256, 2, 16, generator=gen, dtype=torch.float64)
    k = k * torch.linspace(1, 60, 256, dtype=torch.float64).view(1, -1, 1, 1)  # later keys dominate
    dout = torch.randn_like(q)
    spec = AttentionSpec(0.25)
    for dtype in (torch.float32, torch.float64):
        out, lse = blockwise_forward(q.to(dtype), k.to(dtype), v.to(dtype), spec, block_q=16, block_k=32)
        ref = reference_with_grads(q.to(dtype), k.to(dtype), v.to(dtype), dout, spec)
        assert torch.isfinite(out).all()
        assert max_err(out, ref[0]) < (1e-9 if dtype == torch.float64 else 1e-4)
        assert max_err(lse, ref[1]) / ref[1].abs().max().item() < 1e-6


@pytest.mark.parametrize("backend", ["blockwise", "reference", "native"])
def test_gradient_through_lse(backend):
    """A loss that uses lse too: d lse / d s = softmax, handled as delta - dlse."""
    q, k, v, dout = random_qkv(21, 2, 33, 33, 4, 2, 16, dtype=torch.float64)
    weight = torch.randn(2, 4, 33, dtype=torch.float64)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = flash_attn_func(*leaves, causal=True, return_lse=True, backend=backend)
    ((out * dout).sum() + (lse * weight).sum()).backward()
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    from ringmoe.attention import attention_reference

    r_out, r_lse = attention_reference(*ref_leaves, AttentionSpec(0.25, True))
    ((r_out * dout).sum() + (r_lse * weight).sum()).backward()
    for a, b in zip(leaves, ref_leaves):
        assert max_err(a.grad, b.grad) < 1e-10


def test_rows_without_keys_are_zero_not_nan():
    q, k, v, dout = random_qkv(2, 1, 20, 8, 2, 2, 16)
    for backend in ("blockwise", "native", "reference"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out, lse = flash_attn_func(*leaves, causal=True, return_lse=True, backend=backend)
        out.backward(dout)
        empty = 20 - 8  # bottom-right causal: rows 0..11 see no key
        assert torch.all(out[:, :empty] == 0) and torch.all(torch.isneginf(lse[:, :, :empty]))
        assert torch.isfinite(out).all() and all(torch.isfinite(x.grad).all() for x in leaves)
        assert torch.all(leaves[0].grad[:, :empty] == 0)


def test_window_that_excludes_everything():
    """A window (0, 0) with an offset that pushes it out of range: every row empty."""
    q, k, v, _ = random_qkv(4, 1, 5, 3, 1, 1, 8)
    out, lse = flash_attn_func(q, k, v, window_size=(0, 0), return_lse=True, backend="blockwise")
    # offset = 3 - 5 = -2: rows 0 and 1 see keys -2 and -1, which do not exist
    assert torch.all(out[:, :2] == 0) and torch.isneginf(lse[:, :, :2]).all()
    assert torch.isfinite(lse[:, :, 2:]).all()


def test_auto_picks_a_backend_for_every_option():
    q, k, v, _ = random_qkv(8, 1, 33, 47, 4, 2, 16)
    spec = AttentionSpec(16**-0.5, True, 5, 0, 3.0)
    want = reference_with_grads(q, k, v, torch.ones_like(q), spec)[0]
    got = flash_attn_func(q, k, v, causal=True, window_size=(5, 0), softcap=3.0)
    assert max_err(got, want) < 2e-5


@settings(max_examples=30, deadline=None)
@given(
    batch=st.integers(1, 2),
    seqlen_q=st.integers(1, 70),
    seqlen_k=st.integers(1, 70),
    kv_heads=st.integers(1, 2),
    group=st.integers(1, 3),
    head_dim=st.sampled_from([1, 8, 24]),
    causal=st.booleans(),
    left=st.integers(-1, 20),
    right=st.integers(-1, 20),
    softcap=st.sampled_from([0.0, 2.0]),
    block=st.sampled_from([(4, 8), (16, 16), (64, 32)]),
    seed=st.integers(0, 2**31 - 1),
)
def test_blockwise_property(batch, seqlen_q, seqlen_k, kv_heads, group, head_dim, causal, left, right, softcap, block, seed):
    q, k, v, dout = random_qkv(seed, batch, seqlen_q, seqlen_k, kv_heads * group, kv_heads, head_dim, torch.float64)
    spec = AttentionSpec(head_dim**-0.5, causal, left, right, softcap)
    out, lse = blockwise_forward(q, k, v, spec, *block)
    grads = blockwise_backward(dout, q, k, v, out, lse, spec, None, *block)
    _assert_matches((out, lse, *grads), reference_with_grads(q, k, v, dout, spec), 1e-10)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda q, k, v: (q[0], k, v), ValueError, "q must be 4-D"),
        (lambda q, k, v: (q, k.double(), v), ValueError, "share a dtype"),
        (lambda q, k, v: (q.int(), k, v), ValueError, "q must be float16"),
        (lambda q, k, v: (q, k[:, :, :1].expand(-1, -1, 3, -1), v[:, :, :1].expand(-1, -1, 3, -1)), ValueError, "multiple"),
        (lambda q, k, v: (q, k, v[:, :5]), ValueError, "same shape"),
        (lambda q, k, v: (q, k[..., :8], v[..., :8]), ValueError, "head_dim"),
        (lambda q, k, v: (q[:1], k, v), ValueError, "batch"),
        (lambda q, k, v: ([1.0], k, v), TypeError, "q must be a torch.Tensor"),
    ],
)
def test_bad_inputs_name_the_argument(change, error, match):
    q, k, v, _ = random_qkv(1, 2, 9, 9, 4, 2, 16)
    with pytest.raises(error, match=match):
        flash_attn_func(*change(q, k, v))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"window_size": (-2, 0)}, "window_size"),
        ({"window_size": (1,)}, "window_size"),
        ({"softcap": -1.0}, "softcap"),
        ({"softmax_scale": float("nan")}, "softmax_scale"),
        ({"backend": "cuda"}, "backend"),
    ],
)
def test_bad_options_name_the_argument(kwargs, match):
    q, k, v, _ = random_qkv(1, 1, 9, 9, 2, 2, 16)
    with pytest.raises(ValueError, match=match):
        flash_attn_func(q, k, v, **kwargs)


def test_head_dim_over_256_rejected():
    q = torch.randn(1, 4, 1, 257)
    with pytest.raises(ValueError, match="head_dim"):
        flash_attn_func(q, q, q)
