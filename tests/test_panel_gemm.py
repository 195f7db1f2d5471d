"""``ringmoe.panel_gemm``: the grouped product of few rows by panel-packed weight stacks, against float64."""

from __future__ import annotations

import shutil
import subprocess
from copy import deepcopy

import pytest
import torch

from ringmoe import panel_gemm
from ringmoe.model import MoETransformer, preset
from ringmoe.moe.dispatch import permute, plan_dispatch, unpermute
from ringmoe.moe.experts import SwiGLUExperts
from ringmoe.moe.layer import DENSE_BELOW, GATHERED_PER_EXPERT, MoELayer
from ringmoe.prepacked import prepack_module
from ringmoe.serve import Engine, SamplingParams

pytestmark = pytest.mark.skipif(not panel_gemm.available(), reason="panel_gemm runs on x86-64 with AVX2 and a compiler")


def _reference(x: torch.Tensor, counts: list[int], w: torch.Tensor) -> torch.Tensor:
    """float64 rows of each group times its matrix's transpose: (R, N)."""
    parts = x.double().split(counts)
    return torch.cat([part @ w[g].double().T for g, part in enumerate(parts)]) if parts else x.new_zeros(0)


@pytest.mark.parametrize("seed, groups, n, k", [(1, 3, 50, 37), (2, 1, 16, 64), (3, 5, 7, 3), (4, 4, 33, 130),
                                                 (5, 2, 1, 1), (6, 8, 64, 300), (7, 2, 17, 65)])
def test_grouped_products_match_float64_within_torchs_own_error(seed, groups, n, k):
    """Odd widths (edge panels of 1..15 columns), sums over k shorter and longer than a block, groups of 0..13 rows
    (every row kernel and several blocks of rows): the error vs float64 is at most twice torch's float32 error."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(groups, n, k, generator=gen)
    counts = torch.randint(0, 14, (groups,), generator=gen).tolist()
    counts[0] = 0 if groups > 1 else 11  # a group without rows
    counts[-1] = counts[-1] or 4
    x = torch.randn(sum(counts), k, generator=gen)
    got = panel_gemm.grouped_linear(x, counts, panel_gemm.pack(w), n)
    ref = _reference(x, counts, w)
    plain = torch.cat([part @ w[g].T for g, part in enumerate(x.split(counts))])
    assert got.shape == (sum(counts), n) and got.dtype == torch.float32
    plain_error = (plain.double() - ref).abs().max().item()
    assert (got.double() - ref).abs().max().item() <= 2 * plain_error + 1e-6 * ref.abs().max().item()


def test_a_long_sum_is_as_accurate_as_torchs():
    """K = 2048: the sum over k runs in blocks, so its error stays within torch's (a plain running sum was 3-5x)."""
    torch.manual_seed(0)
    w, x = torch.randn(2, 40, 2048), torch.randn(12, 2048)
    got = panel_gemm.grouped_linear(x, [5, 7], panel_gemm.pack(w), 40)
    ref = _reference(x, [5, 7], w)
    plain = torch.cat([x[:5] @ w[0].T, x[5:] @ w[1].T])
    assert (got.double() - ref).abs().max() <= 2 * (plain.double() - ref).abs().max()


def test_each_row_gets_the_same_bits_whatever_rows_are_beside_it_and_whatever_the_threads():
    """Batch invariance: a row alone, or among 1..13 others of its group, or under 1 or 2 threads, same bits."""
    torch.manual_seed(3)
    w = torch.randn(2, 70, 96)
    packed = panel_gemm.pack(w)
    x = torch.randn(13, 96)
    alone = torch.cat([panel_gemm.grouped_linear(x[i:i + 1], [0, 1], packed, 70) for i in range(13)])
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for rows in (2, 6, 7, 13):
                together = panel_gemm.grouped_linear(x[:rows], [0, rows], packed, 70)
                assert torch.equal(together, alone[:rows])
    finally:
        torch.set_num_threads(threads)


def test_pack_keeps_the_weights_bytes_and_refuses_what_it_cannot_pack():
    w = torch.randn(3, 21, 10)
    assert panel_gemm.pack(w).shape == (3, 210)
    assert panel_gemm.pack(w[0]).shape == (1, 210)  # a matrix: one group
    assert sorted(panel_gemm.pack(w).flatten().tolist()) == sorted(w.flatten().tolist())  # the same values, moved
    with pytest.raises(TypeError, match="float32"):
        panel_gemm.pack(w.double())
    packed = panel_gemm.pack(w)
    with pytest.raises(ValueError, match="counts of 2 groups"):
        panel_gemm.grouped_linear(torch.randn(4, 10), [2, 2], packed, 21)
    with pytest.raises(ValueError, match=r"not of \(20, 10\)"):
        panel_gemm.grouped_linear(torch.randn(4, 10), [1, 1, 2], packed, 20)
    assert panel_gemm.grouped_linear(torch.randn(0, 10), [0, 0, 0], packed, 21).shape == (0, 21)


