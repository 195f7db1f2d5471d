"""Moving tokens to experts and back: permute (sort by expert), capacity, unpermute.

Every (token, slot) pair of the router's top-k is an *assignment*.  Permuting
sorts assignments by expert so each expert's tokens are contiguous.  With a
capacity C per expert, an expert keeps its C assignments of highest router
weight and drops the rest (counted, never silent); the kept ones can also be
laid out in a padded (E, C, H) buffer for fixed shapes.  Unpermuting scatters
the expert outputs back, weighted, summing a token's k contributions; a dropped
assignment contributes 0 (the caller's residual carries the token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["DispatchPlan", "plan_dispatch", "capacity_for", "permute", "unpermute"]


def capacity_for(capacity_factor: float, tokens: int, top_k: int, num_experts: int) -> int:
    """ceil(c * T * k / E): the slots each expert gets."""
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


@dataclass
class DispatchPlan:
    """Where every kept assignment goes.

    order: (N,) assignment ids (t * k + slot) of kept assignments, sorted by expert.
    token: (N,) their token ids.  expert: (N,) their experts.
    counts: (E,) kept assignments per expert (int64), routed: (E,) before capacity.
    slot: (N,) position inside the padded (E * C) buffer, or None (dropless).
    capacity: C or None.  dropped_assignments: int.  dropped_tokens: tokens with no kept assignment.
    """

    order: torch.Tensor
    token: torch.Tensor
    expert: torch.Tensor
    counts: torch.Tensor
    routed: torch.Tensor
    slot: torch.Tensor | None
    capacity: int | None
    dropped_assignments: int
    dropped_tokens: int


def plan_dispatch(topk_idx: torch.Tensor, topk_weight: torch.Tensor, num_experts: int, capacity: int | None) -> DispatchPlan:
    """Sort assignments by expert; under a capacity keep each expert's highest-weight ones."""
    tokens, top_k = topk_idx.shape
    experts = topk_idx.reshape(-1)
    routed = torch.bincount(experts, minlength=num_experts)
    if capacity is None:
        order = torch.argsort(experts, stable=True)
        counts, slot = routed, None
    else:
        # priority: descending router weight, then expert (both stable) -> rank within expert
        by_weight = torch.argsort(topk_weight.reshape(-1).detach(), descending=True, stable=True)
        by_expert = by_weight[torch.argsort(experts[by_weight], stable=True)]
        starts = torch.cumsum(routed, 0) - routed
        rank = torch.arange(by_expert.numel(), device=experts.device) - starts[experts[by_expert]]
        keep = rank < capacity
        order = by_expert[keep]
        counts = torch.clamp(routed, max=capacity)
        slot = experts[order] * capacity + rank[keep]
    kept_tokens = torch.zeros(tokens, dtype=torch.bool, device=experts.device)
    kept_tokens[order // top_k] = True
    return DispatchPlan(
        order=order,
        token=order // top_k,
        expert=experts[order],
        counts=counts,
        routed=routed,
        slot=slot,
        capacity=capacity,
        dropped_assignments=int(experts.numel() - order.numel()),
        dropped_tokens=int(tokens - int(kept_tokens.sum())),
    )


def permute(x: torch.Tensor, plan: DispatchPlan, num_experts: int) -> torch.Tensor:
    """x (T, H) -> expert inputs: (N, H) sorted by expert, or (E, C, H) padded with zeros."""
    rows = x.index_select(0, plan.token)
    if plan.slot is None:
        return rows
    buffer = x.new_zeros(num_experts * plan.capacity, x.shape[-1])
    buffer = buffer.index_copy(0, plan.slot, rows)
    return buffer.view(num_experts, plan.capacity, x.shape[-1])


def unpermute(expert_out: torch.Tensor, plan: DispatchPlan, topk_weight: torch.Tensor, tokens: int) -> torch.Tensor:
    """Weighted sum of each token's expert outputs: (N, H) or (E, C, H) -> (T, H) in float32 (float64 stays)."""
    hidden = expert_out.shape[-1]
    rows = expert_out.reshape(-1, hidden)
    if plan.slot is not None:
        rows = rows.index_select(0, plan.slot)
    acc = torch.promote_types(rows.dtype, torch.float32)
    weights = topk_weight.reshape(-1).index_select(0, plan.order).to(acc)
    out = torch.zeros(tokens, hidden, dtype=acc, device=rows.device)
    return out.index_add(0, plan.token, rows.to(acc) * weights.unsqueeze(-1))
