"""Prepacked weights (``ringmoe.prepacked``): panel copies (``panel_gemm``) or oneDNN copies, the same products as
the plain weights, used only where they apply (float32 CPU, no gradient, not traced, weights unchanged since
packing), for linears and grouped experts; ``ringmoe::panel_linear``'s C kernel; the panels a compiled decode step
reads through its modules (``DecodePanels``)."""

import copy
import gc

import pytest
import torch
import torch.nn.functional as F

from ringmoe import operators, panel_gemm, prepacked
from ringmoe.batch_invariant import InvariantLinear, batch_invariant, linear
from ringmoe.moe.experts import SwiGLUExperts
from ringmoe.moe.router import Router
from ringmoe.prepacked import (DecodePanels, packed, packed_linear, packed_panels, panel_copy, panel_linear, prepack,
                               prepack_module, prepack_supported, prepacked_bytes)

pytestmark = pytest.mark.skipif(not prepack_supported(torch.zeros(2, 2)),
                                reason="neither panel_gemm nor torch's oneDNN runs here")

OPERATOR = torch.ops.ringmoe.panel_linear.default
PANELS = panel_gemm.available()  # (asked here: torch.compile does not trace the question)


def _float32_error_bound(x64, w64, b64, out, *others):
    """flash-attn's rule for low precision: the packed product's error vs float64 at most 2x plain float32's (the
    worst of F.linear's and ``others``, more plain float32 products of the same operands)."""
    ref = F.linear(x64, w64, b64)
    plain = [F.linear(x64.float(), w64.float(), None if b64 is None else b64.float()), *others]
    worst = max((p.double() - ref).abs().max().item() for p in plain)
    return (out.double() - ref).abs().max().item(), 2 * worst + 1e-12


def _matrix_copy(weight: torch.Tensor, x: torch.Tensor):
    """The copy of a matrix a product of x may use: its panels where ``panel_gemm`` runs, else its oneDNN copy."""
    return packed_panels(weight, x) if PANELS else packed(weight, x)


@pytest.mark.parametrize("copy", ["panels", "onednn"])
@pytest.mark.parametrize("rows, out_features, in_features, bias", [(1, 37, 19, False), (5, 64, 33, True),
                                                                  (8, 130, 256, False), (33, 7, 5, True)])
def test_packed_linear_matches_float64_like_plain_float32(rows, out_features, in_features, bias, copy, monkeypatch):
    """A matrix is packed as panels where ``panel_gemm`` runs (multiplied by ``ringmoe::panel_linear``), else as a
    oneDNN copy: both within twice plain float32's error of the float64 product, for 2-D, 3-D and strided x."""
    if copy == "panels" and not panel_gemm.available():
        pytest.skip("panel_gemm does not run here (needs x86-64 with AVX2 and a C compiler)")
    if copy == "onednn":
        monkeypatch.setattr(panel_gemm, "available", lambda: False)
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    w64 = torch.randn(out_features, in_features, generator=gen, dtype=torch.float64)
    x64 = torch.randn(rows, in_features, generator=gen, dtype=torch.float64)
    b64 = torch.randn(out_features, generator=gen, dtype=torch.float64) if bias else None
    weight = w64.float()
    assert prepack(weight) == weight.numel() * 4
    if copy == "panels":
        panels = packed_panels(weight, x64.float())
        assert panels.shape == weight.shape and packed(weight, x64.float()) is None and panels._base is None

        def product(x, b=None):
            return panel_linear(x, panels, b)
    else:
        matrices = packed(weight, x64.float())
        assert matrices is not None and len(matrices) == 1 and packed_panels(weight, x64.float()) is None

        def product(x, b=None):
            return packed_linear(x, matrices[0], b)
    out = product(x64.float(), None if b64 is None else b64.float())
    assert out.shape == (rows, out_features)
    # the oneDNN copy sums in oneDNN's order, as torch's oneDNN product of the plain weight does (on an AVX-512 Xeon
    # its brgemm kernel: ~5x F.linear's error at 256-1024 inputs): the rule holds against the worse of the two
    others = [torch.ops.mkldnn._linear_pointwise(x64.float(), weight, None if b64 is None else b64.float(), "none",
                                                 [], "")] if copy == "onednn" else []
    error, bound = _float32_error_bound(x64, w64, b64, out, *others)
    assert error <= bound, (error, bound)
    # a 3-D input and a transposed (non-contiguous) one
    x3 = x64.float().reshape(1, rows, in_features)
    torch.testing.assert_close(product(x3)[0], F.linear(x64.float(), weight), rtol=1e-5, atol=1e-5)
    xt = x64.float().t().contiguous().t()
    torch.testing.assert_close(product(xt), F.linear(xt, weight), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not (panel_gemm.available() and operators.c_kernels()),
                    reason="needs the kernel library and torch's C shim")
