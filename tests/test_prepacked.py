"""oneDNN-prepacked weights (``ringmoe.prepacked``): the same products as the plain weights, used only where they
apply (float32 CPU, no gradient, not traced, weights unchanged since packing), for linears and grouped experts."""

import copy
import gc

import pytest
import torch
import torch.nn.functional as F

from ringmoe import panel_gemm, prepacked
from ringmoe.batch_invariant import InvariantLinear, batch_invariant, linear
from ringmoe.moe.experts import SwiGLUExperts
from ringmoe.prepacked import (packed, packed_linear, packed_panels, prepack, prepack_module, prepack_supported,
                               prepacked_bytes)

pytestmark = pytest.mark.skipif(not prepack_supported(torch.zeros(2, 2)), reason="torch built without oneDNN")


def _float32_error_bound(x64, w64, b64, out):
    """flash-attn's rule for low precision: the packed product's error vs float64 at most 2x plain float32's."""
    ref = F.linear(x64, w64, b64)
    plain = F.linear(x64.float(), w64.float(), None if b64 is None else b64.float()).double()
    return (out.double() - ref).abs().max().item(), 2 * (plain - ref).abs().max().item() + 1e-12


@pytest.mark.parametrize("rows, out_features, in_features, bias", [(1, 37, 19, False), (5, 64, 33, True),
                                                                  (8, 130, 256, False), (33, 7, 5, True)])
def test_packed_linear_matches_float64_like_plain_float32(rows, out_features, in_features, bias):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    w64 = torch.randn(out_features, in_features, generator=gen, dtype=torch.float64)
    x64 = torch.randn(rows, in_features, generator=gen, dtype=torch.float64)
    b64 = torch.randn(out_features, generator=gen, dtype=torch.float64) if bias else None
    weight = w64.float()
    assert prepack(weight) == weight.numel() * 4
    matrices = packed(weight, x64.float())
    assert matrices is not None and len(matrices) == 1
    out = packed_linear(x64.float(), matrices[0], None if b64 is None else b64.float())
    assert out.shape == (rows, out_features)
    error, bound = _float32_error_bound(x64, w64, b64, out)
    assert error <= bound, (error, bound)
    # a 3-D input and a transposed (non-contiguous) one
    x3 = x64.float().reshape(1, rows, in_features)
    torch.testing.assert_close(packed_linear(x3, matrices[0])[0], F.linear(x64.float(), weight), rtol=1e-5, atol=1e-5)
    xt = x64.float().t().contiguous().t()
    torch.testing.assert_close(packed_linear(xt, matrices[0]), F.linear(xt, weight), rtol=1e-5, atol=1e-5)


