"""A linear layer whose weight stays quantized: each product dequantizes the weight one tile of rows at a time.

y = x W^T + b with W (out, in) in fp8 block or mxfp4 format.  On a GPU the Triton kernel of ``triton_gemm`` decodes
the codes inside the GEMM.  Elsewhere the output columns are computed in tiles of ``tile`` weight rows (a multiple of
the fp8 block height): only one tile's float copy exists at a time, so a layer never holds more than tile x in
floats beside its codes.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..batch_invariant import linear
from . import matmul
from .formats import QuantScheme
from .weight import QuantizedWeight

__all__ = ["QuantizedLinear"]

_TILE_VALUES = 1 << 20  # floats per dequantized tile (4 MiB in float32)


class QuantizedLinear(nn.Module):
    """Drop-in for ``nn.Linear(in_features, out_features, bias)`` with a quantized weight (``weight_q``).

    ``weight`` gives the whole float weight (for code that reads it, e.g. MLA's absorbed projections); the
    forward never builds it whole.  The bias stays a float parameter."""

    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: QuantScheme):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight_q = QuantizedWeight(scheme, (out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        unit = scheme.block[0] if scheme.method == "fp8" else 1
        self.tile = max(unit, _TILE_VALUES // max(in_features, 1) // unit * unit)

    @property
    def weight(self) -> torch.Tensor:
        return self.weight_q.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if matmul.fused_ready(x):  # a GPU: the Triton kernel decodes the codes inside the GEMM
            y = matmul.fused_linear(x, self.weight_q)
            return y if self.bias is None else y + self.bias
        if self.tile >= self.out_features:
            return linear(x, self.weight_q.dequantize(dtype=x.dtype), self.bias)
        parts = [linear(x, self.weight_q.dequantize(rows=slice(start, start + self.tile), dtype=x.dtype))
                 for start in range(0, self.out_features, self.tile)]
        y = torch.cat(parts, dim=-1)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
