"""SwiGLU experts held as stacked weights, computed per expert group, plus shared experts.

Weights follow transformers' fused layout (v5): ``gate_up`` (E, 2F, H) with
the gate projection in rows [0, F) and the up projection in [F, 2F), and
``down`` (E, H, F).  An expert computes down(silu(gate x) * up x).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..batch_invariant import InvariantLinear, linear

__all__ = ["SwiGLUExperts", "SharedExpert", "swiglu"]


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate x) * up x) for rows x (n, H), gate_up (2F, H) = [gate; up], down (H, F)."""
    gate, up = linear(x, gate_up).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, down)


class SwiGLUExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, ffn_size: int):
        super().__init__()
        self.num_experts, self.hidden_size, self.ffn_size = num_experts, hidden_size, ffn_size
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * ffn_size, hidden_size))
        self.down = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_size))
        nn.init.normal_(self.gate_up, std=hidden_size**-0.5)
        nn.init.normal_(self.down, std=ffn_size**-0.5)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` on rows x (n, H) -> (n, H)."""
        return swiglu(x, self.gate_up[e], self.down[e])

    def grouped(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x (N, H) sorted by expert with ``counts[e]`` rows for expert e: one matmul pair per expert.

        The stacked weights are unbound once, so backward stacks the E weight
        gradients once; indexing ``gate_up[e]`` per expert would instead build a
        full (E, 2F, H) gradient per expert (O(E^2) memory traffic).
        """
        gate_ups, downs = self.gate_up.unbind(0), self.down.unbind(0)
        outs = []
        for e, rows in enumerate(x.split(counts)):
            if rows.shape[0]:
                outs.append(swiglu(rows, gate_ups[e], downs[e]))
        return torch.cat(outs) if outs else x.new_zeros(0, self.hidden_size)

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        """x (E, C, H) -> (E, C, H): one batched matmul per projection for all experts."""
        gate, up = torch.bmm(x, self.gate_up.transpose(1, 2)).chunk(2, dim=-1)
        return torch.bmm(F.silu(gate) * up, self.down.transpose(1, 2))


class SharedExpert(nn.Module):
    """An always-on SwiGLU MLP; ``gated`` adds Qwen2-MoE's sigmoid(Linear(H, 1)) gate on its output."""

    def __init__(self, hidden_size: int, ffn_size: int, gated: bool = False):
        super().__init__()
        self.gate_proj = InvariantLinear(hidden_size, ffn_size, bias=False)
        self.up_proj = InvariantLinear(hidden_size, ffn_size, bias=False)
        self.down_proj = InvariantLinear(ffn_size, hidden_size, bias=False)
        self.gate = InvariantLinear(hidden_size, 1, bias=False) if gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        if self.gate is not None:
            y = torch.sigmoid(self.gate(x)) * y
        return y
