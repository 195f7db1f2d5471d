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
   carrying its router weights and local expert ids there as 2k extra
   columns (a second exchange when the rows are in low precision);
4. each owner expands the rows to (row, expert) assignments, runs each local
   expert on its rows, and sums the router-weighted outputs per row;
5. combine: the reverse ``all_to_all`` brings one row per (token, rank) home,
   where the rows are summed per token.

Rows a rank routes to its own experts never enter the exchange.
``overlap_chunks = n`` splits the local tokens into n micro-batches and
pipelines them: every chunk's dispatch is sent at once (one exchange of
counts first), each chunk's own rows compute while its remote rows travel,
and chunk i's combine travels while later chunks compute (the last chunk
computes its own rows last, to cover the last combine).  Both exchanges are
differentiable; the backward runs them synchronously per chunk.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..parallel.watchdog import activity
from .dispatch import capacity_for, plan_dispatch
from ..parallel.exchange import exchange_counts, start_all_to_all
from .stats import MoEStats

__all__ = ["expert_parallel_forward"]


def _capacity_keep(layer, plan, routing, tokens) -> torch.Tensor:
    """Bool (N,) over ``plan.order``: which assignments the experts' owners keep."""
    if layer.capacity_factor is None:
        return torch.ones(plan.order.numel(), dtype=torch.bool, device=plan.order.device)
    # replicas need dropless (the layer rejects capacity with them), so plan ids are one per expert here
    group, world, local = layer.group, layer.ep_size, layer.local_experts
    device = plan.order.device
    total_tokens = torch.tensor([tokens], dtype=torch.int64, device=device)
    dist.all_reduce(total_tokens, group=group)
    capacity = capacity_for(layer.capacity_factor, int(total_tokens), layer.top_k, layer.num_experts)
    send_counts = plan.routed.view(world, local)
    recv_counts = exchange_counts(send_counts, group)
    send_splits, recv_splits = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
    weights = routing.topk_weight.detach().reshape(-1).index_select(0, plan.order).float()
    received = torch.empty(sum(recv_splits), dtype=torch.float32, device=device)
    dist.all_to_all_single(received, weights.contiguous(), recv_splits, send_splits, group=group)
    local_expert = torch.repeat_interleave(torch.arange(local, device=device).repeat(world), recv_counts.reshape(-1))
    owner_plan = plan_dispatch(local_expert.view(-1, 1), received.view(-1, 1), local, capacity)
    flags = torch.zeros(received.numel(), dtype=torch.float32, device=device)
    flags[owner_plan.order] = 1.0
    home = torch.empty(plan.order.numel(), dtype=torch.float32, device=device)
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
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    table, copies = table.to(flat.device), copies.to(flat.device)
    return table[flat, rank_in_expert % copies[flat]].view_as(topk_idx)


