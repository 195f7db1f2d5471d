"""What a MoE layer reports about each call: its statistics and its router sums (for losses over a whole batch)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MoEStats", "RouterSums"]


@dataclass
class MoEStats:
    """What the last forward did.

    tokens_per_expert: (E,) int64 assignments kept per expert; routed_per_expert: before capacity.
    dropped_assignments / dropped_tokens: lost to capacity (a dropped token keeps only its residual).
    aux_loss, z_loss: scalar tensors with gradients.  imbalance: max / mean routed load.
    Expert parallelism adds (else None): tokens_per_rank (P,) assignments each rank's
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
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    imbalance: float
    tokens_per_rank: torch.Tensor | None = None
    rank_imbalance: float | None = None
    timings: dict | None = None
    router_sums: "RouterSums | None" = None


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
