"""x W^T for a quantized weight: the fused Triton kernel on a GPU, the weight dequantized to x's dtype elsewhere.

On CUDA (float16 / bfloat16 / float32 activations, Triton installed) ``quantized_linear`` runs
``triton_gemm``: the codes are decoded tile by tile inside the GEMM, so a step reads each weight at its stored
width.  On a CPU the weight (or the one expert's, or one tile of rows: ``QuantizedLinear``) is dequantized and
multiplied by ``batch_invariant.linear``.  FP8 tensor-core GEMMs (``torch._scaled_mm``) are not used: they need the
activations quantized to fp8 too, which only adds error; the weights-only kernel keeps activations in their dtype.
"""

from __future__ import annotations

import importlib.util

import torch

from ..batch_invariant import linear
from .weight import QuantizedWeight

__all__ = ["fused_ready", "fused_linear", "quantized_linear"]

_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def fused_ready(x: torch.Tensor) -> bool:
    """True where the Triton kernel runs: CUDA activations of a supported dtype, Triton installed."""
    return x.device.type == "cuda" and x.dtype in _FUSED_DTYPES and importlib.util.find_spec("triton") is not None


def fused_linear(x: torch.Tensor, weight: QuantizedWeight, index: int | None = None) -> torch.Tensor:
    """x (..., in) -> x W^T (..., out) by the Triton kernel (W: the weight, or its expert ``index``)."""
    from .triton_gemm import triton_fp8_linear, triton_mxfp4_linear

    codes, scales = weight.codes, weight.scales
    if index is not None:
        codes, scales = codes[index], scales[index]
    if weight.scheme.method == "fp8":
        return triton_fp8_linear(x, codes, scales.view(torch.float32), weight.scheme.block)
    return triton_mxfp4_linear(x, codes, scales)


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight, index: int | None = None) -> torch.Tensor:
    """x W^T: fused where ``fused_ready``, else through the float weight (W or expert ``index``) in x's dtype."""
    if fused_ready(x):
        return fused_linear(x, weight, index)
    return linear(x, weight.dequantize(index, dtype=x.dtype))
