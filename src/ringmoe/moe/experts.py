"""SwiGLU experts held as stacked weights, computed per expert group, plus shared experts.

Weights follow transformers' fused layout (v5): ``gate_up`` (E, 2F, H) with
the gate projection in rows [0, F) and the up projection in [F, 2F), and
``down`` (E, H, F).  An expert computes down(silu(gate x) * up x).

gpt-oss's experts (``bias=True, limit=L``) add biases to both projections and clamp:
g = min(gate x + b_g, L), u = clamp(up x + b_u, -L, L), out = down((u + 1) * g * sigmoid(alpha g)) + b_d.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..batch_invariant import InvariantLinear, linear, rowwise, tile_rows
from ..panel_gemm import RoutedExperts, grouped_linear
from ..prepacked import has_panels, packed, packed_linear, packed_panels, panel_copy

__all__ = ["SwiGLUExperts", "SharedExpert", "swiglu"]


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias: torch.Tensor | None = None,
           down_bias: torch.Tensor | None = None, limit: float | None = None, alpha: float = 1.702) -> torch.Tensor:
    """down(act(gate x, up x)) for rows x (n, H), gate_up (2F, H) = [gate; up], down (H, F); optional
    biases (2F,), (H,); ``limit``: gpt-oss's clamped activation, else silu(gate) * up."""
    h = linear(x, gate_up)
    if gate_up_bias is not None:
        h = h + gate_up_bias
    y = linear(activate(h, limit, alpha), down)
    return y if down_bias is None else y + down_bias


def activate(h: torch.Tensor, limit: float | None = None, alpha: float = 1.702) -> torch.Tensor:
    """[gate | up] (..., 2F) -> (..., F): silu(gate) * up, or gpt-oss's clamped form when ``limit`` is set."""
    gate, up = h.chunk(2, dim=-1)
    if limit is None:
        return rowwise(F.silu, gate) * up
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * gate * rowwise(torch.sigmoid, gate * alpha)


