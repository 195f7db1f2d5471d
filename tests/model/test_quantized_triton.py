"""The Triton GEMMs that decode FP8 block-scaled and MXFP4 weights inside the product (run under Triton's interpreter
on a CPU, TRITON_INTERPRET=1, on small shapes).

Against the float64 product with the dequantized weight: float32 activations within float32 rounding; float16 ones
within twice the error of plain PyTorch's float16 matmul on the same dequantized weight (flash-attn's rule).  Partial
fp8 blocks in both dims, odd row counts, a batch of one; the layers route to the kernel where it runs.
"""

from __future__ import annotations

import os

import pytest
import torch

from ringmoe.quant import QuantizedLinear, QuantizedWeight, QuantScheme, quantize_fp8, quantize_mxfp4
from ringmoe.quant import matmul

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="needs a GPU or TRITON_INTERPRET=1"),
              pytest.mark.filterwarnings("ignore")]
triton_gemm = pytest.importorskip("ringmoe.quant.triton_gemm")


def _weight(scheme: QuantScheme, shape, seed) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=gen) * torch.rand(*shape[:-1], 1, generator=gen) * 3
    weight = QuantizedWeight(scheme, shape)
    if scheme.method == "fp8":
        codes, scales = quantize_fp8(w, scheme.block)
    else:
        codes, scales = quantize_mxfp4(w)
    for index in range(shape[0]) if len(shape) == 3 else [None]:
        pick = (lambda t: t) if index is None else (lambda t: t[index])
        weight.fill(pick(codes), pick(scales), index)
    return weight


CASES = [(QuantScheme("fp8", (16, 32)), (40, 72)),    # partial blocks: 40 = 2 x 16 + 8 rows, 72 = 2 x 32 + 8 cols
         (QuantScheme("fp8", (128, 128)), (160, 136)),
         (QuantScheme("mxfp4"), (48, 96)),
         (QuantScheme("mxfp4"), (33, 64))]


@pytest.mark.parametrize("scheme, shape", CASES)
@pytest.mark.parametrize("rows", [1, 19])
def test_fused_float32_product_equals_the_dequantized_weights(scheme, shape, rows):
    weight = _weight(scheme, shape, seed=rows + shape[0])
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows))
    exact = x.double() @ weight.dequantize(dtype=torch.float64).T
    got = matmul.fused_linear(x, weight)
    assert got.dtype == torch.float32 and got.shape == (rows, shape[0])
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-4)
    plain = (x @ weight.dequantize().T).double()
    assert (got.double() - exact).abs().max() <= 4 * (plain - exact).abs().max() + 1e-6


@pytest.mark.parametrize("scheme, shape", CASES[::2])
def test_fused_float16_product_within_twice_plain_torch(scheme, shape):
    weight = _weight(scheme, shape, seed=5)
    x = torch.randn(23, shape[1], generator=torch.Generator().manual_seed(6))
    exact = x.half().double() @ weight.dequantize(dtype=torch.float64).T
    got = matmul.fused_linear(x.half(), weight)
    plain = (x.half().float() @ weight.dequantize(dtype=torch.float16).float().T).half()  # torch's fp16 GEMM rounding
    assert got.dtype == torch.float16
    ours, theirs = (got.double() - exact).abs().max(), (plain.double() - exact).abs().max()
    assert 0 < ours <= 2 * theirs, (ours, theirs)


def test_expert_weights_by_index():
    scheme = QuantScheme("fp8", (16, 16))
    weight = _weight(scheme, (3, 24, 40), seed=2)
    x = torch.randn(5, 40, generator=torch.Generator().manual_seed(3))
    for e in range(3):
        torch.testing.assert_close(matmul.fused_linear(x, weight, e), x @ weight.dequantize(e).T, rtol=1e-5, atol=1e-5)


def test_layers_route_to_the_kernel_where_it_runs(monkeypatch):
    """QuantizedLinear and the quantized experts call the kernel when ``fused_ready`` (a GPU); forced on here, the
    interpreter computes what the CPU path computes."""
    from ringmoe.moe.quantized_experts import QuantizedSwiGLUExperts

    layer = QuantizedLinear(64, 48, bias=True, scheme=QuantScheme("mxfp4"))
    layer.weight_q = _weight(QuantScheme("mxfp4"), (48, 64), seed=9)
    torch.nn.init.normal_(layer.bias)
    experts = QuantizedSwiGLUExperts(QuantScheme("fp8", (16, 16)), 2, 32, 48)
    experts.gate_q, experts.up_q = _weight(experts.scheme, (2, 48, 32), 1), _weight(experts.scheme, (2, 48, 32), 2)
    experts.down_q = _weight(experts.scheme, (2, 32, 48), 3)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(4))
    h = torch.randn(7, 32, generator=torch.Generator().manual_seed(5))
    cpu = layer(x), experts.expert(1, h)
    calls = []
    real = matmul.fused_linear
    monkeypatch.setattr(matmul, "fused_ready", lambda x: True)
    monkeypatch.setattr(matmul, "fused_linear", lambda *a: calls.append(a) or real(*a))
    fused = layer(x), experts.expert(1, h)
    assert len(calls) == 4  # the linear, and the expert's gate, up and down
    for a, b in zip(fused, cpu):  # float32 sums in another order
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_bad_shapes_name_the_codes():
    with pytest.raises(ValueError, match="codes must be"):
        triton_gemm.triton_fp8_linear(torch.randn(2, 8), torch.zeros(4, 9, dtype=torch.uint8), torch.ones(1, 1),
                                      (16, 16))
    with pytest.raises(ValueError, match="codes must be"):
        triton_gemm.triton_mxfp4_linear(torch.randn(2, 64), torch.zeros(4, 3, 16, dtype=torch.uint8),
                                        torch.zeros(4, 3, dtype=torch.uint8))
