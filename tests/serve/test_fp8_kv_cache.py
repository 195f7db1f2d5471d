"""The FP8 KV cache (``kv_cache_dtype="fp8"``): e4m3 codes with per-layer scales, one byte per cached value.

Its error follows flash-attn's rule for low precision: against the float64 oracle on the exact K/V, attention
over the FP8 cache errs at most twice as much as plain PyTorch attention on K/V cast to float8_e4m3fn (scale 1) in
float32: per kernel (the gathered paged path, the batched decodes, the fixed-shape decode, the Triton kernel) and
per model (teacher-forced logits of what the engine generated, for a GQA MoE, gpt-oss's windows and sinks, and
DeepSeek-V3's latent cache).  The compiled decode step and meshes compute what the eager one-process engine does.
"""

from __future__ import annotations

import os

import pytest
import torch

from ringmoe.attention import AttentionSpec, attention_reference, flash_attn_func
from ringmoe.attention.paged import paged_attention, paged_decode
from ringmoe.float8 import FP8_MAX, decode_e4m3, encode_e4m3
from ringmoe.model import MoETransformer, preset
from ringmoe.serve import Engine, SamplingParams
from ringmoe.serve.kv_scales import HEADROOM, calibrate_kv_scales, kv_cache_is_fp8


def test_every_code_decodes_as_torch_float8_does():
    codes = torch.arange(256, dtype=torch.uint8)
    scale = torch.tensor(0.375)
    want = codes.view(torch.float8_e4m3fn).to(torch.float64) * 0.375
    got = decode_e4m3(codes, scale, torch.float64)
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.isnan(got).sum() == 2  # 0x7F, 0xFF
    assert torch.equal(got[~torch.isnan(got)], want[~torch.isnan(want)])


def test_encoding_rounds_to_the_nearest_code_and_saturates():
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(20000, generator=gen, dtype=torch.float64) * torch.rand(20000, generator=gen,
                                                                             dtype=torch.float64) * 40
    scale = torch.tensor(0.05)
    decoded = decode_e4m3(encode_e4m3(x, scale), scale, torch.float64)
    grid = decode_e4m3(torch.arange(256, dtype=torch.uint8), scale, torch.float64)
    grid = grid[~torch.isnan(grid)]
    limit = FP8_MAX * scale.item()  # the float32 scale's exact value
    inside = x.abs() <= limit
    nearest = (x[inside, None] - grid).abs().min(dim=1).values
    assert torch.equal((decoded[inside] - x[inside]).abs(), nearest)   # no code is closer
    assert inside.sum() > 1000 and (~inside).sum() > 100
    assert torch.equal(decoded[~inside], torch.sign(x[~inside]) * limit)  # saturated, never NaN
    special = decode_e4m3(encode_e4m3(torch.tensor([float("nan"), 1e30, -1e30]), scale), scale, torch.float64)
    assert torch.isnan(special[0]) and special[1] == limit and special[2] == -limit


def test_names_of_the_cache_dtype():
    assert kv_cache_is_fp8("fp8") and kv_cache_is_fp8("fp8_e4m3") and not kv_cache_is_fp8("auto")
    with pytest.raises(ValueError, match="fp8_e5m2"):
        kv_cache_is_fp8("fp8_e5m2")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        Engine(MoETransformer(preset("tiny")), kv_cache_dtype="int8")


# -- kernels --------------------------------------------------------------------------------------------------

def _plain_fp8(x: torch.Tensor) -> torch.Tensor:
    """What plain PyTorch does with an fp8 tensor: cast (scale 1), compute in float32."""
    return x.to(torch.float8_e4m3fn).to(torch.float32)


def _reference(q, k, v, window_left, sinks, dtype):
    """Bottom-right causal attention of one sequence: q (n, H, D), k, v (ctx, Hkv, D) -> (n, H, D) in dtype."""
    spec = AttentionSpec(q.shape[-1] ** -0.5, causal=True, window_left=window_left)
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1)[None].to(dtype) for t in (k, v))
    out, _ = attention_reference(q[None].to(dtype), k, v, spec, compute_dtype=dtype,
                                 sinks=None if sinks is None else sinks.to(dtype))
    return out[0]


