"""Expert parallelism: each rank of the group holds num_experts / P experts.

One forward on every rank:

1. route its own tokens (the router is replicated) and sort its (token, expert)
   assignments by expert, which also groups them by the rank owning the expert;
2. capacity mode only: send each assignment's router weight to the expert's
   owner, which keeps its ``capacity`` heaviest assignments over *all* ranks
   (so the result equals one rank holding every expert and token) and answers
   with keep flags; dropped assignments never travel;
3. dispatch: exchange row counts, then ``all_to_all`` one row per (token,
   destination rank) -- a token that chose two experts on two ranks is sent to
   both, one that chose two experts on the same rank is sent there once --
   with a small side tensor of its expert ids and router weights there;
4. each owner expands the rows to (row, expert) assignments, runs each local
   expert on its rows, and sums the router-weighted outputs per row;
5. combine: the reverse ``all_to_all`` brings one row per (token, rank) home,
   where the rows are summed per token.

``overlap_chunks = n`` splits the local tokens into n micro-batches and
pipelines them: chunk i+1's dispatch is in flight while chunk i's experts run,
and chunk i's combine is in flight while chunk i+1 computes.  Both exchanges
are differentiable; the backward runs them synchronously per chunk.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .dispatch import capacity_for, plan_dispatch
from .exchange import exchange_counts, start_all_to_all
from .router import load_balancing_loss, router_z_loss

__all__ = ["expert_parallel_forward"]


def _capacity_keep(layer, plan, routing, tokens) -> torch.Tensor:
    """Bool (N,) over ``plan.order``: which assignments the experts' owners keep."""
    if layer.capacity_factor is None:
        return torch.ones(plan.order.numel(), dtype=torch.bool)
    # replicas need dropless (the layer rejects capacity with them), so plan ids are one per expert here
    group, world, local = layer.group, layer.ep_size, layer.local_experts
    total_tokens = torch.tensor([tokens], dtype=torch.int64)
    dist.all_reduce(total_tokens, group=group)
    capacity = capacity_for(layer.capacity_factor, int(total_tokens), layer.top_k, layer.num_experts)
    send_counts = plan.routed.view(world, local)
    recv_counts = exchange_counts(send_counts, group)
    send_splits, recv_splits = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
    weights = routing.topk_weight.detach().reshape(-1).index_select(0, plan.order).float()
    received = torch.empty(sum(recv_splits), dtype=torch.float32)
    dist.all_to_all_single(received, weights.contiguous(), recv_splits, send_splits, group=group)
    local_expert = torch.repeat_interleave(torch.arange(local).repeat(world), recv_counts.reshape(-1))
    owner_plan = plan_dispatch(local_expert.view(-1, 1), received.view(-1, 1), local, capacity)
    flags = torch.zeros(received.numel(), dtype=torch.float32)
    flags[owner_plan.order] = 1.0
    home = torch.empty(plan.order.numel(), dtype=torch.float32)
    dist.all_to_all_single(home, flags, send_splits, recv_splits, group=group)
    return home > 0


def _to_replicas(layer, topk_idx: torch.Tensor) -> torch.Tensor:
    """Logical expert ids (T, k) -> physical ids: a replicated expert's assignments go round-robin to its copies."""
    if layer.replica_plan is None:
        return topk_idx
    table, copies = layer.replica_table
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=layer.num_experts)
    rank_in_expert = torch.empty_like(flat)
    rank_in_expert[order] = torch.arange(flat.numel()) - (torch.cumsum(counts, 0) - counts)[flat[order]]
    return table[flat, rank_in_expert % copies[flat]].view_as(topk_idx)


