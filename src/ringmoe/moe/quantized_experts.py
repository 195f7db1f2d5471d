"""SwiGLU experts whose weights stay quantized (FP8 block-wise or MXFP4): each expert is dequantized when it runs.

The same interface as ``SwiGLUExperts`` (``expert``, ``grouped``, ``padded``, ``gathered``, ``dtype``, the
biases, ``limit``/``alpha``), the same function: gate (E, F, H), up (E, F, H) and down (E, H, F) are
held as ``QuantizedWeight``s and turned into floats one expert at a time (the tile of the dequantizing GEMM
on a CPU is one expert), so a layer never holds more than one expert's floats beside its codes; on a GPU each
expert's products run the Triton kernel that decodes the codes inside the GEMM (``quant.matmul``).
Not trainable: the codes have no gradient (the biases, float, do).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..quant import QuantizedWeight, QuantScheme, quantized_linear
from .experts import activate

__all__ = ["QuantizedSwiGLUExperts"]


class QuantizedSwiGLUExperts(nn.Module):
    """``num_experts`` experts with quantized gate (E, F, H), up (E, F, H) and down (E, H, F) weights (gate and
    up apart: fp8 blocks of 128 rows would straddle them if stacked) and float biases (2F,), (H,) per expert."""

    dense_decode = False  # a compiled decode step gathers the chosen experts (their codes dequantized in place)

    def __init__(self, scheme: QuantScheme, num_experts: int, hidden_size: int, ffn_size: int, bias: bool = False,
                 limit: float | None = None, alpha: float = 1.702):
        super().__init__()
        self.num_experts, self.hidden_size, self.ffn_size = num_experts, hidden_size, ffn_size
        self.scheme, self.limit, self.alpha = scheme, limit, alpha
        self.gate_q = QuantizedWeight(scheme, (num_experts, ffn_size, hidden_size))
        self.up_q = QuantizedWeight(scheme, (num_experts, ffn_size, hidden_size))
        self.down_q = QuantizedWeight(scheme, (num_experts, hidden_size, ffn_size))
        self.gate_up_bias = nn.Parameter(torch.zeros(num_experts, 2 * ffn_size)) if bias else None
        self.down_bias = nn.Parameter(torch.zeros(num_experts, hidden_size)) if bias else None

    @property
    def dtype(self) -> torch.dtype:
        return self.gate_q.dtype

    def _gate_up(self, index, dtype=None) -> torch.Tensor:
        return torch.cat([self.gate_q.dequantize(index, dtype=dtype), self.up_q.dequantize(index, dtype=dtype)],
                         dim=-2)

    @property
    def gate_up(self) -> torch.Tensor:
        """All experts' float gate_up (E, 2F, H) (export and inspection; the forward never builds it)."""
        return self._gate_up(None)

    @property
    def down(self) -> torch.Tensor:
        return self.down_q.dequantize()

    def gathered(self, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The float weights of experts ``chosen`` (n,): gate_up (n, 2F, H), down (n, H, F)."""
        return self._gate_up(chosen), self.down_q.dequantize(chosen)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` on rows x (n, H) -> (n, H), its weights dequantized to x's dtype (gate and up applied
        apart and their outputs joined: no (2F, H) copy of the weights)."""
        h = torch.cat([quantized_linear(x, self.gate_q, e), quantized_linear(x, self.up_q, e)], dim=-1)
        if self.gate_up_bias is not None:
            h = h + self.gate_up_bias[e]
        y = quantized_linear(activate(h, self.limit, self.alpha), self.down_q, e)
        return y if self.down_bias is None else y + self.down_bias[e]

    def grouped(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x (N, H) sorted by expert with ``counts[e]`` rows for expert e; experts with no rows are never read."""
        outs = [self.expert(e, rows) for e, rows in enumerate(x.split(counts)) if rows.shape[0]]
        return torch.cat(outs) if outs else x.new_zeros(0, self.hidden_size)

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        """x (E, C, H) -> (E, C, H): one expert at a time."""
        return torch.stack([self.expert(e, x[e]) for e in range(self.num_experts)])