class SwiGLUExperts(nn.Module):
    dense_decode = True  # a compiled decode step may run every expert on every token (MoELayer.forward_static)

    def __init__(self, num_experts: int, hidden_size: int, ffn_size: int, bias: bool = False,
                 limit: float | None = None, alpha: float = 1.702):
        super().__init__()
        self.num_experts, self.hidden_size, self.ffn_size = num_experts, hidden_size, ffn_size
        self.limit, self.alpha = limit, alpha
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * ffn_size, hidden_size))
        self.down = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_size))
        nn.init.normal_(self.gate_up, std=hidden_size**-0.5)
        nn.init.normal_(self.down, std=ffn_size**-0.5)
        self.gate_up_bias = nn.Parameter(torch.zeros(num_experts, 2 * ffn_size)) if bias else None
        self.down_bias = nn.Parameter(torch.zeros(num_experts, hidden_size)) if bias else None

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the experts compute in."""
        return self.gate_up.dtype

    def gathered(self, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights of experts ``chosen`` (n,): gate_up (n, 2F, H), down (n, H, F)."""
        return self.gate_up[chosen], self.down[chosen]

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` on rows x (n, H) -> (n, H)."""
        return swiglu(x, self.gate_up[e], self.down[e],
                      None if self.gate_up_bias is None else self.gate_up_bias[e],
                      None if self.down_bias is None else self.down_bias[e], self.limit, self.alpha)

    def grouped(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x (N, H) sorted by expert with ``counts[e]`` rows for expert e: one matmul pair per expert.

        The stacked weights are unbound once, so backward stacks the E weight
        gradients once; indexing ``gate_up[e]`` per expert would instead build a
        full (E, 2F, H) gradient per expert (O(E^2) memory traffic).  Where the
        stacks were prepacked (``prepack_weights``) and no gradient is wanted,
        each round of products is one call of ``panel_gemm``'s grouped kernel
        over the panel copies (all experts at once), or where that kernel does
        not run each product uses its expert's oneDNN copy.  The biases and the
        activation run once over all rows, between the two rounds of products
        (elementwise, so row by row the same as per expert: four small ops per
        expert fewer; measured in one process, a compiled batch-32 / 64 decode
        step 1.04-1.11x / 1.04x, an eager step of a 140-token prompt 1.04x).
        """
        active = [e for e, count in enumerate(counts) if count]
        if not active:
            return x.new_zeros(0, self.hidden_size)
        sizes = [counts[e] for e in active]
        first, second = self._rounds(x, counts, active)
        h = first(x)                                                                          # (N, 2F)
        if self.gate_up_bias is not None:
            h = h + self._row_bias(self.gate_up_bias, active, sizes)
        y = second(activate(h, self.limit, self.alpha))                                       # (N, H)
        return y if self.down_bias is None else y + self._row_bias(self.down_bias, active, sizes)

    def routed(self, x: torch.Tensor, topk_idx: torch.Tensor,
               topk_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A MoE layer's whole dropless routed part in one call of ``panel_gemm.routed_experts`` (sort by expert,
        gathers, both rounds of products, activation, weighted sum) where the stacks' panel copies apply (float32
        on a CPU with AVX2, prepacked, no gradient wanted, outside the deterministic mode and torch.compile's
        tracing): (y (T, H) float32, assignments per expert (E,) int64); else None.  x (T, H), topk_idx /
        topk_weight (T, k)."""
        if tile_rows() is not None or topk_weight.dtype != torch.float32:
            return None
        if torch.is_grad_enabled() and topk_weight.requires_grad:
            return None
        gate_up, down = packed_panels(self.gate_up, x), packed_panels(self.down, x)
        if gate_up is None or down is None:
            return None
        call = getattr(self, "_routed_call", None)  # the stacks checked once per panel copy (a new copy: a new call)
        if call is None or not call.holds(gate_up, down, self.gate_up_bias, self.down_bias):
            call = self._routed_call = RoutedExperts(gate_up, down, self.ffn_size, self.gate_up_bias, self.down_bias)
        return call(x, topk_idx, topk_weight, self.limit, self.alpha)

    def grouped_kernel_ready(self) -> bool:
        """Will the routed part run in ``panel_gemm``'s C code (``routed``, ``grouped``; outside a traced graph,
        without gradients): both stacks have current panel copies."""
        return has_panels(self.gate_up) and has_panels(self.down)

    def c_binding(self) -> tuple | None:
        """What the C kernel of ``grouped_experts`` takes (``MoELayer.bind_c_experts``, ``ringmoe.operators``): the
        panel copies of both stacks, the biases as float32 (an empty tensor: none), ffn_size, the clamp (-1: none)
        and alpha; None where a stack has no current panel copy."""
        gate_up, down = panel_copy(self.gate_up), panel_copy(self.down)
        if gate_up is None or down is None:
            return None
        biases = [torch.empty(0) if b is None else b.detach().to(torch.float32).contiguous()
                  for b in (self.gate_up_bias, self.down_bias)]
        return (gate_up, down, *biases, self.ffn_size, -1.0 if self.limit is None else float(self.limit),
                float(self.alpha))

    def weights_versions(self) -> tuple:
        """The stacks and biases as they are now (each tensor and its version): what a binding was made from."""
        return tuple((t, t._version) for t in (self.gate_up, self.down, self.gate_up_bias, self.down_bias)
                     if t is not None)

    def _rounds(self, x: torch.Tensor, counts: list[int], active: list[int]) -> tuple:
        """The two rounds of ``grouped``'s products, each rows (N, in) sorted by expert -> (N, out): the grouped
        kernel over the panel copies, else one product per active expert (its oneDNN copy, or the weight)."""
        sizes = [counts[e] for e in active]
        if tile_rows() is None:
            panels = packed_panels(self.gate_up, x), packed_panels(self.down, x)
            if all(copy is not None for copy in panels):  # (``None in`` would compare each tensor with None: ~70 us)
                return tuple(partial(grouped_linear, counts=counts, packed=copy, out_features=width)
                             for copy, width in zip(panels, (2 * self.ffn_size, self.hidden_size)))
            packs = packed(self.gate_up, x), packed(self.down, x)
            if all(copy is not None for copy in packs):
                return tuple(self._per_expert(packed_linear, matrices, active, sizes) for matrices in packs)
        return tuple(self._per_expert(linear, stack.unbind(0), active, sizes) for stack in (self.gate_up, self.down))

    @staticmethod
    def _per_expert(product, matrices, active: list[int], sizes: list[int]):
        """rows (N, in) sorted by expert -> (N, out): each active expert's rows times its matrix."""
        return lambda rows: torch.cat([product(part, matrices[e]) for e, part in zip(active, rows.split(sizes))])

    @staticmethod
    def _row_bias(bias: torch.Tensor, active: list[int], sizes: list[int]) -> torch.Tensor:
        """bias (E, C) -> (N, C): each sorted row's expert's bias (``sizes[i]`` rows of expert ``active[i]``)."""
        experts = torch.tensor(active, device=bias.device).repeat_interleave(torch.tensor(sizes, device=bias.device))
        return bias.index_select(0, experts)

    def prepack_weights(self) -> tuple[torch.Tensor, ...]:
        """The stacks ``prepacked.prepack_module`` may pack (``grouped`` uses the copies where they apply)."""
        return (self.gate_up, self.down)

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        """x (E, C, H) -> (E, C, H): one batched matmul per projection for all experts."""
        h = torch.bmm(x, self.gate_up.transpose(1, 2))
        if self.gate_up_bias is not None:
            h = h + self.gate_up_bias[:, None]
        y = torch.bmm(activate(h, self.limit, self.alpha), self.down.transpose(1, 2))
        return y if self.down_bias is None else y + self.down_bias[:, None]


class SharedExpert(nn.Module):
    """An always-on SwiGLU MLP; ``gated`` adds Qwen2-MoE's sigmoid(Linear(H, 1)) gate on its output."""

    def __init__(self, hidden_size: int, ffn_size: int, gated: bool = False):
        super().__init__()
        self.gate_proj = InvariantLinear(hidden_size, ffn_size, bias=False)
        self.up_proj = InvariantLinear(hidden_size, ffn_size, bias=False)
        self.down_proj = InvariantLinear(ffn_size, hidden_size, bias=False)
        self.gate = InvariantLinear(hidden_size, 1, bias=False) if gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down_proj(rowwise(F.silu, self.gate_proj(x)) * self.up_proj(x))
        if self.gate is not None:
            y = rowwise(torch.sigmoid, self.gate(x)) * y
        return y
