"""Predict one prefill of the MoE transformer on a cp x ep mesh by scheduling its events.

Per layer and rank (c, e) (global rank c * ep + e, as ``parallel.mesh``):

1. QKV projection (compute).
2. Ring attention over the ranks with the same e: at step s the rank attends to
   the K/V block of rank c - s (visible pairs from the layout's planner) and
   merges; the block it holds is passed to c + 1 while it computes (a transfer
   on its outgoing link and the receiver's incoming link, which may start once
   the receiver has freed the buffer of step s - 1: double buffering).
3. O projection and the router.
4. Expert parallelism over the ranks with the same c, in ``chunks``
   micro-batches: dispatch transfers (one row per token and destination rank),
   expert compute on each owner (its share of assignments, skewed by ``skew``),
   combine transfers back, issued in the implementation's order.

Every layer is identical, so the prefill is ``num_layers`` times one layer
(plus the last token's LM head).  Transfers between devices of one node use
the intra-node link, others the inter-node link.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..model.config import ModelConfig
from ..moe.expert_parallel import compute_order
from ..parallel.layout import check_layout
from .costs import (
    expert_flops_per_assignment,
    kv_block_bytes,
    memory_per_rank,
    min_tokens_for_overlap,
    rank_shares,
    ring_step_pairs,
    rows_to_rank,
)
from .events import Timeline
from .hardware import Hardware

__all__ = ["Scenario", "Prediction", "simulate"]


MAX_EVENTS = 50_000  # events of one layer's schedule: ~0.3 ms each on a CPU core


@dataclass(frozen=True)
class Scenario:
    """What to predict.  batch None = ep sequences (one per expert-parallel coordinate)."""

    config: ModelConfig
    hw: Hardware
    seqlen: int
    cp: int = 1
    ep: int = 1
    batch: int | None = None
    layout: str = "zigzag"
    causal: bool = True
    skew: float = 1.0          # max/mean expert load over ep ranks
    chunks: int = 1            # EP micro-batches (overlap_chunks)
    element_bytes: int = 2     # bf16
    dispatch_bytes: float | None = None  # bytes per dispatched element (1 for FP8 dispatch); default element_bytes
    parts: tuple = ("attention", "moe")

    @property
    def rows(self) -> int:
        return self.batch if self.batch is not None else self.ep


@dataclass
class Prediction:
    """Seconds and bytes of one layer (per rank lists are indexed by global rank) and the whole prefill."""

    scenario: Scenario
    layer_s: float
    prefill_s: float
    tokens_per_rank: int
    ring_s: float = 0.0                                      # slowest rank: QKV done -> last ring step done
    attention_step_s: list = field(default_factory=list)     # [rank][step] compute seconds
    ring_wait_s: list = field(default_factory=list)          # [rank] compute idle waiting for K/V
    kv_bytes_per_step: int = 0
    ring_exposed_fraction: float = 0.0
    min_tokens_for_overlap: float = 0.0
    dispatch_bytes: list = field(default_factory=list)       # [rank] sent to other ranks
    combine_bytes: list = field(default_factory=list)
    dispatch_s: list = field(default_factory=list)           # [rank] first dispatch start -> last arrival
    expert_s: list = field(default_factory=list)             # [rank] expert compute
    moe_s: list = field(default_factory=list)                # [rank] router start -> output complete
    straggler_s: float = 0.0                                 # slowest rank's experts end - mean end
    attention_imbalance: float = 1.0
    memory: dict = field(default_factory=dict)
    breakdown: dict = field(default_factory=dict)            # per layer, slowest rank: attention, moe, projections
    timeline: Timeline | None = None                         # every task of the layer, for inspection and plots


class _Layer:
    """One layer's schedule on the whole mesh: the shared timeline and the per-rank helpers."""

    def __init__(self, s: Scenario):
        self.s, self.c, self.hw = s, s.config, s.hw
        self.world = s.cp * s.ep
        self.batch_local = s.rows // s.ep
        self.local = s.seqlen // s.cp
        self.tokens = self.batch_local * self.local
        self.t = Timeline()

    def rank(self, cp_rank: int, ep_rank: int) -> int:
        return cp_rank * self.s.ep + ep_rank

    def same_node(self, a: int, b: int) -> bool:
        return a // self.hw.devices_per_node == b // self.hw.devices_per_node

    def compute(self, name: str, r: int, seconds: float, after=()):
        return self.t.add(name, "compute", r, (("compute", r),), seconds, after=after)

    def transfer(self, name: str, src: int, dst: int, nbytes: float, after=()):
        # a device's NVLink and its NIC are separate queues, each way
        near = self.same_node(src, dst)
        return self.t.add(name, "transfer", src, (("out", src, near), ("in", dst, near)),
                          self.hw.transfer_time(nbytes, near), after=after, nbytes=nbytes)

    def ring(self, qkv: dict) -> dict:
        """Ring attention steps per rank; K/V of step s travel while step s computes (double buffered)."""
        s, c, hw = self.s, self.c, self.hw
        kv_bytes = kv_block_bytes(c, self.batch_local, self.local, s.element_bytes)
        merge_s = 3 * self.tokens * c.num_heads * c.head_dim * 4 / hw.memory_bandwidth  # two fp32 partials in, one out
        per_pair = 4 * c.head_dim * c.num_heads * self.batch_local
        arrived = dict(qkv)  # the K/V block a rank holds at the current step
        previous = {r: None for r in range(self.world)}
        steps: dict[int, list] = {r: [] for r in range(self.world)}
        for step in range(s.cp):
            incoming = {}
            if step < s.cp - 1:  # pass the held block on; the receiver must have freed the buffer of step - 1
                for cp_rank in range(s.cp):
                    for ep_rank in range(s.ep):
                        src, dst = self.rank(cp_rank, ep_rank), self.rank((cp_rank + 1) % s.cp, ep_rank)
                        incoming[dst] = self.transfer(f"kv{step}:{src}->{dst}", src, dst, kv_bytes,
                                                      after=(arrived[src], previous[dst]))
            for cp_rank in range(s.cp):
                full, masked, calls = ring_step_pairs(s.seqlen, s.cp, cp_rank, step, s.layout, s.causal)
                seconds = (calls * hw.kernel_overhead + (merge_s if step else 0.0)
                           + per_pair * (full + masked / hw.causal_efficiency) / hw.attention_flops)
                for ep_rank in range(s.ep):
                    r = self.rank(cp_rank, ep_rank)
                    previous[r] = self.compute(f"attn{step}:{r}", r, seconds, after=(arrived[r],))
                    steps[r].append(previous[r])
            arrived.update(incoming)
        return steps

    def experts(self, router: dict, shares: list[float]):
        """Dispatch, expert compute and combine in chunks, per ep group, in the implementation's issue order.

        Returns (done task per rank, expert tasks per rank, dispatch tasks per rank, bytes sent by dispatch,
        bytes sent by combine).
        """
        s, c, hw = self.s, self.c, self.hw
        local_experts = c.num_experts // s.ep
        row_bytes = c.hidden_size * (s.dispatch_bytes if s.dispatch_bytes is not None else s.element_bytes)
        back_bytes = c.hidden_size * s.element_bytes
        flops_per_assignment = expert_flops_per_assignment(c)
        # memory-bound work per assignment: gather the row in, SwiGLU (read 2F, write F), scatter and weight the result
        bytes_per_assignment = (4 * c.hidden_size + 3 * c.ffn_size) * s.element_bytes
        rows = [rows_to_rank(self.tokens / s.chunks, c.num_experts, c.top_k, share) for share in shares]
        work = [self.tokens * c.top_k / s.chunks * share * s.ep for share in shares]  # an owner's assignments per chunk
        done = {}
        expert_tasks = {r: [] for r in range(self.world)}
        dispatch_tasks = {r: [] for r in range(self.world)}
        sent_dispatch, sent_combine = [0.0] * self.world, [0.0] * self.world

        def expert_seconds(assignments):
            return (local_experts * hw.kernel_overhead + assignments * flops_per_assignment / hw.matmul_flops
                    + assignments * bytes_per_assignment / hw.memory_bandwidth)

        for cp_rank in range(s.cp):
            group = [self.rank(cp_rank, e) for e in range(s.ep)]

            def dispatch(chunk):
                arrivals = {d: [] for d in group}
                for src in group:
                    for j, dst in enumerate(group):
                        if src != dst:
                            sent_dispatch[src] += rows[j] * row_bytes
                            task = self.transfer(f"dispatch{chunk}:{src}->{dst}", src, dst, rows[j] * row_bytes,
                                                 after=(router[src],))
                            arrivals[dst].append(task)
                            dispatch_tasks[src].append(task)
                return arrivals

            def combine(chunk, owner, j, task, finished):
                for dst in group:
                    if dst != owner:
                        sent_combine[owner] += rows[j] * back_bytes
                        finished[dst].append(self.transfer(f"combine{chunk}:{owner}->{dst}", owner, dst,
                                                           rows[j] * back_bytes, after=(task,)))

            arrivals = [dispatch(chunk) for chunk in range(s.chunks)]  # every chunk's dispatch is sent at once
            finished = {r: [] for r in group}
            if s.chunks == 1:  # no overlap: wait for the dispatch, compute everything, then combine
                for j, owner in enumerate(group):
                    task = self.compute(f"experts0:{owner}", owner, expert_seconds(work[j]),
                                        after=(router[owner], *arrivals[0][owner]))
                    expert_tasks[owner].append(task)
                    finished[owner].append(task)
                    combine(0, owner, j, task, finished)
            else:  # the implementation's order: own rows while remote rows travel, last chunk flipped
                for part, chunk in compute_order(s.chunks):
                    for j, owner in enumerate(group):
                        own = work[j] / s.ep  # every rank routes the same number of tokens to an owner
                        waits = () if part == "local" else tuple(arrivals[chunk][owner])
                        task = self.compute(f"experts{chunk}{part}:{owner}", owner,
                                            expert_seconds(own if part == "local" else work[j] - own),
                                            after=(router[owner], *waits))
                        expert_tasks[owner].append(task)
                        if part == "local":
                            finished[owner].append(task)
                        else:
                            combine(chunk, owner, j, task, finished)
            for r in group:
                done[r] = self.compute(f"sum{r}", r, 0.0, after=tuple(finished[r]))
        return done, expert_tasks, dispatch_tasks, sent_dispatch, sent_combine


