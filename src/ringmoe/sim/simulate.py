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


def _node(hw: Hardware, rank: int) -> int:
    return rank // hw.devices_per_node


def simulate(s: Scenario) -> Prediction:
    c, hw = s.config, s.hw
    if s.rows % s.ep:
        raise ValueError(f"batch ({s.rows}) must be divisible by ep ({s.ep})")
    if c.num_experts % s.ep:
        raise ValueError(f"ep ({s.ep}) must divide num_experts ({c.num_experts})")
    if s.cp > 1:
        check_layout(s.seqlen, s.cp, s.layout)
    if not isinstance(s.chunks, int) or s.chunks < 1:
        raise ValueError(f"chunks must be a positive int, got {s.chunks!r}")
    world = s.cp * s.ep
    batch_local = s.rows // s.ep
    local = s.seqlen // s.cp
    tokens = batch_local * local
    dispatch_element = s.dispatch_bytes if s.dispatch_bytes is not None else s.element_bytes
    t = Timeline()
    rank_of = lambda cp_rank, ep_rank: cp_rank * s.ep + ep_rank  # noqa: E731
    same_node = lambda a, b: _node(hw, a) == _node(hw, b)  # noqa: E731
    compute = lambda r: ("compute", r)  # noqa: E731
    # a device's NVLink and its NIC are separate queues, each way
    links = lambda a, b: (("out", a, same_node(a, b)), ("in", b, same_node(a, b)))  # noqa: E731

    # -- attention ------------------------------------------------------------------------
    qkv, attn_steps, attn_done = {}, {}, {}
    kv_bytes = kv_block_bytes(c, batch_local, local, s.element_bytes)
    in_proj = tokens * 2 * c.hidden_size * c.head_dim * (c.num_heads + 2 * c.num_kv_heads)
    out_proj = tokens * 2 * c.hidden_size * c.head_dim * c.num_heads
    merge_s = 3 * tokens * c.num_heads * c.head_dim * 4 / hw.memory_bandwidth  # read two partials, write one (fp32)
    for r in range(world):
        qkv[r] = t.add(f"qkv{r}", "compute", r, (compute(r),), hw.kernel_overhead + in_proj / hw.matmul_flops)
    if "attention" in s.parts:
        arrived = {r: qkv[r] for r in range(world)}  # the K/V block a rank holds at the current step
        previous_compute = {r: None for r in range(world)}
        for step in range(s.cp):
            incoming = {}
            if step < s.cp - 1:  # pass the held block on while computing on it
                for cp_rank in range(s.cp):
                    for ep_rank in range(s.ep):
                        src, dst = rank_of(cp_rank, ep_rank), rank_of((cp_rank + 1) % s.cp, ep_rank)
                        incoming[dst] = t.add(
                            f"kv{step}:{src}->{dst}", "transfer", src, links(src, dst),
                            hw.transfer_time(kv_bytes, same_node(src, dst)),
                            after=(arrived[src], previous_compute[dst]), nbytes=kv_bytes)
            for cp_rank in range(s.cp):
                full, masked, calls = ring_step_pairs(s.seqlen, s.cp, cp_rank, step, s.layout, s.causal)
                per_pair = 4 * c.head_dim * c.num_heads * batch_local
                seconds = per_pair * (full + masked / hw.causal_efficiency) / hw.attention_flops
                for ep_rank in range(s.ep):
                    r = rank_of(cp_rank, ep_rank)
                    duration = calls * hw.kernel_overhead + seconds + (merge_s if step else 0.0)
                    task = t.add(f"attn{step}:{r}", "compute", r, (compute(r),), duration, after=(arrived[r],))
                    attn_steps.setdefault(r, []).append(task)
                    previous_compute[r] = task
            arrived.update(incoming)
        attn_done = {r: attn_steps[r][-1] for r in range(world)}
    else:
        attn_done = dict(qkv)
    o_proj = {r: t.add(f"o{r}", "compute", r, (compute(r),), hw.kernel_overhead + out_proj / hw.matmul_flops,
                       after=(attn_done[r],)) for r in range(world)}

    # -- mixture of experts -------------------------------------------------------------------
    shares = rank_shares(s.ep, s.skew)
    assignments = tokens * c.top_k  # per rank, before splitting over owners
    router = {r: t.add(f"router{r}", "compute", r, (compute(r),),
                       hw.kernel_overhead + 2 * tokens * c.hidden_size * c.num_experts / hw.matmul_flops,
                       after=(o_proj[r],)) for r in range(world)}
    done = dict(router)
    expert_tasks: dict[int, list] = {r: [] for r in range(world)}
    sent_dispatch = [0.0] * world
    sent_combine = [0.0] * world
    dispatch_tasks: dict[int, list] = {r: [] for r in range(world)}
    if "moe" in s.parts:
        local_experts = c.num_experts // s.ep
        row_bytes = c.hidden_size * dispatch_element
        back_bytes = c.hidden_size * s.element_bytes
        flops_per_assignment = expert_flops_per_assignment(c)
        # memory-bound work per assignment: gather the row in, SwiGLU (read 2F, write F), scatter and weight the result
        bytes_per_assignment = (4 * c.hidden_size + 3 * c.ffn_size) * s.element_bytes
        for cp_rank in range(s.cp):
            group = [rank_of(cp_rank, e) for e in range(s.ep)]
            rows = [rows_to_rank(tokens / s.chunks, c.num_experts, c.top_k, share) for share in shares]
            work = [assignments / s.chunks * share * s.ep for share in shares]  # assignments an owner computes per chunk

            def dispatch(chunk):
                arrivals = {d: [] for d in group}
                for src in group:
                    for j, dst in enumerate(group):
                        if src == dst:
                            continue
                        nbytes = rows[j] * row_bytes
                        sent_dispatch[src] += nbytes
                        task = t.add(f"dispatch{chunk}:{src}->{dst}", "transfer", src, links(src, dst),
                                     hw.transfer_time(nbytes, same_node(src, dst)), after=(router[src],),
                                     nbytes=nbytes)
                        arrivals[dst].append(task)
                        dispatch_tasks[src].append(task)
                return arrivals

            pending = dispatch(0)
            finished = {r: [] for r in group}
            for chunk in range(s.chunks):
                upcoming = dispatch(chunk + 1) if chunk + 1 < s.chunks else None
                for j, owner in enumerate(group):
                    duration = (local_experts * hw.kernel_overhead + work[j] * flops_per_assignment / hw.matmul_flops
                                + work[j] * bytes_per_assignment / hw.memory_bandwidth)
                    task = t.add(f"experts{chunk}:{owner}", "compute", owner, (compute(owner),), duration,
                                 after=(router[owner], *pending[owner]))
                    expert_tasks[owner].append(task)
                    for dst in group:
                        if dst == owner:
                            finished[dst].append(task)
                            continue
                        nbytes = rows[j] * back_bytes
                        sent_combine[owner] += nbytes
                        finished[dst].append(t.add(
                            f"combine{chunk}:{owner}->{dst}", "transfer", owner, links(owner, dst),
                            hw.transfer_time(nbytes, same_node(owner, dst)), after=(task,), nbytes=nbytes))
                pending = upcoming
            for r in group:
                done[r] = t.add(f"sum{r}", "compute", r, (compute(r),), 0.0, after=tuple(finished[r]))

    layer_s = t.end()
    lm_head = 2 * c.hidden_size * c.vocab_size * s.rows / hw.matmul_flops
    steps = [[x.duration for x in attn_steps.get(r, [])] for r in range(world)]
    waits = [t.idle_between(attn_steps[r]) + (attn_steps[r][0].start - qkv[r].end) if r in attn_steps else 0.0
             for r in range(world)]
    attn_total = [sum(x) for x in steps]
    ring_s = max((attn_steps[r][-1].end - qkv[r].end for r in attn_steps), default=0.0)
    mean_attn = sum(attn_total) / world if world else 0.0
    expert_end = [max((x.end for x in expert_tasks[r]), default=router[r].end) for r in range(world)]
    recv_rows = s.ep * rows_to_rank(tokens, c.num_experts, c.top_k, shares[0])  # rows the hottest owner receives
    slowest = max(range(world), key=lambda r: done[r].end)
    return Prediction(
        scenario=s,
        layer_s=layer_s,
        ring_s=ring_s,
        prefill_s=c.num_layers * layer_s + lm_head,
        tokens_per_rank=tokens,
        attention_step_s=steps,
        ring_wait_s=waits,
        kv_bytes_per_step=kv_bytes if s.cp > 1 else 0,
        ring_exposed_fraction=max((w / (w + a) if w + a > 0 else 0.0) for w, a in zip(waits, attn_total)),
        min_tokens_for_overlap=min_tokens_for_overlap(c, hw, batch_local, s.element_bytes,
                                                      same_node=world <= hw.devices_per_node),
        dispatch_bytes=sent_dispatch,
        combine_bytes=sent_combine,
        dispatch_s=[(max(x.end for x in dispatch_tasks[r]) - min(x.start for x in dispatch_tasks[r]))
                    if dispatch_tasks[r] else 0.0 for r in range(world)],
        expert_s=[sum(x.duration for x in expert_tasks[r]) for r in range(world)],
        moe_s=[done[r].end - router[r].start for r in range(world)],
        straggler_s=max(expert_end) - sum(expert_end) / world,
        attention_imbalance=max(attn_total) / mean_attn if mean_attn > 0 else 1.0,
        memory=memory_per_rank(c, s.cp, s.ep, batch_local, local, s.element_bytes, recv_rows, s.chunks),
        timeline=t,
        breakdown={
            "projections_s": qkv[slowest].duration + o_proj[slowest].duration + router[slowest].duration,
            "attention_s": attn_done[slowest].end - qkv[slowest].end if "attention" in s.parts else 0.0,
            "moe_s": done[slowest].end - router[slowest].end,
        },
    )
