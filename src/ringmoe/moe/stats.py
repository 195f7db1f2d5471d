"""What a MoE layer reports about each call: its statistics and its router sums (for losses over a whole batch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from .router import Routing, load_balancing_loss, router_z_loss

__all__ = ["MoEStats", "RouterSums"]


@dataclass
class MoEStats:
    """What the last forward did.

    tokens_per_expert: (E,) int64 assignments kept per expert; routed_per_expert: before capacity.
    dropped_assignments / dropped_tokens: lost to capacity (a dropped token keeps only its residual).
    aux_loss, z_loss: scalar tensors with gradients, and ``router_sums``: computed from the call's routing
    when first read (serving never reads them, so it never pays for them; a compiled decode step keeps no
    routing: ``routing`` None, and reading them raises).  imbalance: max / mean routed
    load.  Expert parallelism adds (else None): tokens_per_rank (P,) assignments each rank's
    experts computed (dropped ones never travel), rank_imbalance (max / mean of those),
    and ``timings``: seconds in route / dispatch / experts / combine on this rank
    (``dispatch_s`` packs and sends rows, ``combine_s`` brings them home; ``wait_s``
    is the part of all phases spent blocked on an exchange, the wait for slower
    ranks included: the exposed communication), ``experts_s_per_rank`` (P,) every rank's
    expert seconds, ``straggler_s`` how long this rank's experts finish before
    the slowest rank's (what it waits for the straggler), and ``dispatch_bytes``
    sent to other ranks.  Timings are host wall-clock seconds: on CUDA, where kernels run
    asynchronously, they time launches and waits, not kernels.  Under expert parallelism the per-expert
    counts are global (summed over ranks) and dropped_* count this rank's tokens.
    """

    tokens_per_expert: torch.Tensor
    routed_per_expert: torch.Tensor
    dropped_assignments: int
    dropped_tokens: int
    routing: "Routing | None" = field(repr=False)
    num_experts: int
    tokens_per_rank: torch.Tensor | None = None
    rank_imbalance: float | None = None
    timings: dict | None = None

    @property
    def imbalance(self) -> float:
        mean = self.routed_per_expert.float().mean()
        return float(self.routed_per_expert.max() / mean) if mean > 0 else 1.0

    @cached_property
    def aux_loss(self) -> torch.Tensor:
        routing = self._routing()
        return load_balancing_loss(routing.probs, routing.topk_idx, self.num_experts)

    @cached_property
    def z_loss(self) -> torch.Tensor:
        return router_z_loss(self._routing().logits)

    @cached_property
    def router_sums(self) -> "RouterSums":
        return RouterSums.of(self._routing(), self.num_experts)

    def _routing(self) -> "Routing":
        if self.routing is None:
            raise ValueError("this call kept no routing (a compiled decode step): its router losses are unknown")
        return self.routing


@dataclass
class RouterSums:
    """This call's sums over its own tokens, for balancing losses over a whole (distributed) batch.

    prob_sum (E,): router probabilities summed over tokens (with gradients); assignments (E,): top-k
    choices per expert (no gradient); z_sum: sum of logsumexp(logits)^2 (with gradients); tokens.
    """

    prob_sum: torch.Tensor
    assignments: torch.Tensor
    z_sum: torch.Tensor
    tokens: int

    @classmethod
    def of(cls, routing, num_experts: int) -> "RouterSums":
        counts = torch.bincount(routing.topk_idx.reshape(-1), minlength=num_experts).to(routing.probs.dtype)
        return cls(routing.probs.sum(0), counts, torch.logsumexp(routing.logits, dim=-1).square().sum(),
                   routing.probs.shape[0])