def test_a_profile_names_the_kernel_calls():
    """The calls are C, invisible to torch's profiler unless named: ``bench_decode``'s host-overhead share counts
    these names as compute."""
    layer = SwiGLUExperts(4, 16, 8)
    gate_up, down = panel_gemm.pack(layer.gate_up), panel_gemm.pack(layer.down)
    x = torch.randn(3, 16)
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        panel_gemm.grouped_linear(x, [1, 0, 2, 0], gate_up, 16)
        panel_gemm.routed_experts(x, torch.tensor([[0, 1], [2, 3], [3, 0]]), torch.rand(3, 2), gate_up, down, 8)
    names = {event.name for event in profile.events()}
    assert {"ringmoe::panel_grouped_linear", "ringmoe::panel_routed_experts"} <= names


def test_the_build_is_cached_by_source_and_a_failed_build_raises(tmp_path, monkeypatch):
    """A fresh cache folder gets one library (renamed from a staging folder, which is gone); a second call loads
    the same file without compiling; a source that does not compile raises (the caller then keeps torch's
    products)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    source = {path.name: path.read_bytes() for path in panel_gemm._SOURCES}
    compiler = "cc" if subprocess.run(["which", "cc"], capture_output=True).returncode == 0 else "gcc"
    first = panel_gemm._build(source, compiler)
    assert first.parent == tmp_path / "ringmoe" / "kernels" and first.is_file()
    stamp = first.stat().st_mtime_ns
    assert panel_gemm._build(source, compiler) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no staging folder left
    with pytest.raises(subprocess.CalledProcessError):
        panel_gemm._build({**source, "panel_gemm.c": source["panel_gemm.c"] + b"\nthis is not C;\n"}, compiler)
    assert [p.name for p in first.parent.iterdir()] == [first.name]
    blocked = tmp_path / "a file"  # a cache that cannot be made: the build goes to a private folder of its own
    blocked.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    private = panel_gemm._build(source, compiler)
    assert private.is_file() and private.name == first.name and private.parent.name.startswith("ringmoe-kernels-")
    assert private.parent.stat().st_mode & 0o077 == 0  # not a path another user could have prepared
    again = panel_gemm._build(source, compiler)
    shutil.rmtree(private.parent)
    shutil.rmtree(again.parent)
    assert again.parent != private.parent  # never reused from a shared place


def _routed_reference(experts: SwiGLUExperts, x, topk_idx, topk_weight):
    """The layer's torch path (sort, per-expert products, weighted sum) on copies in float64."""
    experts = deepcopy(experts).double()
    plan = plan_dispatch(topk_idx, topk_weight.double(), experts.num_experts, None)
    out = experts.grouped(permute(x.double(), plan, experts.num_experts), plan.counts.tolist())
    return unpermute(out, plan, topk_weight.double(), x.shape[0])


@pytest.mark.parametrize("seed, experts, hidden, ffn, tokens, k, bias, limit", [
    (1, 8, 96, 40, 13, 2, False, None), (2, 5, 37, 19, 1, 3, True, 7.0), (3, 4, 64, 64, 40, 1, True, None),
    (4, 16, 24, 11, 7, 4, False, 2.5)])
def test_the_routed_part_in_one_call_matches_float64(seed, experts, hidden, ffn, tokens, k, bias, limit):
    """``routed_experts`` (sort, gathers, products, activation with its own exp, weighted sum: all in C) against
    the torch path in float64: odd widths, one token, top-1..4, biases, gpt-oss's clamped activation with inputs
    past the clamp; within twice the float32 torch path's error; the counts are the assignments per expert."""
    torch.manual_seed(seed)
    layer = SwiGLUExperts(experts, hidden, ffn, bias=bias, limit=limit)
    if bias:
        with torch.no_grad():
            layer.gate_up_bias.normal_()
            layer.down_bias.normal_()
    x = 3 * torch.randn(tokens, hidden)  # large enough that the activation's clamp and tails are exercised
    topk_idx = torch.stack([torch.randperm(experts)[:k] for _ in range(tokens)])
    topk_weight = torch.rand(tokens, k)
    with torch.no_grad():
        y, counts = panel_gemm.routed_experts(x, topk_idx, topk_weight, panel_gemm.pack(layer.gate_up),
                                              panel_gemm.pack(layer.down), ffn, layer.gate_up_bias,
                                              layer.down_bias, limit, layer.alpha)
        plan = plan_dispatch(topk_idx, topk_weight, experts, None)
        plain = unpermute(layer.grouped(permute(x, plan, experts), plan.counts.tolist()), plan, topk_weight, tokens)
    ref = _routed_reference(layer, x, topk_idx, topk_weight)
    assert counts.tolist() == torch.bincount(topk_idx.flatten(), minlength=experts).tolist()
    plain_error = (plain.double() - ref).abs().max().item()
    assert (y.double() - ref).abs().max().item() <= 2 * plain_error + 1e-6 * ref.abs().max().item()


