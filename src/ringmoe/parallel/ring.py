"""Ring attention: exact attention over a sequence split across the ranks of a group.

Each rank keeps its query shard.  K and V (stacked into one buffer) travel
around the ring: at step s rank r holds the block that started on rank r - s,
attends its queries to it with a pluggable block kernel, and merges the
partial (out, lse) into its running result with the online-softmax rule
(``merge_attention``).  While a block is being computed the next one is
already in flight (isend/irecv into a second buffer), so transfers hide behind
compute.  No rank ever holds more than two K/V blocks.

Causal masks follow from global positions: every pair (query segment, key
segment) of the shard layout is either empty, fully visible, or causal with an
offset ``floor((q_start - k_start) / stride)`` (see ``layout.Segment``), so one
ring loop serves every layout.

Backward recomputes each block with the final (out, lse).  dQ stays home; dK
and dV of a block are accumulated into a buffer that travels one step behind
its K/V block and finally arrives back at the block's owner.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..attention.api import check_qkv, make_spec
from ..attention.kernels import check_backend, resolve_kernel
from ..attention.mask import AttentionSpec
from ..attention.merge import merge_attention
from ..attention.sinks import add_sinks, check_sinks, sinks_grad
from .layout import Segment, check_local_length, segments
from .watchdog import activity

__all__ = ["ring_flash_attn_func", "RingStats", "RingComm", "plan_block", "run_ring"]

_KV_TAG, _DKV_TAG, _HOME_TAG = 11, 12, 13


@dataclass
class RingStats:
    """Per-call measurements, one entry per ring step (forward and backward separately).

    compute_s: seconds in block kernels and merges; wait_s: seconds blocked on
    communication after compute finished (exposed communication); bytes_sent.
    """

    forward: list[dict] = field(default_factory=list)
    backward: list[dict] = field(default_factory=list)

    def totals(self, phase: str = "forward") -> dict:
        steps = getattr(self, phase)
        compute = sum(s["compute_s"] for s in steps)
        wait = sum(s["wait_s"] for s in steps)
        return {
            "compute_s": compute,
            "wait_s": wait,
            "bytes_sent": sum(s["bytes_sent"] for s in steps),
            "exposed_comm_fraction": wait / (compute + wait) if compute + wait > 0 else 0.0,
        }


class RingComm:
    """Point-to-point exchange with the ring neighbours of a process group."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.world_size)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.world_size)

    def send(self, tensor: torch.Tensor, hops: int, tag: int):
        """Start sending ``tensor`` to the rank ``hops`` places ahead in the ring."""
        return dist.isend(tensor, self.global_rank(self.rank + hops), group=self.group, tag=tag)

    def recv(self, tensor: torch.Tensor, hops: int, tag: int):
        """Start receiving into ``tensor`` from the rank ``hops`` places behind in the ring."""
        return dist.irecv(tensor, self.global_rank(self.rank - hops), group=self.group, tag=tag)

    def global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank % self.world_size)


@dataclass(frozen=True)
class BlockTask:
    """Local query rows [q0, q1) against local key rows [k0, k1).

    Local key j is visible to local query i when i + lo <= j <= i + hi (None: that side unbounded; both
    None: no mask at all).
    """

    q0: int
    q1: int
    k0: int
    k1: int
    lo: int | None = None
    hi: int | None = None

    @property
    def masked(self) -> bool:
        return self.lo is not None or self.hi is not None


