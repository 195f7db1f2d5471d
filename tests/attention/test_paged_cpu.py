"""The C decode attention over the paged cache (``ringmoe::paged_cached_attention``) against a float64 oracle: GQA,
odd head dims and block sizes, windows, rows that see no key, NaN kept to its own row, bad tables refused, and the
operator inside a compiled graph; its C kernel on the dispatcher (``torch_ops.c``) equal to the Python one, holding
no reference after a call or an error; ``paged_decode``'s compiled form through it within the flash-attn rule."""

from __future__ import annotations

import pytest
import torch

from ringmoe import panel_gemm
from ringmoe.attention.paged import paged_decode
from ringmoe.attention import paged_cpu
from ringmoe.attention.paged_cpu import applies, paged_cached_attention

pytestmark = pytest.mark.skipif(not panel_gemm.available(), reason="needs x86-64 with AVX2 and a C compiler")


def _case(seed, n, heads, kv_heads, dim, block_size, width, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    blocks = n * width + 3
    k_cache = torch.randn(blocks, block_size, kv_heads, dim, generator=gen, dtype=torch.float64)
    v_cache = torch.randn(blocks, block_size, kv_heads, dim, generator=gen, dtype=torch.float64)
    q = torch.randn(n, heads, dim, generator=gen, dtype=torch.float64)
    tables = torch.randperm(blocks, generator=gen)[: n * width].view(n, width)  # blocks scattered over the cache
    last = torch.randint(0, width * block_size + 1, (n,), generator=gen)
    first = torch.minimum(torch.randint(0, width * block_size, (n,), generator=gen), last)
    return q, k_cache, v_cache, tables, first, last


def _oracle(q, k_cache, v_cache, tables, first, last, scale):
    """Per row and head, softmax over the positions [first, last) of the row's gathered blocks, in float64."""
    n, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    out = torch.zeros(n, heads, dim, dtype=torch.float64)
    lse = torch.full((n, heads), float("-inf"), dtype=torch.float64)
    for r in range(n):
        keys = k_cache[tables[r]].flatten(0, 1)[first[r]:last[r]]
        values = v_cache[tables[r]].flatten(0, 1)[first[r]:last[r]]
        if keys.shape[0] == 0:
            continue
        for h in range(heads):
            kv = h // (heads // kv_heads)
            scores = keys[:, kv] @ q[r, h] * scale
            lse[r, h] = torch.logsumexp(scores, 0)
            out[r, h] = torch.softmax(scores, 0) @ values[:, kv]
    return out, lse


@pytest.mark.parametrize("seed,n,heads,kv_heads,dim,block_size,width",
                         [(0, 5, 8, 2, 32, 16, 4), (1, 3, 4, 4, 20, 7, 5), (2, 7, 6, 3, 64, 16, 3),
                          (3, 1, 2, 1, 9, 1, 13), (4, 4, 12, 4, 128, 8, 2),
                          # head dims of 8-float vectors but not of 32-float chunks, an odd and a single head per K/V
                          # head, blocks of several 8-key groups and a remainder
                          (5, 9, 10, 2, 40, 32, 3), (6, 4, 2, 2, 24, 12, 4)])
def test_the_kernel_matches_the_float64_oracle(seed, n, heads, kv_heads, dim, block_size, width):
    q, k_cache, v_cache, tables, first, last = _case(seed, n, heads, kv_heads, dim, block_size, width)
    scale = dim**-0.5
    out, lse = paged_cached_attention(q.float(), k_cache.float(), v_cache.float(), tables, first, last, scale)
    want_out, want_lse = _oracle(q, k_cache, v_cache, tables, first, last, scale)
    seen = last > first
    assert (out[~seen] == 0).all() and torch.isneginf(lse[~seen]).all()  # no key: a zero output, lse -inf, no NaN
    torch.testing.assert_close(out.double(), want_out, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(lse.double()[seen], want_lse[seen], atol=2e-6, rtol=2e-6)


def test_a_nan_stays_in_its_own_row_and_unread_slots_are_never_read():
    q, k_cache, v_cache, tables, _, _ = _case(5, 3, 4, 2, 16, 4, 3)
    first = torch.tensor([0, 0, 2])
    last = torch.tensor([5, 12, 9])
    k_cache, v_cache = k_cache.float(), v_cache.float()
    k_cache[tables[0, 1], 3] = float("nan")  # row 0 sees positions 0-4: block 1 slot 0 only; slot 3 unseen
    v_cache[tables[2, 0], 0] = float("nan")  # row 2 starts at position 2: slot 0 of its first block unseen
    out, lse = paged_cached_attention(q.float(), k_cache, v_cache, tables, first, last, 0.25)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    k_cache[tables[1, 2], 1] = float("nan")  # row 1 sees every position: its result is NaN, the others' are not
    out, lse = paged_cached_attention(q.float(), k_cache, v_cache, tables, first, last, 0.25)
    assert torch.isnan(out[1]).all() and torch.isnan(lse[1]).all()
    assert torch.isfinite(out[[0, 2]]).all() and torch.isfinite(lse[[0, 2]]).all()


def test_bad_tables_ranges_and_dtypes_are_refused():
    q, k_cache, v_cache, tables, first, last = _case(6, 2, 4, 2, 16, 4, 3)
    q, k_cache, v_cache = q.float(), k_cache.float(), v_cache.float()
    outside = tables.clone()
    outside[0, 0] = k_cache.shape[0]
    with pytest.raises(RuntimeError, match="outside the cache"):
        paged_cached_attention(q, k_cache, v_cache, outside, torch.zeros(2, dtype=torch.long),
                               torch.full((2,), 12, dtype=torch.long), 0.25)
    with pytest.raises(RuntimeError, match="outside the cache"):  # a range past the table's width
        paged_cached_attention(q, k_cache, v_cache, tables, first, torch.full((2,), 13, dtype=torch.long), 0.25)
    with pytest.raises(ValueError, match="do not fit"):
        paged_cached_attention(q.double(), k_cache, v_cache, tables, first, last, 0.25)
    with pytest.raises(ValueError, match="do not fit"):
        paged_cached_attention(q, k_cache, v_cache, tables.int(), first, last, 0.25)
    assert not applies(q.double(), k_cache.double(), v_cache.double())


def _storage_uses(tensor: torch.Tensor) -> int:
    """References to the tensor itself (a kernel's handle is one) and to its storage."""
    return tensor._use_count(), torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


@pytest.mark.skipif(not paged_cpu.native(), reason="torch's C shim cannot register the kernel here")
def test_the_c_kernel_on_the_dispatcher_equals_the_python_kernel_and_keeps_no_reference():
    """The operator's CPU kernel registered from C: bit-equal to the Python kernel (which calls the same C code
    through ctypes) on GQA, windows and empty rows; every tensor handle it was given released, after a result and
    after an error (a kept handle would keep the tensor alive: its use count grows)."""
    assert torch._C._dispatch_has_kernel_for_dispatch_key("ringmoe::paged_cached_attention", "CPU")
    operator = torch.ops.ringmoe.paged_cached_attention.default
    for seed, shape in enumerate([(5, 8, 2, 32, 16, 4), (3, 6, 3, 40, 7, 5), (1, 2, 1, 9, 1, 13)]):
        q, k_cache, v_cache, tables, first, last = _case(20 + seed, *shape)
        args = (q.float(), k_cache.float(), v_cache.float(), tables, first, last)
        before = [_storage_uses(t) for t in args]
        got = operator(*args, 0.3)
        want = paged_cpu._paged_cached_attention(*args, 0.3)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=0, rtol=0)
        del got
        assert [_storage_uses(t) for t in args] == before
    outside = tables.clone()
    outside[0, 0] = k_cache.shape[0]  # read: row 0 attends from position 0
    args = (q.float(), k_cache.float(), v_cache.float(), outside, torch.zeros_like(first), last.clamp(min=1))
    before = [_storage_uses(t) for t in args]
    with pytest.raises(RuntimeError, match="outside the cache"):
        operator(*args, 0.3)
    with pytest.raises(RuntimeError, match="contiguous float32"):  # the operator called directly: its own checks
        operator(args[0].double(), *args[1:], 0.3)
    assert [_storage_uses(t) for t in args] == before


def test_the_operator_in_a_compiled_graph_equals_its_eager_call():
    q, k_cache, v_cache, tables, first, last = _case(7, 4, 8, 2, 32, 16, 3)
    args = (q.float(), k_cache.float(), v_cache.float(), tables, first, last)

    def attend(q, k_cache, v_cache, tables, first, last):
        out, lse = paged_cached_attention(q * 1.0, k_cache, v_cache, tables, first, last, 0.125)
        return out * 2.0, lse

    compiled = torch.compile(attend, fullgraph=True, dynamic=True)  # one node: no graph break
    for got, want in zip(compiled(*args), attend(*args)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("window", [-1, 6])
def test_paged_decode_through_the_kernel_keeps_the_flash_attn_rule(window):
    """The compiled decode step's attention (by_block, new keys merged, drafts seeing each other) in float32 through
    the kernel: its error vs float64 at most twice that of the same step in float32 tensor ops."""
    gen = torch.Generator().manual_seed(8)
    n, heads, kv_heads, dim, block_size, width = 6, 8, 2, 32, 4, 6
    blocks = n * width + 2
    k_cache = torch.randn(blocks, block_size, kv_heads, dim, generator=gen, dtype=torch.float64)
    v_cache = torch.randn(blocks, block_size, kv_heads, dim, generator=gen, dtype=torch.float64)
    q = torch.randn(n, heads, dim, generator=gen, dtype=torch.float64)
    new = (torch.randn(n, kv_heads, dim, generator=gen, dtype=torch.float64),
           torch.randn(n, kv_heads, dim, generator=gen, dtype=torch.float64))
    tables = torch.randperm(blocks, generator=gen)[: n * width].view(n, width)
    # rows 1-3: one request's token and two drafts at consecutive positions; the others alone
    contexts = torch.tensor([3, 17, 18, 19, 24, 1])
    tables[2], tables[3] = tables[1], tables[1]
    fresh = torch.tensor([[True, False, False], [True, False, False], [True, True, False], [True, True, True],
                          [True, False, False], [True, False, False]])
    length = width * block_size

    def run(dtype, by_block):
        return paged_decode(q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), tables, contexts, length, window,
                            new=(new[0].to(dtype), new[1].to(dtype)), fresh=fresh, by_block=by_block)

    want = run(torch.float64, True)  # float64: tensor ops
    kernel = (run(torch.float32, True).double() - want).abs().max()
    plain = (run(torch.float32, False).double() - want).abs().max()
    assert kernel <= 2 * plain + 1e-7


def test_a_compiled_float32_decode_step_reads_the_cache_through_the_kernel():
    """The compiled decode graph of a float32 model on this CPU calls the operator, and its greedy tokens are the
    eager engine's."""
    from torch.profiler import ProfilerActivity, profile

    from ringmoe.model import MoETransformer, preset
    from ringmoe.serve import Engine, SamplingParams

    torch.manual_seed(0)
    model = MoETransformer(preset("tiny")).eval()
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in (5, 23, 40)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    eager = Engine(model, decode_graph="off", kv_cache_tokens=512).generate(prompts, params)
    engine = Engine(model, decode_graph="compiled", kv_cache_tokens=512, max_num_seqs=4)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        compiled = engine.generate(prompts, params)
    assert "ringmoe::paged_cached_attention" in {event.name for event in prof.events()}
    assert engine.runner.decode_graph.steps > 0
    assert [o.output_ids for o in compiled] == [o.output_ids for o in eager]