def _chunk_bounds(tokens: int, chunks: int) -> list[tuple[int, int]]:
    step = -(-tokens // chunks) if tokens else 0
    return [(min(tokens, i * step), min(tokens, (i + 1) * step)) for i in range(chunks)]


def expert_parallel_forward(layer, flat: torch.Tensor, routing) -> torch.Tensor:
    """flat (T, H) this rank's tokens -> (T, H) float32 (float64 stays): the weighted expert outputs."""
    group, world, local = layer.group, layer.ep_size, layer.local_experts
    tokens = flat.shape[0]
    timings = {"route_s": 0.0, "dispatch_s": 0.0, "experts_s": 0.0, "combine_s": 0.0}
    start = time.perf_counter()
    physical = layer.physical_experts
    plan = plan_dispatch(_to_replicas(layer, routing.topk_idx), routing.topk_weight, physical, None)
    keep = _capacity_keep(layer, plan, routing, tokens)
    weights = routing.topk_weight.reshape(-1).index_select(0, plan.order)
    timings["route_s"] = time.perf_counter() - start

    k = layer.top_k
    out_dtype = torch.promote_types(flat.dtype, torch.float32)
    meta_dtype = torch.promote_types(weights.dtype, torch.float32)  # router weights at full precision

    def launch(lo, hi):
        """Chunk [lo, hi): one row per (token, destination rank) plus its experts there and their weights."""
        sel = keep & (plan.token >= lo) & (plan.token < hi)
        tok, phys = plan.token[sel], plan.expert[sel]
        dest = phys // local
        pairs, pair_of = torch.unique(dest * tokens + tok, return_inverse=True)  # sorted: grouped by rank
        pair_token = pairs % tokens
        # slot of each assignment inside its pair: a token may pick several experts on one rank
        per_pair = torch.bincount(pair_of, minlength=pairs.numel())
        order = torch.argsort(pair_of, stable=True)
        slot = torch.empty_like(pair_of)
        slot[order] = torch.arange(pair_of.numel()) - (torch.cumsum(per_pair, 0) - per_pair)[pair_of[order]]
        # meta (pairs, 2k): [router weights | local expert ids, -1 = unused]; weights keep their gradient
        ids = torch.full((pairs.numel(), k), -1.0, dtype=meta_dtype)
        ids = ids.index_put((pair_of, slot), (phys % local).to(meta_dtype))
        w = torch.zeros(pairs.numel(), k, dtype=meta_dtype).index_put((pair_of, slot), weights[sel].to(meta_dtype))
        send_splits = torch.bincount(pairs // tokens, minlength=world)
        recv_splits = exchange_counts(send_splits.view(world, 1), group).view(-1).tolist()
        send_splits = send_splits.tolist()
        rows = start_all_to_all(flat.index_select(0, pair_token), send_splits, recv_splits, group)
        meta = start_all_to_all(torch.cat([w, ids], dim=1), send_splits, recv_splits, group)
        return pair_token, send_splits, recv_splits, rows, meta

    bounds = _chunk_bounds(tokens, max(1, layer.overlap_chunks))
    y = torch.zeros(tokens, flat.shape[-1], dtype=out_dtype)
    computed_rows, remote_bytes = 0, 0
    row_bytes = flat.shape[-1] * flat.element_size() + 2 * k * meta_dtype.itemsize
    tick = time.perf_counter()
    in_flight = launch(*bounds[0])
    combines = []
    for i in range(len(bounds)):
        pair_token, send_splits, recv_splits, rows, meta = in_flight
        remote_bytes += (sum(send_splits) - send_splits[layer.ep_rank]) * row_bytes
        received, received_meta = rows.result(), meta.result()
        if i + 1 < len(bounds):
            in_flight = launch(*bounds[i + 1])  # next chunk travels while this one computes
        now = time.perf_counter()
        timings["dispatch_s"] += now - tick
        # expand each received row to its (row, expert) assignments, grouped by local expert
        row_idx, slot_idx = (received_meta[:, k:] >= 0).nonzero(as_tuple=True)
        expert_of = received_meta[row_idx, k + slot_idx].detach().long()
        order = torch.argsort(expert_of, stable=True)
        row_idx, slot_idx = row_idx[order], slot_idx[order]
        out = layer.experts.grouped(received.index_select(0, row_idx),
                                    torch.bincount(expert_of, minlength=local).tolist())
        weighted = out.to(out_dtype) * received_meta[row_idx, slot_idx].to(out_dtype).unsqueeze(-1)
        rows_out = torch.zeros(received.shape[0], out.shape[-1], dtype=out_dtype).index_add(0, row_idx, weighted)
        computed_rows += row_idx.numel()
        tick = time.perf_counter()
        timings["experts_s"] += tick - now
        combines.append((pair_token, start_all_to_all(rows_out.to(flat.dtype), recv_splits, send_splits, group)))
    for pair_token, pending in combines:
        y = y.index_add(0, pair_token, pending.result().to(out_dtype))
    timings["combine_s"] = time.perf_counter() - tick
    timings["dispatch_bytes"] = remote_bytes
    layer.last_stats = _stats(layer, routing, plan, keep, computed_rows, timings)
    return y


def _stats(layer, routing, plan, keep, received_rows, timings):
    """Global per-expert counts (one all-reduce), rows per rank (one all-gather), this rank's timings."""
    from .layer import MoEStats

    group, world = layer.group, layer.ep_size
    kept_tokens = torch.zeros(routing.topk_idx.shape[0], dtype=torch.bool)
    kept_tokens[plan.token[keep]] = True
    logical = routing.topk_idx.reshape(-1).index_select(0, plan.order)
    routed_per_expert = torch.bincount(logical, minlength=layer.num_experts)
    kept_per_expert = torch.bincount(logical[keep], minlength=layer.num_experts)
    counts = torch.cat([routed_per_expert, kept_per_expert])
    dist.all_reduce(counts, group=group)
    routed, kept = counts[: layer.num_experts], counts[layer.num_experts :]
    per_rank = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(per_rank, torch.tensor([received_rows], dtype=torch.int64), group=group)
    per_rank = torch.cat(per_rank)
    mean, rank_mean = routed.float().mean(), per_rank.float().mean()
    return MoEStats(
        tokens_per_expert=kept,
        routed_per_expert=routed,
        dropped_assignments=int((~keep).sum()),
        dropped_tokens=int((~kept_tokens).sum()),
        aux_loss=load_balancing_loss(routing.probs, routing.topk_idx, layer.num_experts),
        z_loss=router_z_loss(routing.logits),
        imbalance=float(routed.max() / mean) if mean > 0 else 1.0,
        tokens_per_rank=per_rank,
        rank_imbalance=float(per_rank.max() / rank_mean) if rank_mean > 0 else 1.0,
        timings=timings,
    )
