"""Ulysses sequence parallelism, alone and as the 2-D Ulysses x ring hybrid (USP).

DeepSpeed-Ulysses swaps the sequence split for a head split.  One all-to-all inside a group of U ranks
turns every rank's (its tokens, all H heads) of q, k, v into (the group's tokens, H / U heads); each
rank then runs ordinary flash attention for its heads, and a second all-to-all turns the output back
into (its tokens, all heads).  Per attention a rank sends (U - 1) / U of its q, k, v and out: a volume
that does not grow with U, where the ring sends P - 1 K/V blocks.  Ulysses needs H divisible by U; when
the K/V heads are fewer than U they are repeated to U (each rank gets the one its query heads use).

The hybrid factors a context-parallel group of P = U x R ranks: cp rank p = ring_rank * U + u.  The U
consecutive ranks of one ring rank exchange heads (Ulysses over the closest links), then the R ranks that
share u (hence the same heads) run the ring over their gathered blocks, then Ulysses turns the output back.

Token layouts: the model shards the sequence over all P ranks with the usual layouts (``shard(x, P, p,
layout)``, or ``shard_varlen`` for packed documents).  After the exchange a rank holds the rows of its U
group members, member after member; their global positions are the members' layout segments, so:

* Ulysses alone (R = 1): the rows are put in global order and one flash attention runs over the sequence;
* the hybrid: the ring plan is built from the members' segments directly (for zigzag the group's rows are
  exactly the zigzag shard over R; for striped, U interleaved stripes), and the shared ring loop runs
  unchanged with its pluggable block kernel.

Multi-head latent attention (``usp_mla_attn_func``) moves latents, not expanded K/V: the query heads are split,
each token's latent and RoPE key (which have no heads) are gathered inside the Ulysses group, and every rank
expands them with its own heads' rows of W_kvb; the ring across carries the gathered latents.

Gradients flow back through the same all-to-alls reversed (autograd), so forward and backward are exact.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..attention.api import _check_cu_seqlens, check_qkv, flash_attn_func, flash_attn_varlen_func, make_spec
from ..attention.kernels import check_backend
from ..attention.sinks import check_sinks
from .exchange import start_all_to_all
from .layout import Segment, check_local_length, segments
from .ring import RingPlan, RingStats, _DTYPE_CODES, _Ring, check_window_backend, run_ring
from .ring_mla import LatentBlocks, check_mla_inputs, run_latent_ring
from .varlen import documents_digest, varlen_positions, varlen_segments
from .watchdog import activity

__all__ = ["ulysses_attn_func", "ulysses_attn_varlen_func", "usp_attn_func", "usp_attn_varlen_func",
           "usp_mla_attn_func", "check_heads"]


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def check_heads(heads: int, kv_heads: int, ulysses: int) -> None:
    """ValueError unless ``heads`` split over ``ulysses`` ranks and the K/V heads split or repeat to fit."""
    if heads % ulysses:
        raise ValueError(f"q heads ({heads}) must be divisible by the Ulysses degree ({ulysses})")
    if kv_heads % ulysses and ulysses % kv_heads:
        raise ValueError(f"k/v heads ({kv_heads}) must divide or be divisible by the Ulysses degree ({ulysses})")


def _repeat_kv(x: torch.Tensor, ulysses: int) -> torch.Tensor:
    """(..., Hkv, D) -> (..., max(Hkv, U), D): K/V heads repeated so that each rank's slice serves its queries.

    Query head h uses K/V head h // (H / Hkv); rank j holds query heads [j H / U, (j + 1) H / U), all of
    which use K/V head j // (U / Hkv) when U > Hkv: ``repeat_interleave`` puts exactly that head at j."""
    kv_heads = x.shape[-2]
    return x if kv_heads % ulysses == 0 else x.repeat_interleave(ulysses // kv_heads, dim=-2)


class _Exchange:
    """The Ulysses group's all-to-alls: ``lengths[i]`` rows live on member i (batch-major tensors, rows on dim 1).

    ``to_heads``: (B, lengths[me], H, ...) per tensor -> (B, sum(lengths), H / U, ...), member after member.
    ``to_tokens``: the inverse.  Several tensors go in one all-to-all (one message per peer).
    """

    def __init__(self, group, lengths: list[int], stats: RingStats | None):
        self.group, self.lengths, self.stats = group, lengths, stats
        self.size = _size(group)
        self.me = 0 if group is None else dist.get_rank(group)

    def _swap(self, send: list[list[torch.Tensor]], recv_shapes: list[list[tuple]]) -> list[list[torch.Tensor]]:
        """send[j]: the tensors for member j; recv_shapes[i]: shapes of those coming from member i."""
        sizes = [[math.prod(s) for s in shapes] for shapes in recv_shapes]
        if self.size == 1:
            return [[t.reshape(s) for t, s in zip(send[0], recv_shapes[0])]]
        flat = torch.cat([t.reshape(-1) for parts in send for t in parts])
        start = time.perf_counter()
        got = start_all_to_all(flat, [sum(t.numel() for t in parts) for parts in send],
                               [sum(s) for s in sizes], self.group).result()
        if self.stats is not None:
            mine = sum(t.numel() * t.element_size() for t in send[self.me])
            self.stats.forward.append({"step": "all_to_all", "compute_s": 0.0,
                                       "wait_s": time.perf_counter() - start,
                                       "bytes_sent": flat.numel() * flat.element_size() - mine})
        pieces = got.split([n for s in sizes for n in s])
        out, k = [], 0
        for shapes in recv_shapes:
            out.append([pieces[k + i].view(shape) for i, shape in enumerate(shapes)])
            k += len(shapes)
        return out

    def to_heads(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        u = self.size
        send = [[t.unflatten(2, (u, t.shape[2] // u))[:, :, j] for t in tensors] for j in range(u)]
        shapes = [[(t.shape[0], n, t.shape[2] // u, *t.shape[3:]) for t in tensors] for n in self.lengths]
        got = self._swap(send, shapes)
        return [torch.cat([got[i][n] for i in range(u)], dim=1) for n in range(len(tensors))]

    def to_tokens(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        bounds = [0]
        for n in self.lengths:
            bounds.append(bounds[-1] + n)
        send = [[t[:, bounds[j]:bounds[j + 1]] for t in tensors] for j in range(self.size)]
        mine = self.lengths[self.me]
        shapes = [[(t.shape[0], mine, *t.shape[2:]) for t in tensors] for _ in range(self.size)]
        got = self._swap(send, shapes)
        return [torch.cat([got[i][n] for i in range(self.size)], dim=2) for n in range(len(tensors))]


def _check_agree(ulysses_group, ring_group, info: list[int], what: str, device: torch.device) -> None:
    """ValueError on every rank of the U x R grid unless all ranks passed the same ``info``.

    Two small all-gathers, before any data moves: first inside the Ulysses group, then inside the ring
    group carrying a flag for a disagreement seen in the first.  Every rank's ring group holds one member
    of every Ulysses group, so a disagreement anywhere reaches every rank and all raise together.  (``device``:
    where the collective's tensors live, the inputs' device: NCCL needs them on the GPU.)"""
    seen = []
    bad = False
    for group in (ulysses_group, ring_group):
        if _size(group) == 1:
            continue
        mine = torch.tensor(info + [int(bad)], dtype=torch.int64, device=device)  # last: a disagreement seen so far
        every = [torch.empty_like(mine) for _ in range(_size(group))]
        dist.all_gather(every, mine, group=group)
        rows = [e.tolist() for e in every]
        seen += [r[:-1] for r in rows]
        bad = any(r[:-1] != info or r[-1] for r in rows)
    if bad:
        raise ValueError(f"every rank of the Ulysses x ring group must pass {what}; "
                         f"got {sorted(set(map(tuple, seen)))}")


def _reordered(tensors, order: torch.Tensor):
    """Rows (dim 1) of each tensor put in global order: row i of the result is the row whose position is i."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return [t.index_select(1, inverse) for t in tensors]


def _shifted(segs: list[Segment], offset: int) -> list[Segment]:
    return [Segment(s.start, s.stride, s.length, s.local_start + offset) for s in segs]


@dataclass(frozen=True)
class _Geometry:
    """Where the rows a rank holds after the exchange sit: ``lengths[i]`` rows came from Ulysses member i; with
    no ring, ``order`` gives their global positions; with the ring, ``plan`` is its plan over the ring group."""

    lengths: list[int]
    order: torch.Tensor | None
    plan: RingPlan | None


def _dense_geometry(local: int, layout: str, u: int, r: int, ring_rank: int, causal: bool, window) -> _Geometry:
    """Every rank holds ``local`` tokens of each sequence under ``layout`` over U x R ranks."""
    world, members = u * r, [ring_rank * u + i for i in range(u)]
    if r == 1:
        order = torch.cat([torch.arange(s.start, s.start + s.stride * s.length, s.stride)
                           for m in members for s in segments(local, world, m, layout)])
        return _Geometry([local] * u, order, None)

    def group_segments(ring_r):
        return [[seg for i in range(u) for seg in _shifted(segments(local, world, ring_r * u + i, layout), i * local)]]
    return _Geometry([local] * u, None, RingPlan([u * local] * r, group_segments, causal, tuple(window)))


def _varlen_geometry(bounds: list[int], layout: str, u: int, r: int, ring_rank: int, causal: bool,
                     window) -> _Geometry:
    """Packed documents (global prefix sums ``bounds``), each split by ``layout`` over U x R ranks."""
    world = u * r
    rows_of = [sum(s.length for segs in varlen_segments(bounds, world, p, layout) for s in segs) for p in range(world)]
    members = [ring_rank * u + i for i in range(u)]
    if r == 1:
        return _Geometry([rows_of[m] for m in members],
                         torch.cat([varlen_positions(bounds, world, m, layout) for m in members]), None)

    def group_segments(ring_r):
        offsets = [0]
        for i in range(u):
            offsets.append(offsets[-1] + rows_of[ring_r * u + i])
        per_member = [varlen_segments(bounds, world, ring_r * u + i, layout) for i in range(u)]
        return [[seg for i in range(u) for seg in _shifted(per_member[i][d], offsets[i])]
                for d in range(len(bounds) - 1)]

    plan = RingPlan([sum(rows_of[ring_r * u + i] for i in range(u)) for ring_r in range(r)], group_segments, causal,
                    tuple(window))
    return _Geometry([rows_of[m] for m in members], None, plan)


def _around(exchange: _Exchange, geometry: _Geometry, inputs, local_attention, ring_attention, return_lse):
    """Exchange ``inputs`` to heads, attend (``local_attention`` over rows in global order, or
    ``ring_attention`` over the ring), exchange (out, lse) back to tokens."""
    with activity("ulysses all-to-all"):
        gathered = exchange.to_heads(inputs)
    if geometry.plan is None:
        order = geometry.order.to(inputs[0].device)
        out, lse = local_attention(*_reordered(gathered, order))
        out, lse = out.index_select(1, order), lse.index_select(2, order)
    else:
        with activity("usp ring"):
            out, lse = ring_attention(*gathered)
    with activity("ulysses all-to-all back"):
        (out,) = exchange.to_tokens([out])
        if not return_lse:
            return out, None
        (lse,) = exchange.to_tokens([lse.transpose(1, 2).unsqueeze(-1)])  # its own exchange: lse stays float32
        return out, lse.squeeze(-1).transpose(1, 2)


def _validate(q, k, v, sinks, ulysses_group, ring_group, backend, softmax_scale, causal, window_size, softcap):
    check_qkv(q, k, v, varlen=q.dim() == 3)
    rows = 0 if q.dim() == 3 else 1
    if q.shape[rows] != k.shape[rows]:
        raise ValueError(f"q and k must hold the same tokens: {q.shape[rows]} vs {k.shape[rows]}")
    check_backend(backend)
    check_sinks(sinks, q.shape[-2], q)
    check_heads(q.shape[-2], k.shape[-2], _size(ulysses_group))
    spec = make_spec(q.shape[-1], softmax_scale, causal, window_size, softcap)
    batched = (q, k) if rows == 1 else (q[None], k[None])
    check_window_backend(backend, *batched, spec)
    _check_distributed(ulysses_group, ring_group)
    return spec


def _check_distributed(ulysses_group, ring_group) -> None:
    if (_size(ulysses_group) > 1 or _size(ring_group) > 1) and not dist.is_initialized():
        raise RuntimeError("Ulysses attention needs an initialized torch.distributed process group")


def _ranks(ulysses_group, ring_group) -> tuple[int, int, int, int]:
    """(U, R, this rank's ring rank, its Ulysses rank)."""
    return (_size(ulysses_group), _size(ring_group), 0 if ring_group is None else dist.get_rank(ring_group),
            0 if ulysses_group is None else dist.get_rank(ulysses_group))


def _documents(cu_seqlens, max_seqlen, rows: int, layout: str, ulysses_group, ring_group) -> list[int]:
    """The checked global prefix sums; ValueError unless this rank holds its ``shard_varlen`` rows of them."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"cu_seqlens must be a 1-D int32 tensor, got {type(cu_seqlens).__name__}")
    total = int(cu_seqlens[-1]) if cu_seqlens.numel() else -1
    bounds = _check_cu_seqlens("cu_seqlens", cu_seqlens.cpu(), total, max_seqlen)
    u, r, ring_rank, me = _ranks(ulysses_group, ring_group)
    mine = sum(s.length for segs in varlen_segments(bounds, u * r, ring_rank * u + me, layout) for s in segs)
    if rows != mine:
        raise ValueError(f"rank {ring_rank * u + me} holds {mine} rows of these documents under layout={layout!r}, "
                         f"but q has {rows} (use shard_varlen)")
    return bounds


def usp_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ulysses_group: dist.ProcessGroup | None,
                  ring_group: dist.ProcessGroup | None = None, causal: bool = True, layout: str = "zigzag",
                  softmax_scale: float | None = None, return_lse: bool = False, backend: str = "auto",
                  softcap: float = 0.0, stats: RingStats | None = None, window_size: tuple[int, int] = (-1, -1),
                  sinks: torch.Tensor | None = None):
    """Exact attention of this rank's shard over the whole sequence, by Ulysses inside ``ulysses_group``
    (U ranks) and the ring across ``ring_group`` (R ranks; None: no ring).

    q (batch, local_seqlen, heads, head_dim), k/v (batch, local_seqlen, kv_heads, head_dim): this rank's
    tokens of ``shard(x, U * R, ring_rank * U + ulysses_rank, layout)``.  heads % U == 0; kv_heads must
    divide or be divisible by U.  Returns out (and lse (batch, heads, local_seqlen)) like
    ``ring_flash_attn_func``, and takes its options (causal, window_size, softcap, sinks, backend, stats:
    the all-to-alls are recorded as forward steps named "all_to_all").
    Raises ValueError on bad input on every rank before any data is exchanged.
    """
    spec = _validate(q, k, v, sinks, ulysses_group, ring_group, backend, softmax_scale, causal, window_size, softcap)
    check_local_length(q.shape[1], layout)
    _check_agree(ulysses_group, ring_group, [*q.shape, *k.shape, _DTYPE_CODES[q.dtype]],
                 "q, k, v of one shape and dtype", q.device)
    u, r, ring_rank, me = _ranks(ulysses_group, ring_group)
    geometry = _dense_geometry(q.shape[1], layout, u, r, ring_rank, causal, window_size)
    heads = q.shape[2] // u
    my_sinks = None if sinks is None else sinks[me * heads:(me + 1) * heads]

    def local_attention(qg, kg, vg):
        return flash_attn_func(qg, kg, vg, spec.softmax_scale, causal, tuple(window_size), softcap, return_lse=True,
                               backend=backend, sinks=my_sinks)

    def ring_attention(qh, kh, vh):
        return run_ring(qh, kh, vh, _Ring(ring_group, geometry.plan, spec, backend, stats), my_sinks)

    out, lse = _around(_Exchange(ulysses_group, geometry.lengths, stats), geometry,
                       [q, _repeat_kv(k, u), _repeat_kv(v, u)], local_attention, ring_attention, return_lse)
    return (out, lse) if return_lse else out


def usp_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                         max_seqlen: int, ulysses_group: dist.ProcessGroup | None,
                         ring_group: dist.ProcessGroup | None = None, causal: bool = True, layout: str = "zigzag",
                         softmax_scale: float | None = None, return_lse: bool = False, backend: str = "auto",
                         stats: RingStats | None = None, window_size: tuple[int, int] = (-1, -1),
                         sinks: torch.Tensor | None = None):
    """Packed documents by Ulysses x ring: q (local_tokens, heads, head_dim) from ``shard_varlen(x, cu_seqlens,
    U * R, ring_rank * U + ulysses_rank, layout)``, cu_seqlens the global int32 prefix sums (the same on every
    rank).  Returns out (local_tokens, heads, head_dim) (and lse (heads, local_tokens)), equal to the same rows
    of ``flash_attn_varlen_func`` over the whole packed batch.  ValueError before any exchange on bad input."""
    spec = _validate(q, k, v, sinks, ulysses_group, ring_group, backend, softmax_scale, causal, window_size, 0.0)
    bounds = _documents(cu_seqlens, max_seqlen, q.shape[0], layout, ulysses_group, ring_group)
    _check_agree(ulysses_group, ring_group,
                 [*documents_digest(bounds), *q.shape[1:], *k.shape[1:], _DTYPE_CODES[q.dtype]],
                 "the same global cu_seqlens, heads and dtype", q.device)
    u, r, ring_rank, me = _ranks(ulysses_group, ring_group)
    geometry = _varlen_geometry(bounds, layout, u, r, ring_rank, causal, window_size)
    heads = q.shape[1] // u
    my_sinks = None if sinks is None else sinks[me * heads:(me + 1) * heads]

    def local_attention(qg, kg, vg):
        out, lse = flash_attn_varlen_func(qg[0], kg[0], vg[0], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                          spec.softmax_scale, causal, tuple(window_size), return_lse=True,
                                          backend=backend, sinks=my_sinks)
        return out[None], lse[None]

    def ring_attention(qh, kh, vh):
        return run_ring(qh, kh, vh, _Ring(ring_group, geometry.plan, spec, backend, stats), my_sinks)

    out, lse = _around(_Exchange(ulysses_group, geometry.lengths, stats), geometry,
                       [q[None], _repeat_kv(k, u)[None], _repeat_kv(v, u)[None]], local_attention, ring_attention,
                       return_lse)
    return (out[0], lse[0]) if return_lse else out[0]


def usp_mla_attn_func(q: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor, kv_b_weight: torch.Tensor,
                      v_head_dim: int, ulysses_group: dist.ProcessGroup | None,
                      ring_group: dist.ProcessGroup | None = None, causal: bool = True, layout: str = "zigzag",
                      softmax_scale: float | None = None, return_lse: bool = False, backend: str = "auto",
                      stats: RingStats | None = None, cu_seqlens: torch.Tensor | None = None,
                      max_seqlen: int | None = None):
    """Multi-head latent attention by Ulysses x ring, moving latents instead of expanded K/V.

    Ulysses splits the query heads; the latents and RoPE keys (no heads: each token's rank + rope numbers) are
    gathered inside the Ulysses group instead, and each rank expands them with its heads' rows of W_kvb only.
    The ring across carries the gathered latents (``parallel/ring_mla.py``).  Arguments and result as
    ``ring_mla_attn_func``: q (batch, local, heads, nope + rope), latent (batch, local, rank), k_rope
    (batch, local, rope), kv_b_weight (heads * (nope + v), rank), the same on every rank (each rank's gradient
    holds its heads' rows: their sum over the ranks is the whole); packed documents with the global
    ``cu_seqlens`` and inputs without the batch dimension.
    """
    packed = cu_seqlens is not None
    if packed:
        if not all(isinstance(x, torch.Tensor) and x.dim() == d for x, d in ((q, 3), (latent, 2), (k_rope, 2))):
            raise ValueError("with cu_seqlens, q must be (tokens, heads, dim), latent and k_rope (tokens, width)")
        q, latent, k_rope = q[None], latent[None], k_rope[None]
    heads, nope = check_mla_inputs(q, latent, k_rope, kv_b_weight, v_head_dim)
    length, qk, rank_, rope = q.shape[1], q.shape[3], latent.shape[-1], k_rope.shape[-1]
    check_backend(backend)
    check_heads(heads, 1, _size(ulysses_group))
    spec = make_spec(qk, softmax_scale, causal, (-1, -1), 0.0)
    _check_distributed(ulysses_group, ring_group)
    u, r, ring_rank, me = _ranks(ulysses_group, ring_group)
    if packed:
        bounds = _documents(cu_seqlens, max_seqlen, length, layout, ulysses_group, ring_group)
        _check_agree(ulysses_group, ring_group,
                     [*documents_digest(bounds), heads, qk, rank_, rope, _DTYPE_CODES[q.dtype]],
                     "the same global cu_seqlens, MLA shapes and dtype", q.device)
        geometry = _varlen_geometry(bounds, layout, u, r, ring_rank, causal, (-1, -1))
    else:
        check_local_length(length, layout)
        _check_agree(ulysses_group, ring_group, [*q.shape, rank_, rope, _DTYPE_CODES[q.dtype]],
                     "q, latent, k_rope of one shape and dtype", q.device)
        geometry = _dense_geometry(length, layout, u, r, ring_rank, causal, (-1, -1))
    mine = heads // u
    weight = kv_b_weight.view(heads, nope + v_head_dim, rank_)[me * mine:(me + 1) * mine].reshape(-1, rank_)
    block = torch.cat([latent, k_rope], dim=-1)[:, :, None]  # one "head" that every member needs

    def local_attention(qg, bg):
        k, v = LatentBlocks(weight, mine, nope, v_head_dim).unpack(bg[:, :, 0])
        if packed:
            out, lse = flash_attn_varlen_func(qg[0], k[0], v[0], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                              spec.softmax_scale, causal, return_lse=True, backend=backend)
            out, lse = out[None], lse[None]
        else:
            out, lse = flash_attn_func(qg, k, v, spec.softmax_scale, causal, return_lse=True, backend=backend)
        return out[..., :v_head_dim], lse

    def ring_attention(qh, bh):
        return run_latent_ring(qh, bh[:, :, 0], weight, v_head_dim, ring_group, geometry.plan, spec, backend, stats)

    out, lse = _around(_Exchange(ulysses_group, geometry.lengths, stats), geometry, [q, _repeat_kv(block, u)],
                       local_attention, ring_attention, return_lse)
    if packed:
        out, lse = out[0], lse[0] if lse is not None else None
    return (out, lse) if return_lse else out


def ulysses_attn_func(q, k, v, group: dist.ProcessGroup | None = None, **options):
    """Ulysses alone over ``group`` (U ranks): ``usp_attn_func`` with no ring.  q (B, L, H, D) is this rank's
    ``shard(x, U, rank, layout)``; every option of ``usp_attn_func``.  group None: the default group."""
    if group is None and dist.is_initialized():
        group = dist.group.WORLD
    return usp_attn_func(q, k, v, group, None, **options)


def ulysses_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, group: dist.ProcessGroup | None = None, **options):
    """Packed documents by Ulysses alone: ``usp_attn_varlen_func`` with no ring."""
    if group is None and dist.is_initialized():
        group = dist.group.WORLD
    return usp_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, group, None, **options)
