"""``ringmoe::grouped_experts``'s C kernel (``torch_ops.c``): a MoE layer whose panel copies are bound runs in C,
bit-equal to the operator's Python kernel, with biases and gpt-oss's clamp; an unbound layer (never bound, its
weights changed since, freed) goes to the Python kernel; the kernel keeps no reference to what it was given after a
call, an error or an unbinding; compiled, a layer bound at the decode graph's start-up computes its eager step."""

from __future__ import annotations

import gc

import pytest
import torch

from ringmoe import operators, panel_gemm
from ringmoe.moe import MoELayer
from ringmoe.moe.layer import release_freed_c_experts
from ringmoe.prepacked import panel_copy, prepack_module

pytestmark = pytest.mark.skipif(not (panel_gemm.available() and operators.c_kernels()),
                                reason="needs the kernel library and torch's C shim")

OPERATOR = torch.ops.ringmoe.grouped_experts.default
PYTHON = torch.ops.ringmoe.grouped_experts_python.default


def _layer(seed: int, bias: bool = False, limit: float | None = None) -> MoELayer:
    torch.manual_seed(seed)
    layer = MoELayer(24, 40, 6, 2, expert_bias=bias, swiglu_limit=limit).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    prepack_module(layer)
    return layer


def _tokens(layer: MoELayer, count: int, seed: int):
    x = torch.randn(count, 24, generator=torch.Generator().manual_seed(seed))
    routing = layer.router(x)
    return x, routing.topk_idx, routing.topk_weight


def _uses(tensor: torch.Tensor) -> int:
    return tensor._use_count()


@pytest.mark.parametrize("bias, limit", [(False, None), (True, 7.0)])
def test_a_bound_layer_runs_in_c_bit_equal_to_the_python_kernel(bias, limit):
    layer = _layer(1, bias, limit)
    with torch.no_grad():
        assert layer.bind_c_experts()
        for count, seed in ((1, 2), (5, 3), (37, 4)):
            x, idx, weight = _tokens(layer, count, seed)
            before = [_uses(t) for t in (x, idx, weight)]
            got = OPERATOR(x, idx, weight, layer.op_key)
            torch.testing.assert_close(got, PYTHON(x, idx, weight, layer.op_key), rtol=0, atol=0)
            assert [_uses(t) for t in (x, idx, weight)] == before
            assert not torch.equal(got, torch.zeros_like(got))
        bad = idx.clone()
        bad[0, 0] = 6
        with pytest.raises(RuntimeError, match="outside the layer's experts"):
            OPERATOR(x, bad, weight, layer.op_key)
        assert [_uses(t) for t in (x, bad, weight)] == [_uses(t) for t in (x, idx, weight)]


def test_an_unbound_or_changed_layer_takes_the_python_kernel_and_the_panels_are_released():
    """The C kernel runs only what it was bound to: the Python kernel is asked for any other key (the C path is
    the Python kernel's call is recorded by the profiler), a layer whose weights changed is found stale and
    unbound, and unbinding (or freeing the layer) releases the kernel's references to the panel copies."""
    from torch.profiler import profile

    layer = _layer(5)
    with torch.no_grad():
        x, idx, weight = _tokens(layer, 9, 6)
        panels, key = panel_copy(layer.experts.gate_up), layer.op_key
        unbound = _uses(panels)

        def python_ran() -> bool:
            with profile() as prof:
                OPERATOR(x, idx, weight, key)
            return "ringmoe::grouped_experts_python" in {event.name for event in prof.events()}

        assert python_ran()  # never bound
        with pytest.raises(RuntimeError, match="no C binding"):  # no such layer: the Python kernel's KeyError
            OPERATOR(x, idx, weight, -1)
        assert layer.bind_c_experts() and layer.c_binding_current()
        assert _uses(panels) == unbound + 1  # the kernel's reference
        assert not python_ran()
        want = OPERATOR(x, idx, weight, layer.op_key)
        layer.experts.down.mul_(1.5)  # the panel copies are stale now
        assert not layer.c_binding_current()
        assert not layer.bind_c_experts()  # no current panel copy: unbound
        assert _uses(panels) == unbound
        assert python_ran()
        assert not torch.equal(OPERATOR(x, idx, weight, layer.op_key), want)
        prepack_module(layer)
        assert layer.bind_c_experts()
        panels = panel_copy(layer.experts.gate_up)
        bound = _uses(panels)
        del layer
        gc.collect()
        release_freed_c_experts()  # (a decode graph's next step, or the next binding, does it)
        assert _uses(panels) == bound - 1  # the kernel's reference went with the layer


def test_a_compiled_decode_step_runs_the_bound_experts_in_c():
    """The decode graph binds its MoE layers at start-up; its steps of the sorted-GEMM form call the C kernel
    (no Python kernel runs under the profiler), its products go through the panel copies (no MKL product in the
    graph), and they give the eager engine's greedy tokens."""
    from torch.profiler import profile

    from ringmoe.model import MoETransformer, preset
    from ringmoe.serve import Engine, SamplingParams

    torch.manual_seed(0)
    model = MoETransformer(preset("tiny")).eval()
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in (5, 23, 40, 9)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    eager = Engine(model, decode_graph="off", kv_cache_tokens=1024).generate(prompts, params)
    engine = Engine(model, decode_graph="compiled", kv_cache_tokens=1024, max_num_seqs=4)
    blocks = engine.runner.decode_graph.moe_blocks
    assert all(block.c_binding_current() and block._c_bound is not None for block in blocks)
    with profile() as prof:
        compiled = engine.generate(prompts, params)
    names = {event.name for event in prof.events()}
    assert "ringmoe::grouped_experts" in names and "ringmoe::grouped_experts_python" not in names
    # the projections, the routers and the LM head multiply by their panel copies (``prepacked.DecodePanels``)
    assert "ringmoe::panel_linear" in names and not any(name.startswith("aoti_torch_cpu_mm") for name in names)
    assert [o.output_ids for o in compiled] == [o.output_ids for o in eager]


@pytest.mark.parametrize("context", ["fake tensors", "meta device"])
def test_a_layer_freed_while_torch_compile_traces_still_releases_its_panels(context):
    """A layer collected while a fake-tensor mode is set or tensors are made on the meta device (torch.compile
    tracing another graph, when the garbage collector happens to run): its finalizer calls no operator (no error
    left in it), and the kernel's reference goes at the next safe point (``release_freed_c_experts``)."""
    import sys

    from torch._subclasses.fake_tensor import FakeTensorMode

    layer = _layer(7)
    with torch.no_grad():
        assert layer.bind_c_experts()
    panels = panel_copy(layer.experts.gate_up)
    bound, errors = _uses(panels), []
    hook, sys.unraisablehook = sys.unraisablehook, errors.append
    try:
        with FakeTensorMode() if context == "fake tensors" else torch.device("meta"):
            del layer
            gc.collect()
    finally:
        sys.unraisablehook = hook
    assert errors == [] and _uses(panels) == bound
    release_freed_c_experts()
    assert _uses(panels) == bound - 1
