"""Expert parallelism: each rank of the group holds num_experts / P experts.

One forward on every rank:

1. route its own tokens (the router is replicated);
2. sort its (token, expert) assignments by expert, which also groups them by
   the rank that owns the expert, and exchange per-expert counts (a small
   all-to-all of P x E_local integers);
3. dispatch: ``all_to_all`` the assignment rows to the experts' owners (a token
   that chose two experts on two ranks is sent to both; bytes are exactly the
   routed rows);
4. regroup what arrived by local expert, apply the capacity (if any) over all
   ranks' assignments at once (so the result equals a single rank holding every
   expert and every token), run each local expert on its rows;
5. combine: the reverse ``all_to_all`` brings the outputs home, where they are
   weighted by the router and summed per token.

Both exchanges are differentiable, so gradients reach the remote experts and
come back to the tokens.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .dispatch import capacity_for, plan_dispatch, unpermute
from .exchange import all_to_all, exchange_counts
from .router import load_balancing_loss, router_z_loss

__all__ = ["expert_parallel_forward"]


def expert_parallel_forward(layer, flat: torch.Tensor, routing) -> torch.Tensor:
    """flat (T, H) this rank's tokens -> (T, H) float32 (float64 stays) expert output, weighted and summed."""
    group, world, local = layer.group, layer.ep_size, layer.local_experts
    tokens = flat.shape[0]
    clock = {"start": time.perf_counter()}
    plan = plan_dispatch(routing.topk_idx, routing.topk_weight, layer.num_experts, None)
    send_counts = plan.routed.view(world, local)
    recv_counts = exchange_counts(send_counts, group)  # (P, E_local): rows from each rank per local expert
    send_splits, recv_splits = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
    clock["routed"] = time.perf_counter()

    received = all_to_all(flat.index_select(0, plan.token), send_splits, recv_splits, group)
    # which local expert each received row is for: rows from a rank arrive sorted by expert
    local_expert = torch.repeat_interleave(torch.arange(local).repeat(world), recv_counts.reshape(-1))
    capacity = None
    if layer.capacity_factor is not None:
        total_tokens = torch.tensor([tokens], dtype=torch.int64)
        dist.all_reduce(total_tokens, group=group)
        capacity = capacity_for(layer.capacity_factor, int(total_tokens), layer.top_k, layer.num_experts)
        weights = routing.topk_weight.reshape(-1).index_select(0, plan.order).detach().contiguous()
        received_weights = all_to_all(weights.unsqueeze(1), send_splits, recv_splits, group).squeeze(1)
    else:
        received_weights = torch.zeros(received.shape[0], dtype=torch.float32)
    # local plan over the received rows: group by expert, keep each expert's top-capacity by weight
    local_plan = plan_dispatch(local_expert.view(-1, 1), received_weights.view(-1, 1), local, capacity)
    clock["dispatched"] = time.perf_counter()

    expert_out = layer.experts.grouped(received.index_select(0, local_plan.order), local_plan.counts.tolist())
    rows_out = torch.zeros(received.shape[0], expert_out.shape[-1], dtype=expert_out.dtype)
    rows_out = rows_out.index_copy(0, local_plan.order, expert_out)  # dropped rows stay 0
    clock["computed"] = time.perf_counter()

    back = all_to_all(rows_out, recv_splits, send_splits, group)
    y = unpermute(back, plan, routing.topk_weight, tokens)
    clock["combined"] = time.perf_counter()
    layer.last_stats = _stats(layer, routing, plan, local_plan, recv_splits, send_splits, clock)
    return y


def _stats(layer, routing, plan, local_plan, recv_splits, send_splits, clock):
    """Global counts (one all-reduce and one all-gather of small integer vectors) and this rank's timings."""
    from .layer import MoEStats

    group, world = layer.group, layer.ep_size
    # per-received-row kept flag, sent home so each rank can count its own dropped tokens
    if local_plan.capacity is None:
        home_flags = torch.ones(plan.order.numel(), dtype=torch.bool)
    else:
        flags = torch.zeros(sum(recv_splits), 1, dtype=torch.float32)
        flags[local_plan.order] = 1.0
        home_flags = all_to_all(flags, recv_splits, send_splits, group).squeeze(1) > 0
    kept_tokens = torch.zeros(routing.topk_idx.shape[0], dtype=torch.bool)
    kept_tokens[plan.token[home_flags]] = True
    counts = torch.cat([plan.routed, torch.zeros(layer.num_experts, dtype=torch.int64)])
    counts[layer.num_experts + layer.expert_offset : layer.num_experts + layer.expert_offset + layer.local_experts] = (
        local_plan.counts
    )
    dist.all_reduce(counts, group=group)
    routed, kept = counts[: layer.num_experts], counts[layer.num_experts :]
    per_rank = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(per_rank, torch.tensor([sum(recv_splits)], dtype=torch.int64), group=group)
    per_rank = torch.cat(per_rank)
    mean, rank_mean = routed.float().mean(), per_rank.float().mean()
    return MoEStats(
        tokens_per_expert=kept,
        routed_per_expert=routed,
        dropped_assignments=int((~home_flags).sum()),
        dropped_tokens=int((~kept_tokens).sum()),
        aux_loss=load_balancing_loss(routing.probs, routing.topk_idx, layer.num_experts),
        z_loss=router_z_loss(routing.logits),
        imbalance=float(routed.max() / mean) if mean > 0 else 1.0,
        tokens_per_rank=per_rank,
        rank_imbalance=float(per_rank.max() / rank_mean) if rank_mean > 0 else 1.0,
        timings={
            "route_s": clock["routed"] - clock["start"],
            "dispatch_s": clock["dispatched"] - clock["routed"],
            "experts_s": clock["computed"] - clock["dispatched"],
            "combine_s": clock["combined"] - clock["computed"],
        },
    )