def _chunk_bounds(tokens: int, chunks: int) -> list[tuple[int, int]]:
    step = -(-tokens // chunks) if tokens else 0
    return [(min(tokens, i * step), min(tokens, (i + 1) * step)) for i in range(chunks)]


class _Chunk:
    """One micro-batch [lo, hi) of this rank's tokens: the rows its own experts take and the rows that travel.

    A row is one (token, destination rank) pair; its meta (R, 2k) holds the router weights of the token's
    experts on that rank, then their local ids (-1 = unused slot).  Rows are sorted by destination rank.
    """

    def __init__(self, layer, plan, keep, weights, lo: int, hi: int, meta_dtype: torch.dtype):
        k, local, key = layer.top_k, layer.local_experts, max(hi, 1)
        sel = keep & (plan.token >= lo) & (plan.token < hi)
        tok, phys = plan.token[sel], plan.expert[sel]
        pairs, pair_of = torch.unique(phys // local * key + tok, return_inverse=True)  # sorted: grouped by rank
        pair_token, pair_dest = pairs % key, pairs // key
        # slot of each assignment inside its row: a token may pick several experts on one rank
        per_pair = torch.bincount(pair_of, minlength=pairs.numel())
        order = torch.argsort(pair_of, stable=True)
        slot = torch.empty_like(pair_of)
        device = tok.device
        starts = torch.cumsum(per_pair, 0) - per_pair
        slot[order] = torch.arange(pair_of.numel(), device=device) - starts[pair_of[order]]
        ids = torch.full((pairs.numel(), k), -1.0, dtype=meta_dtype, device=device)
        ids = ids.index_put((pair_of, slot), (phys % local).to(meta_dtype))
        w = torch.zeros(pairs.numel(), k, dtype=meta_dtype, device=device)
        w = w.index_put((pair_of, slot), weights[sel].to(meta_dtype))
        meta = torch.cat([w, ids], dim=1)  # the router weights keep their gradient
        mine = pair_dest == layer.ep_rank
        self.local_token, self.local_meta = pair_token[mine], meta[mine]
        self.remote_token, self.remote_meta = pair_token[~mine], meta[~mine]
        self.send_counts = torch.bincount(pair_dest[~mine], minlength=layer.ep_size)  # 0 for this rank
        self.send_splits = self.recv_splits = None
        self.dispatch = self.combine = None

    def start_dispatch(self, flat: torch.Tensor, group) -> None:
        """Send the travelling rows with their meta (one exchange when the dtypes agree, else two)."""
        rows = flat.index_select(0, self.remote_token)
        if rows.dtype == self.remote_meta.dtype:
            self.dispatch = (start_all_to_all(torch.cat([rows, self.remote_meta], 1), self.send_splits,
                                              self.recv_splits, group),)
        else:
            self.dispatch = tuple(start_all_to_all(t, self.send_splits, self.recv_splits, group)
                                  for t in (rows, self.remote_meta))

    def received(self, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Wait for the dispatch: rows (M, H) from the other ranks for this rank's experts, meta (M, 2k)."""
        if len(self.dispatch) == 1:
            both = self.dispatch[0].result()
            return both[:, :hidden], both[:, hidden:]
        return self.dispatch[0].result(), self.dispatch[1].result()


def _run_local_experts(layer, rows: torch.Tensor, meta: torch.Tensor, out_dtype) -> torch.Tensor:
    """rows (M, H), meta (M, 2k) -> (M, H) out_dtype: each row's router-weighted sum over its experts here."""
    k = layer.top_k
    row_idx, slot_idx = (meta[:, k:] >= 0).nonzero(as_tuple=True)
    expert_of = meta[row_idx, k + slot_idx].detach().long()
    order = torch.argsort(expert_of, stable=True)  # group the (row, expert) assignments by expert
    row_idx, slot_idx = row_idx[order], slot_idx[order]
    out = layer.experts.grouped(rows.index_select(0, row_idx),
                                torch.bincount(expert_of, minlength=layer.local_experts).tolist())
    weighted = out.to(out_dtype) * meta[row_idx, slot_idx].to(out_dtype).unsqueeze(-1)
    # in place on a fresh buffer: autograd only needs the index to send gradients back to ``weighted``
    summed = torch.zeros(rows.shape[0], out.shape[-1], dtype=out_dtype, device=rows.device)
    return summed.index_add_(0, row_idx, weighted)


def compute_order(chunks: int) -> list[tuple[str, int]]:
    """[(part, chunk)], part "local" (rows this rank routed to its own experts) or "remote" (received rows).

    Each chunk's own rows run while its dispatch travels; for the last chunk the order flips, so its own
    rows run while the last combine travels.  The cost model (``ringmoe.sim``) schedules the same order."""
    steps = [(part, i) for i in range(chunks) for part in ("local", "remote")]
    if chunks > 1:
        steps[-2:] = steps[-2:][::-1]
    return steps


class _Laps(dict):
    """Seconds per phase: ``lap(name)`` charges the time since the previous lap to ``name``;
    ``blocked(fn, ...)`` also adds the time spent inside fn, waiting on an exchange, to ``wait_s``."""

    def __init__(self):
        super().__init__(route_s=0.0, dispatch_s=0.0, experts_s=0.0, combine_s=0.0, wait_s=0.0)
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self[name] += now - self._last
        self._last = now

    def blocked(self, fn, *args):
        start = time.perf_counter()
        out = fn(*args)
        self["wait_s"] += time.perf_counter() - start
        return out


def expert_parallel_forward(layer, flat: torch.Tensor, routing) -> torch.Tensor:
    with activity("moe expert-parallel exchange"):
        return _expert_parallel_forward(layer, flat, routing)


def _expert_parallel_forward(layer, flat: torch.Tensor, routing) -> torch.Tensor:
    """flat (T, H) this rank's tokens -> (T, H) float32 (float64 stays): the weighted expert outputs.

    overlap_chunks = 1 runs the exchanges synchronously (dispatch, compute, combine); n > 1 sends every
    chunk's dispatch at once and computes in ``compute_order``, each combine leaving as its chunk is done.
    ``layer.sync_exchanges`` waits for every exchange as soon as it starts: the same chunks without overlap.
    """
    group, hidden, tokens, k = layer.group, flat.shape[-1], flat.shape[0], layer.top_k
    laps = _Laps()
    plan = plan_dispatch(_to_replicas(layer, routing.topk_idx), routing.topk_weight, layer.physical_experts, None)
    keep = _capacity_keep(layer, plan, routing, tokens)
    weights = routing.topk_weight.reshape(-1).index_select(0, plan.order)
    out_dtype = torch.promote_types(flat.dtype, torch.float32)
    meta_dtype = torch.promote_types(weights.dtype, torch.float32)  # router weights at full precision
    chunks = [_Chunk(layer, plan, keep, weights, lo, hi, meta_dtype)
              for lo, hi in _chunk_bounds(tokens, max(1, layer.overlap_chunks))]
    overlap = len(chunks) > 1 and not layer.sync_exchanges
    laps.lap("route_s")

    # every chunk's row counts in one exchange: (P, n) sent -> (P, n) received
    recv_counts = laps.blocked(exchange_counts, torch.stack([c.send_counts for c in chunks], dim=1), group)
    for i, chunk in enumerate(chunks):
        chunk.send_splits, chunk.recv_splits = chunk.send_counts.tolist(), recv_counts[:, i].tolist()
        chunk.start_dispatch(flat, group)
        if not overlap:
            laps.blocked(chunk.received, hidden)
    laps.lap("dispatch_s")
    y = torch.zeros(tokens, hidden, dtype=out_dtype, device=flat.device)
    computed_rows = torch.zeros((), dtype=torch.int64, device=flat.device)  # summed on the device: no sync
    for part, i in compute_order(len(chunks)):
        chunk = chunks[i]
        if part == "local":
            rows, meta = flat.index_select(0, chunk.local_token), chunk.local_meta
        else:
            rows, meta = laps.blocked(chunk.received, hidden)
            laps.lap("dispatch_s")
        out = _run_local_experts(layer, rows, meta, out_dtype)
        computed_rows = computed_rows + (meta[:, k:] >= 0).sum()
        if part == "local":
            y.index_add_(0, chunk.local_token, out)  # in place: y is a fresh buffer, no copy per chunk
            laps.lap("experts_s")
            continue
        laps.lap("experts_s")
        chunk.combine = start_all_to_all(out.to(flat.dtype), chunk.recv_splits, chunk.send_splits, group)
        if not overlap:
            laps.blocked(chunk.combine.result)
        laps.lap("combine_s")
    for chunk in chunks:
        y.index_add_(0, chunk.remote_token, laps.blocked(chunk.combine.result).to(out_dtype))
    laps.lap("combine_s")
    row_bytes = hidden * flat.element_size() + 2 * k * meta_dtype.itemsize
    timings = dict(laps, dispatch_bytes=sum(c.remote_token.numel() for c in chunks) * row_bytes)
    layer.last_stats = _stats(layer, routing, plan, keep, computed_rows, timings)
    return y


def _stats(layer, routing, plan, keep, received_rows: torch.Tensor, timings):
    """Global per-expert counts (one all-reduce), rows and expert seconds per rank (one all-gather), timings."""

    group, world = layer.group, layer.ep_size
    device = plan.order.device
    kept_tokens = torch.zeros(routing.topk_idx.shape[0], dtype=torch.bool, device=device)
    kept_tokens[plan.token[keep]] = True
    logical = routing.topk_idx.reshape(-1).index_select(0, plan.order)
    routed_per_expert = torch.bincount(logical, minlength=layer.num_experts)
    kept_per_expert = torch.bincount(logical[keep], minlength=layer.num_experts)
    counts = torch.cat([routed_per_expert, kept_per_expert])
    dist.all_reduce(counts, group=group)
    routed, kept = counts[: layer.num_experts], counts[layer.num_experts :]
    # every rank's (rows computed, expert seconds): the straggler is the rank whose experts finish last
    gathered = [torch.zeros(2, dtype=torch.float64, device=device) for _ in range(world)]
    mine = torch.stack([received_rows.double(), torch.tensor(timings["experts_s"], dtype=torch.float64, device=device)])
    dist.all_gather(gathered, mine, group=group)
    gathered = torch.stack(gathered).cpu()
    per_rank = gathered[:, 0].long()
    timings["experts_s_per_rank"] = gathered[:, 1].tolist()
    timings["straggler_s"] = float(gathered[:, 1].max()) - timings["experts_s"]
    rank_mean = per_rank.float().mean()
    return MoEStats(
        tokens_per_expert=kept,
        routed_per_expert=routed,
        dropped_assignments=int((~keep).sum()),
        dropped_tokens=int((~kept_tokens).sum()),
        routing=routing,
        num_experts=layer.num_experts,
        tokens_per_rank=per_rank,
        rank_imbalance=float(per_rank.max() / rank_mean) if rank_mean > 0 else 1.0,
        timings=timings,
    )