def test_the_routed_part_refuses_an_expert_index_out_of_range():
    layer = SwiGLUExperts(4, 16, 8)
    gate_up, down = panel_gemm.pack(layer.gate_up), panel_gemm.pack(layer.down)
    x, weight = torch.randn(3, 16), torch.rand(3, 2)
    for bad in (4, -1):
        with pytest.raises(ValueError, match=r"outside \[0, 4\)"):
            panel_gemm.routed_experts(x, torch.tensor([[0, 1], [2, bad], [3, 0]]), weight, gate_up, down, 8)
    with pytest.raises(ValueError, match="do not match"):
        panel_gemm.routed_experts(x, torch.tensor([[0, 1], [2, 3], [3, 0]]), weight.double(), gate_up, down, 8)


def test_a_prepacked_layer_runs_its_routed_part_in_one_call_with_the_same_output_and_statistics():
    """``MoELayer.forward`` on a CPU with panel copies: the fused call (its counts become ``last_stats``), the same
    output as the layer without copies; with gradients wanted, the torch path (the copies are not used)."""
    torch.manual_seed(5)
    layer = MoELayer(64, 32, num_experts=8, top_k=2).eval()
    x = torch.randn(2, 9, 64)
    with torch.no_grad():
        plain = layer(x)
        plain_stats = layer.last_stats
        prepack_module(layer)
        assert layer.experts.routed(x.reshape(-1, 64), *_route(layer, x)) is not None
        fused = layer(x)
    assert torch.allclose(fused, plain, rtol=1e-5, atol=1e-6) and not torch.equal(fused, torch.zeros_like(fused))
    assert layer.last_stats.tokens_per_expert.tolist() == plain_stats.tokens_per_expert.tolist()
    assert layer.last_stats.dropped_tokens == 0 and layer.last_stats.routing is not None
    assert layer.experts.routed(x.reshape(-1, 64).requires_grad_(), *_route(layer, x)) is None  # a gradient: torch


def _route(layer, x):
    routing = layer.router(x.reshape(-1, x.shape[-1]))
    return routing.topk_idx, routing.topk_weight


def test_a_prepacked_engine_runs_the_sorted_products_where_every_expert_on_every_token_ran():
    """With panel copies the fixed-shape step takes the sorted products (one C call) from num_experts assignments
    and skips the dense form (``MoELayer.fit_static_forms``); without them the forms keep their ranges; both
    engines give the same greedy tokens while the batch shrinks from 36 rows (sorted products) through the dense
    range to the per-assignment products (requests end one by one)."""
    torch.manual_seed(0)
    base = MoETransformer(preset("tiny")).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, base.config.vocab_size, (5,), generator=gen).tolist() for _ in range(36)]
    params = [SamplingParams(temperature=0, max_tokens=1 + i, ignore_eos=True) for i in range(36)]
    tokens = {}
    for prepack in (True, False):
        model = deepcopy(base)  # a copy has no packs of its own (the table is keyed by tensor)
        engine = Engine(model, prepack_weights=prepack, decode_graph="static", max_num_seqs=40)
        for _, layer in model.moe_layers():
            assert layer.mlp.experts.grouped_kernel_ready() is prepack
            experts = layer.mlp.num_experts
            assert layer.mlp.gathered_below == (experts if prepack else GATHERED_PER_EXPERT * experts)
            assert layer.mlp.dense_below == (layer.mlp.static_form_edges()[0] if prepack else DENSE_BELOW)
        tokens[prepack] = [out.output_ids for out in engine.generate(prompts, params)]
    assert tokens[True] == tokens[False] and [len(ids) for ids in tokens[True]] == list(range(1, 37))
