"""Attention over a paged KV cache: every path (gathered blockwise / native, fixed-tile invariant, Triton under
the interpreter) against the float64 oracle, on shuffled block tables with decodes and prefill chunks."""

from __future__ import annotations

import pytest
import torch

from ringmoe.attention import AttentionSpec, attention_reference
from ringmoe.attention.paged import paged_attention

PAGE = 4
# (new queries, cached context) per sequence: a decode, a whole prompt, a chunk in the middle, odd lengths
SEQUENCES = [(1, 9), (13, 13), (5, 22), (1, 1), (7, 30)]


def _paged_case(seed, heads=4, kv_heads=2, dim=16, dtype=torch.float32, sequences=SEQUENCES):
    gen = torch.Generator().manual_seed(seed)
    pages_needed = sum(-(-ctx // PAGE) for _, ctx in sequences)
    num_blocks = pages_needed + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()  # blocks scattered over the cache
    k_cache = torch.randn(num_blocks, PAGE, kv_heads, dim, generator=gen, dtype=torch.float64)
    v_cache = torch.randn(num_blocks, PAGE, kv_heads, dim, generator=gen, dtype=torch.float64)
    tables, cu, contexts = [], [0], []
    for n, ctx in sequences:
        tables.append([order.pop() for _ in range(-(-ctx // PAGE))])
        cu.append(cu[-1] + n)
        contexts.append(ctx)
    q = torch.randn(cu[-1], heads, dim, generator=gen, dtype=torch.float64)
    cast = lambda x: x.to(dtype)  # noqa: E731
    args = (cast(q), cast(k_cache), cast(v_cache), cu, contexts, tables)
    return args, _oracle(q, k_cache, v_cache, cu, contexts, tables, torch.float64)


def _oracle(q, k_cache, v_cache, cu, contexts, tables, compute_dtype):
    """Naive attention per sequence over its gathered pages, computed in ``compute_dtype``."""
    out = []
    for b, ctx in enumerate(contexts):
        k = k_cache[tables[b]].flatten(0, 1)[:ctx]
        v = v_cache[tables[b]].flatten(0, 1)[:ctx]
        o, _ = attention_reference(q[None, cu[b]:cu[b + 1]], k[None], v[None],
                                   AttentionSpec(q.shape[-1] ** -0.5, causal=True), compute_dtype=compute_dtype)
        out.append(o[0])
    return torch.cat(out).double()


@pytest.mark.parametrize("backend, deterministic", [("blockwise", False), ("auto", False), ("auto", True)])
def test_paged_paths_match_the_float64_oracle(backend, deterministic):
    args, want = _paged_case(1)
    got = paged_attention(*args, backend=backend, deterministic=deterministic)
    assert (got.double() - want).abs().max() < 2e-6


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1",
                    reason="needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # the interpreter mangles bfloat16 loads
def test_triton_paged_kernel_matches_the_oracle(dtype):
    pytest.importorskip("triton")
    args, want = _paged_case(2, heads=6, kv_heads=2, dim=24, dtype=dtype)
    got = paged_attention(*args, backend="triton")
    err = (got.double() - want).abs().max().item()
    if dtype == torch.float32:
        assert err < 2e-6
    else:  # flash-attn's rule: at most twice the error of plain attention in the same precision
        plain = _oracle(*args, compute_dtype=dtype)
        assert err <= 2 * (plain - want).abs().max().item()


@pytest.mark.parametrize("batch_decodes", [True, False])
@pytest.mark.parametrize("window", [(-1, -1), (3, 0), (40, 0)])
def test_windows_sinks_and_batched_decodes_match_the_oracle(window, batch_decodes):
    """Decodes (one new token) of several contexts together, prompt chunks, a dropped (-1) table entry
    under a window, and sinks, against the float64 reference per sequence."""
    gen = torch.Generator().manual_seed(5)
    sequences = [(1, 9), (1, 17), (6, 14), (1, 1), (1, 30)]
    heads, kv_heads, dim = 4, 2, 16
    num_blocks = sum(-(-ctx // PAGE) for _, ctx in sequences) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    k_cache = torch.randn(num_blocks, PAGE, kv_heads, dim, generator=gen, dtype=torch.float64)
    v_cache = torch.randn(num_blocks, PAGE, kv_heads, dim, generator=gen, dtype=torch.float64)
    tables = [[order.pop() for _ in range(-(-ctx // PAGE))] for _, ctx in sequences]
    cu = [0]
    for n, _ in sequences:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], heads, dim, generator=gen, dtype=torch.float64)
    sinks = torch.randn(heads, generator=gen, dtype=torch.float64)
    spec = AttentionSpec(dim**-0.5, causal=True, window_left=window[0])
    want = []
    for b, (n, ctx) in enumerate(sequences):
        k = k_cache[tables[b]].flatten(0, 1)[:ctx]
        v = v_cache[tables[b]].flatten(0, 1)[:ctx]
        want.append(attention_reference(q[None, cu[b]:cu[b + 1]], k[None], v[None], spec, sinks=sinks)[0][0])
    if window == (3, 0):
        tables[4][0] = -1  # positions 0-3 of a 30-token context: outside a 4-token window, given back
    got = paged_attention(q, k_cache, v_cache, cu, [c for _, c in sequences], tables, window_size=window,
                          sinks=sinks, batch_decodes=batch_decodes)
    assert (got - torch.cat(want)).abs().max() < 1e-12


def test_stale_nan_in_a_block_never_reaches_another_sequence():
    """Slots past a sequence's context (a partly filled last block, padding of a batched decode) may hold what a
    request that produced NaN left there: they must add exact zeros, not NaN."""
    # three decodes batched in one call (contexts within 25% + a block), padded to the longest; and a prompt
    (q, k_cache, v_cache, cu, contexts, tables), want = _paged_case(4, sequences=[(1, 9), (1, 11), (1, 12), (6, 6)])
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    for table, ctx in zip(tables, contexts):
        k_cache.view(-1, *k_cache.shape[2:])[[table[-1] * PAGE + i for i in range(ctx % PAGE or PAGE, PAGE)]] = \
            float("nan")
        v_cache.view(-1, *v_cache.shape[2:])[[table[-1] * PAGE + i for i in range(ctx % PAGE or PAGE, PAGE)]] = \
            float("nan")
    free = sorted(set(range(k_cache.shape[0])) - {b for t in tables for b in t})
    k_cache[free], v_cache[free] = float("nan"), float("nan")  # blocks no sequence owns (batched-decode padding)
    got = paged_attention(q, k_cache, v_cache, cu, contexts, tables, backend="blockwise")
    assert torch.isfinite(got).all()
    assert (got.double() - want).abs().max() < 1e-5