def test_packed_copy_is_used_only_where_it_gives_the_plain_product():
    gen = torch.Generator().manual_seed(3)
    layer = InvariantLinear(24, 40)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(40, 24, generator=gen))
    x = torch.randn(6, 24, generator=gen)
    assert packed(layer.weight, x) is None  # not packed yet
    assert prepack_module(layer) == 40 * 24 * 4 and prepacked_bytes(layer.weight) == 40 * 24 * 4
    assert packed(layer.weight, x) is None  # a product with a gradient keeps the plain weight
    with torch.no_grad():
        assert packed(layer.weight, x) is not None
        assert packed(layer.weight, x.double()) is None  # another dtype
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        with batch_invariant():  # the deterministic mode's fixed tiles, not the packed copy
            assert torch.equal(layer(x), linear(x, layer.weight, layer.bias))
        layer.weight.add_(1.0)  # changed after packing: the copy is stale and never used
        assert packed(layer.weight, x) is None
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        prepack(layer.weight)
        layer.weight.data = layer.weight.data.clone()  # moved (as module.to(...) does): stale too
        assert packed(layer.weight, x) is None
    # traced by torch.compile: the plain product (the table is never consulted inside a graph)
    prepack(layer.weight)
    seen = []

    @torch.compile(backend="eager", fullgraph=True)
    def traced(t):
        seen.append(packed(layer.weight, t))
        return layer(t)

    with torch.no_grad():
        torch.testing.assert_close(traced(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert seen == [None]


def test_copies_stay_out_of_modules_and_leave_with_their_weight():
    layer = InvariantLinear(16, 8)
    prepack_module(layer)
    clone = copy.deepcopy(layer)  # a deep copy carries no pack (its own parameters are new tensors)
    assert prepacked_bytes(clone.weight) == 0 and set(clone.state_dict()) == {"weight", "bias"}
    key = id(layer.weight)
    assert key in prepacked._PACKS
    del layer
    gc.collect()
    assert key not in prepacked._PACKS
    assert prepack(torch.randn(4, 4, dtype=torch.float64)) == 0  # not supported: no copy


@pytest.mark.parametrize("copy", ["panels", "onednn"])
@pytest.mark.parametrize("bias, limit", [(False, None), (True, 7.0)])
def test_grouped_experts_through_packed_copies_equal_the_plain_products(bias, limit, copy, monkeypatch):
    """Expert stacks are packed as ``panel_gemm``'s panels where that kernel runs, else as oneDNN copies: both
    give the plain products' values (float64 reference, within twice the plain float32 error)."""
    if copy == "panels" and not panel_gemm.available():
        pytest.skip("panel_gemm does not run here (needs x86-64 with AVX2 and a C compiler)")
    if copy == "onednn":
        monkeypatch.setattr(panel_gemm, "available", lambda: False)
    torch.manual_seed(11)
    experts = SwiGLUExperts(5, 48, 40, bias=bias, limit=limit)
    if bias:
        with torch.no_grad():
            experts.gate_up_bias.normal_()
            experts.down_bias.normal_()
    counts = [3, 0, 1, 9, 2]  # an expert without rows, one with one row
    x = torch.randn(sum(counts), 48)
    with torch.no_grad():
        plain = experts.grouped(x, counts)
        assert prepack_module(experts) == (5 * 80 * 48 + 5 * 48 * 40) * 4
        if copy == "panels":
            assert packed(experts.gate_up, x) is None and packed_panels(experts.down, x).shape == (5, 48 * 40)
        else:
            assert packed_panels(experts.gate_up, x) is None and len(packed(experts.down, x)) == 5
        fast = experts.grouped(x, counts)
        ref = experts.double().grouped(x.double(), counts)  # float64: no copy (not supported), the plain products
    plain_error = (plain.double() - ref).abs().max().item()
    assert (fast.double() - ref).abs().max().item() <= 2 * plain_error + 1e-12
    assert not torch.equal(fast, torch.zeros_like(fast))


def _packed_experts_and_tokens(seed: int) -> tuple[SwiGLUExperts, tuple[torch.Tensor, ...]]:
    """Four random experts (hidden 24, ffn 16) with their panel copies, and five tokens' x (5, 24), top-2 expert
    indices and weights."""
    torch.manual_seed(seed)
    experts = SwiGLUExperts(4, 24, 16)
    prepack_module(experts)
    return experts, (torch.randn(5, 24), torch.randint(0, 4, (5, 2)), torch.rand(5, 2))


@pytest.mark.skipif(not panel_gemm.available(), reason="needs x86-64 with AVX2 and a C compiler")
def test_the_routed_call_follows_a_repacked_stack():
    """``SwiGLUExperts.routed`` keeps its checked call while the panel copies stay, and makes a new one when the
    stacks are packed again after a change: the output follows the new weights."""
    experts, (x, topk_idx, topk_weight) = _packed_experts_and_tokens(seed=4)
    with torch.no_grad():
        first, _ = experts.routed(x, topk_idx, topk_weight)
        call = experts._routed_call
        experts.routed(x, topk_idx, topk_weight)
        assert experts._routed_call is call
        experts.down.mul_(2.0)  # the copies are stale: no fused call until packed again
        assert experts.routed(x, topk_idx, topk_weight) is None
        prepack_module(experts)
        second, _ = experts.routed(x, topk_idx, topk_weight)
    assert experts._routed_call is not call
    torch.testing.assert_close(second, 2 * first, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not panel_gemm.available(), reason="needs x86-64 with AVX2 and a C compiler")
def test_a_model_that_has_served_deep_copies():
    """A model whose experts hold a prepared routed call deep-copies (the call keeps no handle of the C library),
    and the copy, packed, computes with its own weights: the same output, then its own after its weights change."""
    experts, (x, topk_idx, topk_weight) = _packed_experts_and_tokens(seed=5)
    with torch.no_grad():
        first, _ = experts.routed(x, topk_idx, topk_weight)
        twin = copy.deepcopy(experts)
        prepack_module(twin)  # (the packed copies are kept beside a module's weights, not in it: a copy packs anew)
        torch.testing.assert_close(twin.routed(x, topk_idx, topk_weight)[0], first, rtol=0, atol=0)
        twin.down.mul_(2.0)
        prepack_module(twin)
        torch.testing.assert_close(twin.routed(x, topk_idx, topk_weight)[0], 2 * first, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(experts.routed(x, topk_idx, topk_weight)[0], first, rtol=0, atol=0)