def test_panel_linear_runs_in_c_bit_equal_to_its_python_kernel_and_refuses_what_does_not_fit():
    gen = torch.Generator().manual_seed(21)
    weight = torch.randn(70, 45, generator=gen)  # panels of 16 columns and a last one of 6
    prepack(weight)
    panels = panel_copy(weight)
    for rows in (0, 1, 6, 13):
        x = torch.randn(rows, 45, generator=gen)
        before = (x._use_count(), panels._use_count())
        got = OPERATOR(x, panels)
        assert (x._use_count(), panels._use_count()) == before  # the kernel released its inputs
        torch.testing.assert_close(got, prepacked._panel_linear_python(x, panels), rtol=0, atol=0)
        torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-5, atol=1e-5)
    x = torch.randn(4, 45, generator=gen)
    for bad in (x[:, :44], x.t().contiguous().t()[:, :44], x.double(), x[None]):
        before = (bad._use_count(), panels._use_count())
        with pytest.raises(RuntimeError, match="panel_linear: x"):
            OPERATOR(bad, panels)
        assert (bad._use_count(), panels._use_count()) == before  # released after the error too


def test_packed_copy_is_used_only_where_it_gives_the_plain_product():
    gen = torch.Generator().manual_seed(3)
    layer = InvariantLinear(24, 40)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(40, 24, generator=gen))
    x = torch.randn(6, 24, generator=gen)
    assert _matrix_copy(layer.weight, x) is None  # not packed yet
    assert prepack_module(layer) == 40 * 24 * 4 and prepacked_bytes(layer.weight) == 40 * 24 * 4
    assert _matrix_copy(layer.weight, x) is None  # a product with a gradient keeps the plain weight
    with torch.no_grad():
        assert _matrix_copy(layer.weight, x) is not None
        assert _matrix_copy(layer.weight, x.double()) is None  # another dtype
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        with batch_invariant():  # the deterministic mode's fixed tiles, not the packed copy
            assert torch.equal(layer(x), linear(x, layer.weight, layer.bias))
        layer.weight.add_(1.0)  # changed after packing: the copy is stale and never used
        assert _matrix_copy(layer.weight, x) is None
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        prepack(layer.weight)
        layer.weight.data = layer.weight.data.clone()  # moved (as module.to(...) does): stale too
        assert _matrix_copy(layer.weight, x) is None
    # traced by torch.compile: the plain product (the table is never consulted inside a graph)
    prepack(layer.weight)
    seen = []

    @torch.compile(backend="eager", fullgraph=True)
    def traced(t):
        seen.append(_matrix_copy(layer.weight, t))
        return layer(t)

    with torch.no_grad():
        torch.testing.assert_close(traced(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert seen == [None]


@pytest.mark.skipif(not (panel_gemm.available() and operators.c_kernels()),
                    reason="needs the kernel library and torch's C shim")
def test_eager_products_take_the_panels_of_larger_matrices_at_few_rows():
    """Eagerly a product goes through the panel copy where that pays (a matrix of 32K values or more at 2-64 rows,
    of 256K values or more at one row: ``batch_invariant._PANEL_VALUES``...), else MKL's product of the plain weight:
    the same values either way."""
    from torch.profiler import profile

    gen = torch.Generator().manual_seed(12)
    head, large, small = InvariantLinear(128, 2048), InvariantLinear(256, 160), InvariantLinear(64, 48)
    with torch.no_grad():
        for layer in (head, large, small):
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen))
            layer.bias.copy_(torch.randn(layer.bias.shape, generator=gen))
            prepack_module(layer)
        for layer, rows, panels in ((large, 5, True), (large, 64, True), (large, 65, False), (large, 1, False),
                                    (head, 1, True), (small, 5, False)):
            x = torch.randn(rows, layer.in_features, generator=gen)
            with profile() as prof:
                out = layer(x)
            assert ("ringmoe::panel_linear" in {event.name for event in prof.events()}) == panels
            # float32 sums of K terms in an order of the kernel's: within the worst-case bound of any order,
            # K * eps * sum |terms| (a wrong panel or a missed term is off by a whole term)
            exact = F.linear(x.double(), layer.weight.double(), layer.bias.double())
            terms = F.linear(x.double().abs(), layer.weight.double().abs(), layer.bias.double().abs())
            assert ((out.double() - exact).abs() <= layer.in_features * 2.0 ** -24 * terms).all()


