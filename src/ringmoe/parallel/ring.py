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
from .layout import Segment, check_local_length, segments
from .watchdog import activity

__all__ = ["ring_flash_attn_func", "RingStats", "RingComm", "plan_block"]

_KV_TAG, _DKV_TAG = 11, 12


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

    def send_recv(self, send: torch.Tensor, recv: torch.Tensor, tag: int) -> list:
        """Start sending ``send`` to the next rank and receiving ``recv`` from the previous one."""
        return [
            dist.isend(send, self.next, group=self.group, tag=tag),
            dist.irecv(recv, self.prev, group=self.group, tag=tag),
        ]


@dataclass(frozen=True)
class BlockTask:
    """Local query rows [q0, q1) against local key rows [k0, k1); offset None = no mask."""

    q0: int
    q1: int
    k0: int
    k1: int
    offset: int | None


def plan_block(q_segments: list[Segment], k_segments: list[Segment], causal: bool) -> list[BlockTask]:
    """The kernel calls that attend a rank's queries to one K/V block.

    Under a causal mask, query i of segment (a, s) sits at a + s i and key j of
    (b, s) at b + s j, so j is visible iff j <= i + floor((a - b) / s).  Pairs
    that are fully visible and adjacent in local storage are merged into one call.
    """
    tasks = []
    for qs in q_segments:
        for ks in k_segments:
            offset = None
            if causal:
                if qs.stride != ks.stride:
                    raise ValueError("query and key segments must share a stride")
                offset = (qs.start - ks.start) // qs.stride
                if qs.length - 1 + offset < 0:
                    continue  # even the last query precedes the first key
                if offset >= ks.length - 1:
                    offset = None  # every key precedes every query
            tasks.append(BlockTask(qs.local_start, qs.local_stop, ks.local_start, ks.local_stop, offset))
    return _coalesce(_coalesce(tasks, by_query=True), by_query=False)


def _coalesce(tasks: list[BlockTask], by_query: bool) -> list[BlockTask]:
    """Merge unmasked tasks that share one side and are adjacent on the other."""
    merged: list[BlockTask] = []
    for t in tasks:
        last = merged[-1] if merged else None
        if last is not None and last.offset is None and t.offset is None:
            if by_query and (last.q0, last.q1) == (t.q0, t.q1) and last.k1 == t.k0:
                merged[-1] = BlockTask(t.q0, t.q1, last.k0, t.k1, None)
                continue
            if not by_query and (last.k0, last.k1) == (t.k0, t.k1) and last.q1 == t.q0:
                merged[-1] = BlockTask(last.q0, t.q1, t.k0, t.k1, None)
                continue
        merged.append(t)
    return merged


def _task_spec(spec: AttentionSpec, task: BlockTask) -> AttentionSpec:
    if task.offset is None:
        return AttentionSpec(spec.softmax_scale, softcap=spec.softcap)
    return AttentionSpec(spec.softmax_scale, causal=True, softcap=spec.softcap, offset=task.offset)


class RingPlan:
    """What the ring loop needs to know about the layout: every rank's local length, and the kernel
    calls that attend this rank's queries to the block that came from rank ``src``.

    ``segments_of(rank)`` gives a rank's tokens as groups of Segments: one group per sequence (one for a
    dense batch; one per document when documents are packed), and a query meets only keys of its group.
    """

    def __init__(self, lengths: list[int], segments_of, causal: bool):
        self.lengths, self.segments_of, self.causal = lengths, segments_of, causal

    def tasks(self, rank: int, src: int) -> list[BlockTask]:
        tasks = []
        for q_group, k_group in zip(self.segments_of(rank), self.segments_of(src)):
            tasks += plan_block(q_group, k_group, self.causal)
        return tasks


def dense_plan(local_len: int, world: int, layout: str, causal: bool) -> RingPlan:
    """Every rank holds ``local_len`` tokens of each sequence of the batch under ``layout``."""
    return RingPlan([local_len] * world, lambda rank: [segments(local_len, world, rank, layout)], causal)