def plan_block(q_segments: list[Segment], k_segments: list[Segment], causal: bool,
               window: tuple[int, int] = (-1, -1)) -> list[BlockTask]:
    """The kernel calls that attend a rank's queries to one K/V block; pairs that see nothing are skipped.

    Query i of segment (a, s) sits at global position a + s i, key j of (b, s) at b + s j.  Key position
    p_k is visible to query position p_q when p_q - left <= p_k <= p_q + right (flash-attn's window;
    causal means right = 0; -1 = unbounded), i.e. when

        i + ceil((a - b - left) / s) <= j <= i + floor((a - b + right) / s).

    A pair none of whose rows sees a key is dropped (no compute); a pair whose rows all see all keys is
    unmasked.  Unmasked pairs adjacent in local storage are merged into one call.
    """
    left = None if window[0] < 0 else window[0]
    right = 0 if causal else (None if window[1] < 0 else window[1])
    tasks = []
    for qs in q_segments:
        for ks in k_segments:
            if qs.length == 0 or ks.length == 0:
                continue
            if qs.stride != ks.stride:
                raise ValueError("query and key segments must share a stride")
            a_b, stride = qs.start - ks.start, qs.stride
            hi = None if right is None else (a_b + right) // stride        # floor
            lo = None if left is None else -((left - a_b) // stride)       # ceil((a_b - left) / stride)
            if hi is not None and (qs.length - 1 + hi < 0 or (lo is not None and lo > hi)):
                continue  # even the last query precedes the first key, or the band is empty
            if lo is not None and lo > ks.length - 1:
                continue  # even the first query is past the last key by more than the window
            if hi is not None and hi >= ks.length - 1:
                hi = None  # every query sees up to the last key
            if lo is not None and qs.length - 1 + lo <= 0:
                lo = None  # every query sees down to the first key
            tasks.append(BlockTask(qs.local_start, qs.local_stop, ks.local_start, ks.local_stop, lo, hi))
    return _coalesce(_coalesce(tasks, by_query=True), by_query=False)


def _coalesce(tasks: list[BlockTask], by_query: bool) -> list[BlockTask]:
    """Merge unmasked tasks that share one side and are adjacent on the other."""
    merged: list[BlockTask] = []
    for t in tasks:
        last = merged[-1] if merged else None
        if last is not None and not last.masked and not t.masked:
            if by_query and (last.q0, last.q1) == (t.q0, t.q1) and last.k1 == t.k0:
                merged[-1] = BlockTask(t.q0, t.q1, last.k0, t.k1)
                continue
            if not by_query and (last.k0, last.k1) == (t.k0, t.k1) and last.q1 == t.q0:
                merged[-1] = BlockTask(last.q0, t.q1, t.k0, t.k1)
                continue
        merged.append(t)
    return merged


def _task_spec(spec: AttentionSpec, task: BlockTask) -> AttentionSpec:
    """The kernel's mask for a task: the band [i + lo, i + hi] as (offset, window) in AttentionSpec terms."""
    if not task.masked:
        return AttentionSpec(spec.softmax_scale, softcap=spec.softcap)
    if task.hi is not None:  # right edge at offset hi, the band reaching hi - lo to the left
        left = -1 if task.lo is None else task.hi - task.lo
        return AttentionSpec(spec.softmax_scale, causal=True, window_left=left, softcap=spec.softcap, offset=task.hi)
    return AttentionSpec(spec.softmax_scale, window_left=0, softcap=spec.softcap, offset=task.lo)


class RingPlan:
    """What the ring loop needs to know about the layout: every rank's local length, and the kernel
    calls that attend this rank's queries to the block that came from rank ``src``.

    ``segments_of(rank)`` gives a rank's tokens as groups of Segments: one group per sequence (one for a
    dense batch; one per document when documents are packed), and a query meets only keys of its group.
    ``last[src]``: the last ring step at which some rank needs ``src``'s block (it reaches rank src + s at
    step s); the block travels no further, so a block nobody downstream needs is never sent (the last
    rank's block under a causal contiguous layout; every block beyond a window's reach).  ``steps``: the
    ring's length, max(last) + 1.
    """

    def __init__(self, lengths: list[int], segments_of, causal: bool, window: tuple[int, int] = (-1, -1)):
        self.lengths, self.segments_of, self.causal, self.window = lengths, segments_of, causal, window
        world = len(lengths)
        self.last = [max((s for s in range(world) if self.tasks((src + s) % world, src)), default=0)
                     for src in range(world)]
        self.steps = max(self.last) + 1

    def tasks(self, rank: int, src: int) -> list[BlockTask]:
        tasks = []
        for q_group, k_group in zip(self.segments_of(rank), self.segments_of(src)):
            tasks += plan_block(q_group, k_group, self.causal, self.window)
        return tasks


def dense_plan(local_len: int, world: int, layout: str, causal: bool, window: tuple[int, int] = (-1, -1)) -> RingPlan:
    """Every rank holds ``local_len`` tokens of each sequence of the batch under ``layout``."""
    return RingPlan([local_len] * world, lambda rank: [segments(local_len, world, rank, layout)], causal, window)


class DenseBlocks:
    """What travels is K and V themselves, stacked: (2, batch, len, kv_heads, head_dim)."""

    length_dim = 2

    def pack(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.stack([k, v]).contiguous()

    def unpack(self, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return block[0], block[1]

    def pack_grad(self, block: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> torch.Tensor:
        return torch.stack([dk, dv])


class _Ring:
    """Everything one call needs: the communicator, the plan, kernel choice, what travels, and stats."""

    def __init__(self, group, plan: RingPlan, spec, backend, stats, blocks=None):
        self.comm = RingComm(group)
        self.plan, self.spec, self.backend, self.stats = plan, spec, backend, stats
        self.blocks = blocks if blocks is not None else DenseBlocks()

    def source(self, step: int) -> int:
        """The rank whose K/V block this rank holds at ``step``."""
        return (self.comm.rank - step) % self.comm.world_size

    def tasks(self, step: int) -> list[BlockTask]:
        return self.plan.tasks(self.comm.rank, self.source(step))

    def block_like(self, kv: torch.Tensor, step: int, dtype=None) -> torch.Tensor:
        """An empty buffer shaped like ``kv`` for the block this rank holds at ``step`` (its length may differ)."""
        shape = list(kv.shape)
        shape[self.blocks.length_dim] = self.plan.lengths[self.source(step)]
        return kv.new_empty(shape, dtype=dtype or kv.dtype)

    def holds(self, step: int) -> bool:
        """Whether this rank receives (and uses) a block at ``step``."""
        return step < self.plan.steps and step <= self.plan.last[self.source(step)]

    def kernel(self, q, k, spec):
        return resolve_kernel(self.backend, q, k, spec)

    def record(self, phase, step, compute, wait, nbytes):
        if self.stats is not None:
            getattr(self.stats, phase).append(
                {"step": step, "compute_s": compute, "wait_s": wait, "bytes_sent": nbytes}
            )

    def prefetch(self, kv, own, step):
        """Pass the held block on if a rank further along needs it; start receiving the next one if this
        rank needs it.  Returns (incoming buffer or None, pending works, bytes sent)."""
        pending, sent, incoming = [], 0, None
        if kv is not None and step + 1 <= self.plan.last[self.source(step)]:
            pending.append(self.comm.send(kv, 1, _KV_TAG))
            sent = kv.numel() * kv.element_size()
        if self.holds(step + 1):
            incoming = self.block_like(own, step + 1)
            pending.append(self.comm.recv(incoming, 1, _KV_TAG))
        return incoming, pending, sent

    # -- forward ---------------------------------------------------------------
    def forward(self, q, k, v=None):
        """q (B, L, H, D); k, v the local K/V, or with ``v`` None, ``k`` the local block as it travels."""
        batch, local_len, heads, head_dim = q.shape
        acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        out = torch.zeros(batch, local_len, heads, head_dim, dtype=acc_dtype, device=q.device)
        lse = torch.full((batch, heads, local_len), float("-inf"), dtype=acc_dtype, device=q.device)
        own = kv = self.blocks.pack(k, v) if v is not None else k.contiguous()
        steps = self.plan.steps
        for step in range(steps):
            with activity(f"ring forward step {step + 1}/{steps}"):
                kv = self.forward_step(step, q, kv, own, out, lse)
        return out, lse

    def forward_step(self, step, q, kv, own, out, lse):
        """Merge this step's K/V block (if any) into (out, lse) in place while the next travels; the next kv."""
        start = time.perf_counter()
        incoming, pending, sent = self.prefetch(kv, own, step)
        tasks = self.tasks(step) if kv is not None else []
        k_all, v_all = self.blocks.unpack(kv) if tasks else (None, None)
        for task in tasks:
            spec = _task_spec(self.spec, task)
            rows, keys = slice(task.q0, task.q1), slice(task.k0, task.k1)
            qs, ks, vs = q[:, rows], k_all[:, keys], v_all[:, keys]
            block_out, block_lse = self.kernel(qs, ks, spec).forward(qs, ks, vs, spec)
            out[:, rows], lse[:, :, rows] = merge_attention(
                out[:, rows], lse[:, :, rows], block_out, block_lse.to(lse.dtype)
            )
        computed = time.perf_counter()
        for work in pending:
            work.wait()
        self.record("forward", step, computed - start, time.perf_counter() - computed, sent)
        return incoming

    # -- backward --------------------------------------------------------------
    def backward(self, dout, q, k, v, out, lse, dlse=None):
        """dq stays home.  A block's dK/dV buffer follows the block one step behind (each holder adds its part)
        and, from the block's last holder, goes straight back to the block's owner."""
        acc_dtype = out.dtype
        dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        own = kv = self.blocks.pack(k, v) if v is not None else k.contiguous()
        steps, rank = self.plan.steps, self.comm.rank
        mine, works = None, []  # works: every send and receive, waited for before returning
        home_pending = []
        if self.plan.last[rank] > 0:  # this block's gradients come home from its last holder
            mine = torch.empty(own.shape, dtype=acc_dtype, device=q.device)
            home_pending = [self.comm.recv(mine, -self.plan.last[rank], _HOME_TAG)]  # from rank + last
        dkv_incoming, dkv_pending = None, []
        for step in range(steps):
            start = time.perf_counter()
            kv_next, kv_pending, sent = self.prefetch(kv, own, step)
            if kv is not None:
                k_all, v_all = self.blocks.unpack(kv)
                dk = torch.zeros(k_all.shape, dtype=acc_dtype, device=q.device)
                dv = torch.zeros(v_all.shape, dtype=acc_dtype, device=q.device)
                for task in self.tasks(step):
                    spec = _task_spec(self.spec, task)
                    rows, keys = slice(task.q0, task.q1), slice(task.k0, task.k1)
                    qs, ks, vs = q[:, rows], k_all[:, keys], v_all[:, keys]
                    g_q, g_k, g_v = self.kernel(qs, ks, spec).backward(
                        dout[:, rows], qs, ks, vs, out[:, rows], lse[:, :, rows], spec,
                        None if dlse is None else dlse[:, :, rows],
                    )
                    dq[:, rows] += g_q
                    dk[:, keys] += g_k
                    dv[:, keys] += g_v
                dkv = self.blocks.pack_grad(kv, dk, dv).to(acc_dtype)
            computed = time.perf_counter()
            if kv is not None:
                # the part of this block's gradient from its earlier holders arrives from the previous rank
                for work in dkv_pending:
                    work.wait()
                if dkv_incoming is not None:
                    dkv += dkv_incoming
                if step < self.plan.last[self.source(step)]:
                    works.append(self.comm.send(dkv, 1, _DKV_TAG))
                    sent += dkv.numel() * dkv.element_size()
                elif step > 0:  # its last holder: straight home
                    works.append(self.comm.send(dkv, -step, _HOME_TAG))
                    sent += dkv.numel() * dkv.element_size()
                else:
                    mine = dkv  # this rank's own block, needed by no other rank
                works.append(dkv)  # keep the sent buffer alive
            dkv_incoming, dkv_pending = None, []
            if self.holds(step + 1):
                dkv_incoming = self.block_like(own, step + 1, acc_dtype)
                dkv_pending = [self.comm.recv(dkv_incoming, 1, _DKV_TAG)]
            for work in kv_pending:
                work.wait()
            self.record("backward", step, computed - start, time.perf_counter() - computed, sent)
            kv = kv_next
        wait_start = time.perf_counter()
        for work in home_pending + [w for w in works if not isinstance(w, torch.Tensor)]:
            work.wait()
        if self.stats is not None and self.stats.backward:
            self.stats.backward[-1]["wait_s"] += time.perf_counter() - wait_start
        return dq, mine


_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}


def check_same_shapes(group, q: torch.Tensor, k: torch.Tensor) -> None:
    """Raise ValueError on every rank of ``group`` unless all hold q, k of one shape and dtype.

    One small all-gather before the first K/V block is sent: ranks that disagree would otherwise
    exchange buffers of different sizes and abort inside the backend.
    """
    if dist.get_world_size(group) == 1:
        return
    mine = torch.tensor([*q.shape, *k.shape, _DTYPE_CODES[q.dtype]], dtype=torch.int64, device=q.device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    shapes = [tuple(t.tolist()) for t in every]
    if len(set(shapes)) > 1:
        described = ", ".join(f"rank {r}: q {s[:4]} k {s[4:8]}" for r, s in enumerate(shapes))
        raise ValueError(f"every rank of the ring must pass q, k, v of the same shape and dtype; got {described}")


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, ring: _Ring):
        out, lse = ring.forward(q, k, v)
        if sinks is not None:  # once, after every block is merged
            out, lse = add_sinks(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.ring = ring
        ctx.set_materialize_grads(False)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(q)
        with activity("ring attention backward"):
            dq, dkv = ctx.ring.backward(dout, q, k, v, out, lse, dlse)
            dk, dv = dkv[0], dkv[1]
        # this rank's rows' share of the sinks' gradient (the replicated parameter's gradients are summed later)
        dsinks = sinks_grad(dout, out, lse, sinks, dlse) if sinks is not None and ctx.needs_input_grad[3] else None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, None


def run_ring(q, k, v, ring: _Ring, sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out in q's dtype, lse) of the ring, plus the sinks; with autograd when an input requires grad."""
    inputs = (q, k, v) if sinks is None else (q, k, v, sinks)
    if torch.is_grad_enabled() and any(x.requires_grad for x in inputs):
        return _RingAttention.apply(q, k, v, sinks, ring)
    out, lse = ring.forward(q, k, v)
    if sinks is not None:
        out, lse = add_sinks(out, lse, sinks)
    return out.to(q.dtype), lse


def check_window_backend(backend: str, q: torch.Tensor, k: torch.Tensor, spec: AttentionSpec) -> None:
    """Before any transfer: an explicitly chosen kernel must support the masks the blocks will use."""
    if backend != "auto" and spec.window_left >= 0:
        probe = AttentionSpec(spec.softmax_scale, causal=True, window_left=spec.window_left, softcap=spec.softcap)
        resolve_kernel(backend, q, k, probe)


def ring_flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    causal: bool = True,
    layout: str = "zigzag",
    softmax_scale: float | None = None,
    return_lse: bool = False,
    backend: str = "auto",
    softcap: float = 0.0,
    stats: RingStats | None = None,
    window_size: tuple[int, int] = (-1, -1),
    sinks: torch.Tensor | None = None,
):
    """Exact attention of this rank's query shard over the whole sharded sequence.

    q (batch, local_seqlen, heads, head_dim), k/v (batch, local_seqlen, kv_heads,
    head_dim): this rank's tokens under ``layout`` (see ``shard``); every rank
    of ``group`` calls with the same shapes.  Returns this rank's output shard
    (and lse (batch, heads, local_seqlen) with return_lse=True), equal to
    single-device attention of the full sequence sharded the same way.
    backend picks the block kernel ("auto", "native", "blockwise", ...).
    window_size: flash-attn's (left, right) sliding window in global positions (-1 = unbounded; causal
    sets right = 0): blocks wholly outside it are not computed, and with the contiguous layout the ring
    stops after the last block any rank needs (no transfer beyond it).
    sinks: optional (heads,) attention-sink logits (gpt-oss), added once after the ring's merge.
    stats: a RingStats to fill with per-step compute, wait and bytes.
    Raises ValueError on bad input before any communication.
    """
    check_qkv(q, k, v)
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"q and k must hold the same tokens: local seqlen {q.shape[1]} vs {k.shape[1]}")
    check_local_length(q.shape[1], layout)
    check_backend(backend)
    check_sinks(sinks, q.shape[2], q)
    spec = make_spec(q.shape[-1], softmax_scale, causal, window_size, softcap)
    check_window_backend(backend, q, k, spec)
    if not dist.is_initialized():
        raise RuntimeError("ring_flash_attn_func needs an initialized torch.distributed process group")
    check_same_shapes(group, q, k)
    plan = dense_plan(q.shape[1], dist.get_world_size(group), layout, causal, tuple(window_size))
    out, lse = run_ring(q, k, v, _Ring(group, plan, spec, backend, stats), sinks)
    return (out, lse) if return_lse else out