def _check_scenario(s: Scenario) -> None:
    """ValueError naming what a scenario gets wrong, or that the cost model would take too long to schedule."""
    c = s.config
    if s.rows % s.ep:
        raise ValueError(f"batch ({s.rows}) must be divisible by ep ({s.ep})")
    if c.num_experts % s.ep:
        raise ValueError(f"ep ({s.ep}) must divide num_experts ({c.num_experts})")
    if s.cp > 1:
        check_layout(s.seqlen, s.cp, s.layout)
    if not isinstance(s.chunks, int) or s.chunks < 1:
        raise ValueError(f"chunks must be a positive int, got {s.chunks!r}")
    events = s.cp * s.cp * s.ep + s.cp * s.ep * s.ep * s.chunks
    if events > MAX_EVENTS:
        raise ValueError(f"cp={s.cp}, ep={s.ep}, chunks={s.chunks} means {events:,} events per layer "
                         f"(cp^2 ep + cp ep^2 chunks); the cost model schedules at most {MAX_EVENTS:,} "
                         f"(about 15 s): lower cp, ep or chunks")


def simulate(s: Scenario) -> Prediction:
    _check_scenario(s)
    c, hw = s.config, s.hw
    layer = _Layer(s)
    world, tokens, t = layer.world, layer.tokens, layer.t
    shares = rank_shares(s.ep, s.skew)
    in_proj = tokens * 2 * c.hidden_size * c.head_dim * (c.num_heads + 2 * c.num_kv_heads)
    out_proj = tokens * 2 * c.hidden_size * c.head_dim * c.num_heads
    router_flops = 2 * tokens * c.hidden_size * c.num_experts

    qkv = {r: layer.compute(f"qkv{r}", r, hw.kernel_overhead + in_proj / hw.matmul_flops) for r in range(world)}
    attn_steps = layer.ring(qkv) if "attention" in s.parts else {r: [] for r in range(world)}
    attn_done = {r: attn_steps[r][-1] if attn_steps[r] else qkv[r] for r in range(world)}
    o_proj = {r: layer.compute(f"o{r}", r, hw.kernel_overhead + out_proj / hw.matmul_flops, after=(attn_done[r],))
              for r in range(world)}
    router = {r: layer.compute(f"router{r}", r, hw.kernel_overhead + router_flops / hw.matmul_flops,
                               after=(o_proj[r],)) for r in range(world)}
    if "moe" in s.parts:
        done, expert_tasks, dispatch_tasks, sent_dispatch, sent_combine = layer.experts(router, shares)
    else:
        done, expert_tasks, dispatch_tasks = dict(router), {r: [] for r in range(world)}, {r: [] for r in range(world)}
        sent_dispatch, sent_combine = [0.0] * world, [0.0] * world

    layer_s = t.end()
    lm_head = 2 * c.hidden_size * c.vocab_size * s.rows / hw.matmul_flops
    steps = [[x.duration for x in attn_steps[r]] for r in range(world)]
    waits = [t.idle_between(attn_steps[r]) + (attn_steps[r][0].start - qkv[r].end) if attn_steps[r] else 0.0
             for r in range(world)]
    attn_total = [sum(x) for x in steps]
    mean_attn = sum(attn_total) / world
    expert_end = [max((x.end for x in expert_tasks[r]), default=router[r].end) for r in range(world)]
    recv_rows = s.ep * rows_to_rank(tokens, c.num_experts, c.top_k, shares[0])  # rows the hottest owner receives
    slowest = max(range(world), key=lambda r: done[r].end)
    return Prediction(
        scenario=s,
        layer_s=layer_s,
        ring_s=max((attn_done[r].end - qkv[r].end for r in range(world)), default=0.0),
        prefill_s=c.num_layers * layer_s + lm_head,
        tokens_per_rank=tokens,
        attention_step_s=steps,
        ring_wait_s=waits,
        kv_bytes_per_step=kv_block_bytes(c, layer.batch_local, layer.local, s.element_bytes) if s.cp > 1 else 0,
        ring_exposed_fraction=max((w / (w + a) if w + a > 0 else 0.0) for w, a in zip(waits, attn_total)),
        min_tokens_for_overlap=min_tokens_for_overlap(c, hw, layer.batch_local, s.element_bytes,
                                                      same_node=world <= hw.devices_per_node),
        dispatch_bytes=sent_dispatch,
        combine_bytes=sent_combine,
        dispatch_s=[(max(x.end for x in dispatch_tasks[r]) - min(x.start for x in dispatch_tasks[r]))
                    if dispatch_tasks[r] else 0.0 for r in range(world)],
        expert_s=[sum(x.duration for x in expert_tasks[r]) for r in range(world)],
        moe_s=[done[r].end - router[r].start for r in range(world)],
        straggler_s=max(expert_end) - sum(expert_end) / world,
        attention_imbalance=max(attn_total) / mean_attn if mean_attn > 0 else 1.0,
        memory=memory_per_rank(c, s.cp, s.ep, layer.batch_local, layer.local, s.element_bytes, recv_rows, s.chunks),
        timeline=t,
        breakdown={
            "projections_s": qkv[slowest].duration + o_proj[slowest].duration + router[slowest].duration,
            "attention_s": attn_done[slowest].end - qkv[slowest].end,
            "moe_s": done[slowest].end - router[slowest].end,
        },
    )