def _paged_case(seed, heads, kv_heads, dim, lengths, block=8, magnitude=3.0):
    """Sequences of (new tokens, context) with their K/V scattered over shuffled blocks of an FP8 cache."""
    gen = torch.Generator().manual_seed(seed)
    keys = [torch.randn(ctx, kv_heads, dim, generator=gen, dtype=torch.float64) * magnitude for _, ctx in lengths]
    values = [torch.randn(ctx, kv_heads, dim, generator=gen, dtype=torch.float64) * magnitude for _, ctx in lengths]
    queries = [torch.randn(n, heads, dim, generator=gen, dtype=torch.float64) for n, _ in lengths]
    k_scale = torch.tensor(HEADROOM * max(k.abs().max() for k in keys).item() / FP8_MAX, dtype=torch.float32)
    v_scale = torch.tensor(HEADROOM * max(v.abs().max() for v in values).item() / FP8_MAX, dtype=torch.float32)
    need = sum(-(-ctx // block) for _, ctx in lengths)
    order = torch.randperm(need + 3, generator=gen).tolist()
    k_cache = torch.randint(0, 255, (need + 3, block, kv_heads, dim), dtype=torch.uint8, generator=gen)  # stale bytes
    v_cache = torch.randint(0, 255, (need + 3, block, kv_heads, dim), dtype=torch.uint8, generator=gen)
    tables = []
    for k, v in zip(keys, values):
        table = [order.pop() for _ in range(-(-k.shape[0] // block))]
        for j in range(k.shape[0]):
            k_cache[table[j // block], j % block] = encode_e4m3(k[j], k_scale)
            v_cache[table[j // block], j % block] = encode_e4m3(v[j], v_scale)
        tables.append(table)
    return queries, keys, values, (k_scale, v_scale), k_cache, v_cache, tables


def _errors(outs, queries, keys, values, window_left, sinks):
    """(max error of ``outs``, max error of plain fp8 attention) against the float64 oracle on the exact K/V."""
    ours = plain = 0.0
    for out, q, k, v in zip(outs, queries, keys, values):
        exact = _reference(q, k, v, window_left, sinks, torch.float64)
        naive = _reference(q.float(), _plain_fp8(k), _plain_fp8(v), window_left,
                           None if sinks is None else sinks.float(), torch.float32)
        ours = max(ours, (out.double() - exact).abs().max().item())
        plain = max(plain, (naive.double() - exact).abs().max().item())
    return ours, plain


@pytest.mark.parametrize("seed, heads, kv_heads, dim, window_left, with_sinks, batch_decodes", [
    (1, 4, 2, 16, -1, False, True),
    (2, 6, 3, 24, -1, False, False),
    (3, 4, 1, 32, 9, True, True),
    (4, 2, 2, 8, 5, False, True),
])
def test_paged_attention_over_fp8_cache_within_twice_plain_fp8(seed, heads, kv_heads, dim, window_left, with_sinks,
                                                               batch_decodes):
    """Prompt chunks (gathered path) and decodes (batched ``paged_decode``), odd lengths, GQA, seqlen_q != k."""
    lengths = [(1, 37), (5, 50), (1, 1), (13, 13), (1, 44), (3, 9)]
    queries, keys, values, scales, k_cache, v_cache, tables = _paged_case(seed, heads, kv_heads, dim, lengths)
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    sinks = sinks if with_sinks else None
    cu = [0]
    for n, _ in lengths:
        cu.append(cu[-1] + n)
    out = paged_attention(torch.cat(queries).float(), k_cache, v_cache, cu, [c for _, c in lengths], tables,
                          backend="blockwise", window_size=(window_left, 0),
                          sinks=None if sinks is None else sinks.float(), batch_decodes=batch_decodes, kv_scales=scales)
    outs = [out[a:b] for a, b in zip(cu, cu[1:])]
    ours, plain = _errors(outs, queries, keys, values, window_left, sinks)
    assert 0 < ours <= 2 * plain, (ours, plain)


@pytest.mark.parametrize("seed, window_left", [(5, -1), (6, 7)])
def test_fixed_shape_decode_over_fp8_cache_within_twice_plain_fp8(seed, window_left):
    """``paged_decode`` as the compiled step runs it: the cache read with the row's own K/V joined (``new``) as
    its e4m3 round trip: equal to reading it back from the cache, and within the rule."""
    lengths = [(1, 21), (1, 1), (1, 40), (1, 17)]
    queries, keys, values, scales, k_cache, v_cache, tables = _paged_case(seed, 4, 2, 16, lengths)
    width = max(len(t) for t in tables)
    index = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    contexts = torch.tensor([c for _, c in lengths])
    q = torch.cat(queries).float()
    read_back = paged_decode(q, k_cache, v_cache, index, contexts, width * 8, window_left, kv_scales=scales)
    own = [decode_e4m3(encode_e4m3(torch.stack([x[-1] for x in t]), s), s, torch.float32)  # (rows, Hkv, D)
           for t, s in ((keys, scales[0]), (values, scales[1]))]
    joined = paged_decode(q, k_cache, v_cache, index, contexts, width * 8, window_left, new=(own[0], own[1]),
                          kv_scales=scales)
    torch.testing.assert_close(joined, read_back, rtol=0, atol=1e-5)
    ours, plain = _errors([joined[i:i + 1] for i in range(len(lengths))], queries, keys, values, window_left, None)
    assert 0 < ours <= 2 * plain, (ours, plain)


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs a GPU or TRITON_INTERPRET=1")
def test_triton_paged_kernel_decodes_fp8_cache_in_place():
    pytest.importorskip("triton")
    lengths = [(1, 19), (4, 30), (2, 2)]
    queries, keys, values, scales, k_cache, v_cache, tables = _paged_case(7, 4, 2, 16, lengths)
    cu = [0, 1, 5, 7]
    out = paged_attention(torch.cat(queries).float(), k_cache, v_cache, cu, [c for _, c in lengths], tables,
                          backend="triton", kv_scales=scales)
    gathered = paged_attention(torch.cat(queries).float(), k_cache, v_cache, cu, [c for _, c in lengths], tables,
                               backend="blockwise", kv_scales=scales)
    torch.testing.assert_close(out, gathered, rtol=0, atol=1e-5)
    ours, plain = _errors([out[a:b] for a, b in zip(cu, cu[1:])], queries, keys, values, -1, None)
    assert 0 < ours <= 2 * plain, (ours, plain)


# -- the engine ------------------------------------------------------------------------------------------------

class _PlainFp8Attention:
    """The model's attention with K/V (MLA: the latent and RoPE key) cast to float8_e4m3fn and back: plain PyTorch
    on an fp8 cache."""

    latent_ring = False

    def __init__(self, model, absorbed):
        self.model, self.absorbed = model, absorbed

    def attend(self, layer, q, k, v):
        k, v = _plain_fp8(k).to(q.dtype), _plain_fp8(v).to(q.dtype)
        return flash_attn_func(q, k, v, causal=True, **self.model.attention_options(layer))


def _model(name, seed=0):
    model = MoETransformer(preset(name))
    model.init_weights(seed, std=0.2)
    return model


def _generate(model, prompts, new, **options):
    engine = Engine(model, return_logits=True, **options)
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)) for p in prompts]
    outputs = {i: [] for i in ids}
    while engine.has_unfinished:
        for out in engine.step():
            outputs[out.request_id].append(out)
    engine.blocks.check_integrity()
    return [outputs[i][-1].output_ids for i in ids], [torch.stack([o.logits for o in outputs[i]]) for i in ids], engine


def _teacher_forced(model, prompts, tokens, attention=None):
    """The model's logits (float64) at the positions that drew ``tokens`` after each prompt."""
    rows = []
    with torch.no_grad():
        for prompt, out in zip(prompts, tokens):
            logits = model(torch.tensor([prompt + out[:-1]]), attention=attention)[0, len(prompt) - 1:]
            rows.append(logits.double())
    return rows


def _max_error(rows, want):
    return max((a.double() - b).abs().max().item() for a, b in zip(rows, want))


@pytest.mark.parametrize("family", ["tiny", "gpt-oss-tiny", "deepseek-v3-tiny"])
def test_engine_logits_over_fp8_cache_within_twice_plain_fp8(family):
    """Teacher-forced on what the fp8 engine generated (prefill chunks and decodes): its logits' error vs the float64
    model is at most twice that of the model run with plainly cast fp8 K/V; the float cache's is far smaller."""
    model = _model(family).float()
    exact = _model(family).double()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (7, 30, 19)]
    tokens, logits, engine = _generate(model, prompts, 10, kv_cache_dtype="fp8", max_num_batched_tokens=16,
                                       block_size=4)
    assert engine.runner.k_cache[0].dtype == torch.uint8
    ours = _max_error(logits, _teacher_forced(exact, prompts, tokens))
    plain = _max_error(_teacher_forced(model, prompts, tokens, _PlainFp8Attention(model, model.config.mla)),
                       _teacher_forced(exact, prompts, tokens))
    assert 0 < ours <= 2 * plain, (ours, plain)
    float_tokens, float_logits, _ = _generate(model, prompts, 10, block_size=4)
    float_cache = _max_error(float_logits, _teacher_forced(exact, prompts, float_tokens))
    assert float_cache < ours / 100  # the cache's format is what the error measures


def test_fp8_cache_scales_are_per_layer_and_fit_the_probe():
    model = _model("deepseek-v3-tiny").float()
    scales = calibrate_kv_scales(model, latent=True)
    assert len(scales) == model.config.num_layers
    assert all(k is v for k, v in scales) is False and all(torch.equal(k, v) for k, v in scales)  # one latent
    assert len({round(k.item(), 9) for k, _ in scales}) == model.config.num_layers  # measured per layer
    again = calibrate_kv_scales(model, latent=True)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(scales, again))  # a function of the weights


def test_fp8_cache_holds_four_times_the_tokens_of_float32():
    model = _model("tiny").float()
    float_engine = Engine(model, kv_cache_bytes=1 << 20)
    fp8_engine = Engine(model, kv_cache_bytes=1 << 20, kv_cache_dtype="fp8_e4m3")
    assert float_engine.runner.bytes_per_token == 4 * fp8_engine.runner.bytes_per_token
    assert fp8_engine.blocks.num_blocks == 4 * float_engine.blocks.num_blocks
    cache = fp8_engine.runner.k_cache[0]
    assert cache.dtype == torch.uint8 and cache.element_size() == 1


@pytest.mark.parametrize("family, mode", [("tiny", "static"), ("gpt-oss-tiny", "static"),
                                          ("deepseek-v3-tiny", "static"),  # MLA: FP8 latents
                                          pytest.param("tiny", "compiled", marks=pytest.mark.slow)])  # ~1 min
def test_decode_graph_over_fp8_cache_equals_eager(family, mode):
    """float64: logits of the fixed-shape step equal the eager step's to 1e-10 and the compiled step's to float32
    rounding of the logits (inductor's float64 step differs from the eager one at that level with a float cache
    too; one e4m3 code rounded the other way would move them by ~1e-3), tokens equal."""
    model = _model(family).double()
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (3, 17, 26)]
    eager = _generate(model, prompts, 9, kv_cache_dtype="fp8", decode_graph="off")
    graph = _generate(model, prompts, 9, kv_cache_dtype="fp8", decode_graph=mode, max_num_seqs=4)
    assert graph[2].runner.decode_graph.steps > 0
    assert graph[0] == eager[0]
    for a, b in zip(eager[1], graph[1]):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-10 if mode == "static" else 1e-5)


def test_serve_kv_cache_dtype_flag(served_checkpoint):
    """`ringmoe serve --kv-cache-dtype fp8` over HTTP with the openai client: the greedy answers of the in-process
    engine with an FP8 cache; names ringmoe does not implement are refused naming the flag."""
    from ringmoe.serve.service import ServeOptions, validate
    from tests.served import served_greedy_texts

    with pytest.raises(ValueError, match="--kv-cache-dtype 'fp8_e5m2' is not supported"):
        validate(ServeOptions(model=str(served_checkpoint), kv_cache_dtype="fp8_e5m2", kv_cache_tokens=64))
    prompts, params = ["def add(a, b):", "class Stack:"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.text for o in Engine.from_checkpoint(served_checkpoint, kv_cache_dtype="fp8",
                                                   kv_cache_tokens=256).generate(prompts, params)]
    assert served_greedy_texts(served_checkpoint, ("--kv-cache-dtype", "fp8"), prompts, 12) == want