class _Ring:
    """Everything one call needs: the communicator, the plan, kernel choice and stats."""

    def __init__(self, group, plan: RingPlan, spec, backend, stats):
        self.comm = RingComm(group)
        self.plan, self.spec, self.backend, self.stats = plan, spec, backend, stats

    def source(self, step: int) -> int:
        """The rank whose K/V block this rank holds at ``step``."""
        return (self.comm.rank - step) % self.comm.world_size

    def tasks(self, step: int) -> list[BlockTask]:
        return self.plan.tasks(self.comm.rank, self.source(step))

    def block_like(self, kv: torch.Tensor, step: int, dtype=None) -> torch.Tensor:
        """An empty (2, batch, len, heads, dim) buffer for the block this rank holds at ``step``."""
        length = self.plan.lengths[self.source(step)]
        return kv.new_empty((2, kv.shape[1], length, *kv.shape[3:]), dtype=dtype or kv.dtype)

    def kernel(self, q, k, spec):
        return resolve_kernel(self.backend, q, k, spec)

    def record(self, phase, step, compute, wait, nbytes):
        if self.stats is not None:
            getattr(self.stats, phase).append(
                {"step": step, "compute_s": compute, "wait_s": wait, "bytes_sent": nbytes}
            )

    def prefetch(self, kv, step):
        """Start passing ``kv`` on and receiving the next block, unless this is the last step."""
        if step == self.comm.world_size - 1:
            return None, []
        incoming = self.block_like(kv, step + 1)
        return incoming, self.comm.send_recv(kv, incoming, _KV_TAG)

    # -- forward ---------------------------------------------------------------
    def forward(self, q, k, v):
        batch, local_len, heads, head_dim = q.shape
        acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        out = torch.zeros(batch, local_len, heads, head_dim, dtype=acc_dtype, device=q.device)
        lse = torch.full((batch, heads, local_len), float("-inf"), dtype=acc_dtype, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        world = self.comm.world_size
        for step in range(world):
            with activity(f"ring forward step {step + 1}/{world}"):
                kv = self.forward_step(step, q, kv, out, lse)
        return out, lse

    def forward_step(self, step, q, kv, out, lse):
        """Merge this step's K/V block into (out, lse) in place while the next block travels; the next kv."""
        start = time.perf_counter()
        incoming, pending = self.prefetch(kv, step)
        for task in self.tasks(step):
            spec = _task_spec(self.spec, task)
            rows, keys = slice(task.q0, task.q1), slice(task.k0, task.k1)
            qs, ks, vs = q[:, rows], kv[0][:, keys], kv[1][:, keys]
            block_out, block_lse = self.kernel(qs, ks, spec).forward(qs, ks, vs, spec)
            out[:, rows], lse[:, :, rows] = merge_attention(
                out[:, rows], lse[:, :, rows], block_out, block_lse.to(lse.dtype)
            )
        computed = time.perf_counter()
        for work in pending:
            work.wait()
        self.record("forward", step, computed - start, time.perf_counter() - computed,
                    kv.numel() * kv.element_size() if pending else 0)
        return kv if incoming is None else incoming

    # -- backward --------------------------------------------------------------
    def backward(self, dout, q, k, v, out, lse, dlse=None):
        acc_dtype = out.dtype
        dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        world = self.comm.world_size
        dkv_incoming, dkv_pending = None, []
        send_buffers = []  # keep sent tensors alive until their isend completes
        for step in range(world):
            start = time.perf_counter()
            kv_next, kv_pending = self.prefetch(kv, step)
            dkv = torch.zeros(kv.shape, dtype=acc_dtype, device=q.device)
            for task in self.tasks(step):
                spec = _task_spec(self.spec, task)
                rows, keys = slice(task.q0, task.q1), slice(task.k0, task.k1)
                qs, ks, vs = q[:, rows], kv[0][:, keys], kv[1][:, keys]
                g_q, g_k, g_v = self.kernel(qs, ks, spec).backward(
                    dout[:, rows], qs, ks, vs, out[:, rows], lse[:, :, rows], spec,
                    None if dlse is None else dlse[:, :, rows],
                )
                dq[:, rows] += g_q
                dkv[0][:, keys] += g_k
                dkv[1][:, keys] += g_v
            computed = time.perf_counter()
            # The buffer for this block arrives from the previous rank, which handled it last step.
            for work in dkv_pending:
                work.wait()
            if dkv_incoming is not None:
                dkv += dkv_incoming
            # next comes the block this rank holds at step + 1 (after the last step: its own, home)
            dkv_incoming = self.block_like(kv, step + 1, acc_dtype) if world > 1 else None
            dkv_pending = self.comm.send_recv(dkv, dkv_incoming, _DKV_TAG) if world > 1 else []
            send_buffers.append(dkv)
            for work in kv_pending:
                work.wait()
            self.record("backward", step, computed - start, time.perf_counter() - computed,
                        (kv.numel() * kv.element_size() if kv_pending else 0)
                        + (dkv.numel() * dkv.element_size() if world > 1 else 0))
            if kv_next is not None:
                kv = kv_next
        if world > 1:
            wait_start = time.perf_counter()
            for work in dkv_pending:
                work.wait()
            if self.stats is not None and self.stats.backward:
                self.stats.backward[-1]["wait_s"] += time.perf_counter() - wait_start
            dkv = dkv_incoming  # our own block's gradients, home after a full lap
        return dq, dkv[0], dkv[1]


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
    def forward(ctx, q, k, v, ring: _Ring):
        out, lse = ring.forward(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        ctx.set_materialize_grads(False)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(q)
        with activity("ring attention backward"):
            dq, dk, dv = ctx.ring.backward(dout, q, k, v, out, lse, dlse)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


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
):
    """Exact attention of this rank's query shard over the whole sharded sequence.

    q (batch, local_seqlen, heads, head_dim), k/v (batch, local_seqlen, kv_heads,
    head_dim): this rank's tokens under ``layout`` (see ``shard``); every rank
    of ``group`` calls with the same shapes.  Returns this rank's output shard
    (and lse (batch, heads, local_seqlen) with return_lse=True), equal to
    single-device attention of the full sequence sharded the same way.
    backend picks the block kernel ("auto", "native", "blockwise", ...).
    stats: a RingStats to fill with per-step compute, wait and bytes.
    Raises ValueError on bad input before any communication.
    """
    check_qkv(q, k, v)
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"q and k must hold the same tokens: local seqlen {q.shape[1]} vs {k.shape[1]}")
    check_local_length(q.shape[1], layout)
    check_backend(backend)
    spec = make_spec(q.shape[-1], softmax_scale, causal, (-1, -1), softcap)
    if not dist.is_initialized():
        raise RuntimeError("ring_flash_attn_func needs an initialized torch.distributed process group")
    check_same_shapes(group, q, k)
    ring = _Ring(group, dense_plan(q.shape[1], dist.get_world_size(group), layout, causal), spec, backend, stats)
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        out, lse = _RingAttention.apply(q, k, v, ring)
    else:
        out, lse = ring.forward(q, k, v)
        out = out.to(q.dtype)
    return (out, lse) if return_lse else out