def _traced_ops(fn, *args) -> tuple[torch.Tensor, list[str]]:
    """fn(*args) compiled (no inductor: the traced graph run as it is) and the functions its graph calls."""
    calls = []

    def backend(graph, inputs):
        calls.extend(str(node.target) for node in graph.graph.nodes if node.op == "call_function")
        return graph.forward

    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=True)(*args), calls


@pytest.mark.skipif(not panel_gemm.available(), reason="needs x86-64 with AVX2 and a C compiler")
def test_decode_panels_reach_traced_products_and_follow_their_weights():
    """``DecodePanels`` hands a module's panel copy to its traced forward (the graph multiplies by
    ``ringmoe::panel_linear``, the weight itself unread), packs again, into the same tensor, a weight changed in
    place, takes a replaced parameter's new panels, and leaves products with a gradient and eager ones alone."""
    gen = torch.Generator().manual_seed(8)
    layer, router = InvariantLinear(24, 40), Router(24, 6, 2)
    model = torch.nn.ModuleList([layer, router])
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    x = torch.randn(5, 24, generator=gen)
    prepack_module(model)
    panels = DecodePanels(model)
    assert panels.count == 2 and layer.decode_panels is panel_copy(layer.weight)
    assert router.decode_panels is panel_copy(router.weight)

    def step(t):
        return layer(t), router(t).logits

    with torch.no_grad():
        (out, logits), calls = _traced_ops(step, x)
        assert calls.count("ringmoe.panel_linear.default") == 2 and "<built-in function linear>" not in calls
        torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits, F.linear(x, router.weight), rtol=1e-5, atol=1e-5)
        held = layer.decode_panels
        layer.weight.mul_(-2.0)  # in place: packed again into the tensor the graph holds
        panels.refresh()
        assert layer.decode_panels is held
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        traced = torch.compile(step, backend="eager", fullgraph=True, dynamic=True)
        torch.testing.assert_close(traced(x)[0], F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        router.weight = torch.nn.Parameter(router.weight.detach() + 1.0, requires_grad=False)  # a new parameter
        panels.refresh()
        assert router.decode_panels is panel_copy(router.weight)
        torch.testing.assert_close(traced(x)[1], F.linear(x, router.weight), rtol=1e-5, atol=1e-5)
    # a product that wants a gradient keeps the plain weight (the operator has no backward)
    _, calls = _traced_ops(lambda t: layer(t), x.requires_grad_())
    assert "ringmoe.panel_linear.default" not in calls
    clone = copy.deepcopy(layer)  # a copy's weights are new tensors: no panels carried over
    assert clone.decode_panels is None and layer.decode_panels is not None


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
