"""Placing replicas of hot experts (EPLB-style) so every rank gets a similar load.

Given the measured load of each logical expert and ``slots_per_rank`` expert
slots on each of ``num_ranks`` ranks (num_ranks * slots_per_rank >= E):

1. every expert gets one replica; each spare slot goes to the expert with the
   largest load per replica (so a hot expert ends with several copies);
2. replicas, each carrying load / replicas, are packed heaviest first onto the
   rank with the least load that still has a free slot (greedy LPT packing).

The layer then splits a replicated expert's assignments evenly across its
copies; the copies hold identical weights, so outputs do not change.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ReplicaPlan", "plan_replicas"]


@dataclass(frozen=True)
class ReplicaPlan:
    """slots[r][s]: the logical expert in slot s of rank r.  replicas[e]: physical ids (r * slots + s) of e."""

    num_experts: int
    num_ranks: int
    slots_per_rank: int
    slots: tuple[tuple[int, ...], ...]
    replicas: tuple[tuple[int, ...], ...]

    def expected_load(self, expert_load: torch.Tensor) -> torch.Tensor:
        """(num_ranks,) load each rank gets if each expert's load splits evenly over its replicas."""
        load = expert_load.double()
        per_copy = load / torch.tensor([len(r) for r in self.replicas], dtype=torch.float64)
        return torch.tensor([float(sum(per_copy[e] for e in rank)) for rank in self.slots], dtype=torch.float64)

    def table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(E, max_replicas) physical ids padded with -1, and (E,) replica counts."""
        width = max(len(r) for r in self.replicas)
        table = torch.full((self.num_experts, width), -1, dtype=torch.int64)
        for e, ids in enumerate(self.replicas):
            table[e, : len(ids)] = torch.tensor(ids)
        return table, torch.tensor([len(r) for r in self.replicas])


def plan_replicas(expert_load, num_ranks: int, slots_per_rank: int) -> ReplicaPlan:
    """Replicate hot experts into spare slots and pack replicas onto ranks; see the module doc."""
    load = torch.as_tensor(expert_load, dtype=torch.float64).flatten()
    num_experts = load.numel()
    if num_ranks < 1 or slots_per_rank < 1:
        raise ValueError(f"num_ranks and slots_per_rank must be >= 1, got {num_ranks}, {slots_per_rank}")
    if num_ranks * slots_per_rank < num_experts:
        raise ValueError(
            f"num_ranks * slots_per_rank ({num_ranks * slots_per_rank}) must be >= num_experts ({num_experts})"
        )
    if bool((load < 0).any()):
        raise ValueError("expert_load must be non-negative")
    copies = [1] * num_experts
    for _ in range(num_ranks * slots_per_rank - num_experts):
        hottest = max(range(num_experts), key=lambda e: (load[e].item() / copies[e], -e))
        copies[hottest] += 1
    items = sorted(((load[e].item() / copies[e], e) for e in range(num_experts) for _ in range(copies[e])),
                   key=lambda item: (-item[0], item[1]))
    rank_load = [0.0] * num_ranks
    slots: list[list[int]] = [[] for _ in range(num_ranks)]
    for weight, e in items:
        rank = min((r for r in range(num_ranks) if len(slots[r]) < slots_per_rank), key=lambda r: (rank_load[r], r))
        slots[rank].append(e)
        rank_load[rank] += weight
    replicas: list[list[int]] = [[] for _ in range(num_experts)]
    for r, experts in enumerate(slots):
        for s, e in enumerate(experts):
            replicas[e].append(r * slots_per_rank + s)
    return ReplicaPlan(num_experts, num_ranks, slots_per_rank,
                       tuple(tuple(x) for x in slots), tuple(tuple(x) for x in replicas))
