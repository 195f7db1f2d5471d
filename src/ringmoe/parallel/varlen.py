"""Packed documents through the ring: every document split by the layout, attention kept within documents.

A packed batch is a (total_tokens, ...) tensor with int32 ``cu_seqlens`` (documents' prefix sums), as
flash-attn's varlen API.  Each document is split by the layout on its own, so causal work stays
balanced whatever the document lengths:

* ``contiguous``: the document's P chunks, rank r holds chunk r;
* ``zigzag``: its 2P chunks, rank r holds chunks r and 2P-1-r;
* ``striped``: rank r holds its positions r, r + P, r + 2P, ...

Chunks of a document differ by at most one token (the first ``length % parts`` are one longer), so
ranks may hold different numbers of rows, and a document shorter than the number of chunks leaves some
ranks without any of it.  A rank's local rows are its pieces of document 0, then of document 1, ...
``ring_flash_attn_varlen_func`` runs the same ring loop as the dense case with a plan that pairs each
query only with keys of its own document, masked by positions within the document.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from ..attention.api import _check_cu_seqlens, check_qkv, make_spec
from ..attention.kernels import check_backend
from ..attention.sinks import check_sinks
from .layout import LAYOUTS, Segment
from .ring import RingPlan, RingStats, _Ring, check_window_backend, run_ring
from .watchdog import activity

__all__ = ["varlen_segments", "varlen_positions", "shard_varlen", "unshard_varlen", "ring_flash_attn_varlen_func"]


def _chunk(length: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of chunk ``index`` when ``length`` tokens are cut into ``parts`` near-equal chunks."""
    base, extra = divmod(length, parts)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)


def _document_segments(length: int, world: int, rank: int, layout: str, local_start: int) -> list[Segment]:
    """Rank ``rank``'s pieces of one document of ``length`` tokens (positions within the document)."""
    if layout == "striped":
        count = max(0, -(-(length - rank) // world))
        return [Segment(rank, world, count, local_start)] if count else []
    parts = 2 * world if layout == "zigzag" else world
    chunks = [rank, 2 * world - 1 - rank] if layout == "zigzag" else [rank]
    out = []
    for index in chunks:
        start, stop = _chunk(length, parts, index)
        if stop > start:
            out.append(Segment(start, 1, stop - start, local_start))
            local_start += stop - start
    return out


def varlen_segments(cu_seqlens: Sequence[int], world: int, rank: int, layout: str) -> list[list[Segment]]:
    """For every document, the segments ``rank`` holds (local rows counted across documents)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    groups, local = [], 0
    for start, stop in zip(cu_seqlens, cu_seqlens[1:]):
        segs = _document_segments(stop - start, world, rank, layout, local)
        local += sum(s.length for s in segs)
        groups.append(segs)
    return groups


def varlen_positions(cu_seqlens, world: int, rank: int, layout: str = "zigzag") -> torch.Tensor:
    """Rows of the packed tensor that ``rank`` holds, in its local order: int64 (local_tokens,)."""
    bounds = _bounds(cu_seqlens)
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    rows = [torch.arange(offset + s.start, offset + s.start + s.stride * s.length, s.stride)
            for offset, segs in zip(bounds, varlen_segments(bounds, world, rank, layout)) for s in segs]
    return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)


def _bounds(cu_seqlens) -> list[int]:
    bounds = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    if len(bounds) < 2 or bounds[0] != 0 or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and never decrease, got {bounds}")
    return bounds


def shard_varlen(x: torch.Tensor, cu_seqlens, world_size: int, rank: int, layout: str = "zigzag",
                 dim: int = 0) -> torch.Tensor:
    """This rank's rows of every document of a packed tensor (tokens along ``dim``)."""
    dim = dim % x.dim()
    if _bounds(cu_seqlens)[-1] != x.shape[dim]:
        raise ValueError(f"cu_seqlens ends at {_bounds(cu_seqlens)[-1]} but x has {x.shape[dim]} tokens along dim {dim}")
    return x.index_select(dim, varlen_positions(cu_seqlens, world_size, rank, layout).to(x.device))


def unshard_varlen(locals_: Sequence[torch.Tensor], cu_seqlens, layout: str = "zigzag", dim: int = 0) -> torch.Tensor:
    """Inverse of ``shard_varlen``: the packed tensor from every rank's rows, in rank order."""
    if not locals_:
        raise ValueError("unshard_varlen needs at least one local tensor")
    world, dim = len(locals_), dim % locals_[0].dim()
    shape = list(locals_[0].shape)
    shape[dim] = _bounds(cu_seqlens)[-1]
    full = locals_[0].new_empty(shape)
    for rank, part in enumerate(locals_):
        full.index_copy_(dim, varlen_positions(cu_seqlens, world, rank, layout).to(part.device), part)
    return full


def documents_digest(bounds: list[int]) -> list[int]:
    """Three ints that differ, in practice, between any two different prefix sums (compared across ranks)."""
    return [len(bounds), bounds[-1], sum((i + 1) * b for i, b in enumerate(bounds)) % (2**61 - 1)]


def _check_same_documents(group, bounds: list[int], q: torch.Tensor) -> None:
    """ValueError on every rank unless all ranks passed the same cu_seqlens, heads and head_dim."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    mine = torch.tensor([*documents_digest(bounds), q.shape[1], q.shape[2]], dtype=torch.int64, device=q.device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    if any(not torch.equal(e, every[0]) for e in every):
        raise ValueError("every rank must pass the same global cu_seqlens (and heads, head_dim); got "
                         + ", ".join(f"rank {r}: {e.tolist()[:2]}" for r, e in enumerate(every)))


def varlen_plan(group, cu_seqlens, max_seqlen: int, local_rows: int, layout: str, causal: bool,
                window: tuple[int, int], like: torch.Tensor) -> RingPlan:
    """The ring's plan for packed documents, after checking them against this rank's rows.

    Local checks first (cu_seqlens, layout, row count), then one small all-gather that every rank passed
    the same documents (and ``like``'s heads and width); ValueError on every rank otherwise.
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"cu_seqlens must be a 1-D int32 tensor, got {type(cu_seqlens).__name__}")
    total = int(cu_seqlens[-1]) if cu_seqlens.numel() else -1
    bounds = _check_cu_seqlens("cu_seqlens", cu_seqlens.cpu(), total, max_seqlen)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not dist.is_initialized():
        raise RuntimeError("ring attention over packed documents needs an initialized torch.distributed process group")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    lengths = [sum(s.length for segs in varlen_segments(bounds, world, r, layout) for s in segs) for r in range(world)]
    if local_rows != lengths[rank]:
        raise ValueError(f"rank {rank} holds {lengths[rank]} rows of these documents under layout={layout!r}, "
                         f"but q has {local_rows} (use shard_varlen)")
    _check_same_documents(group, bounds, like)
    return RingPlan(lengths, lambda r: varlen_segments(bounds, world, r, layout), causal, window)


def ring_flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                                max_seqlen: int, group: dist.ProcessGroup | None = None, causal: bool = True,
                                layout: str = "zigzag", softmax_scale: float | None = None, return_lse: bool = False,
                                backend: str = "auto", stats: RingStats | None = None,
                                window_size: tuple[int, int] = (-1, -1), sinks: torch.Tensor | None = None):
    """Exact attention within each packed document, this rank's rows against the whole ring.

    q (local_tokens, heads, head_dim), k/v (local_tokens, kv_heads, head_dim): this rank's rows from
    ``shard_varlen``; cu_seqlens: the *global* int32 (documents + 1,) prefix sums, the same on every rank.
    Returns out (local_tokens, heads, head_dim) (and lse (heads, local_tokens)), equal to
    ``shard_varlen(flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=causal))``.
    window_size and sinks: as in ``ring_flash_attn_func`` (the window counts positions inside a document).
    Raises ValueError before any transfer when the input does not fit the documents.
    """
    check_qkv(q, k, v, varlen=True)
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must hold the same tokens: {q.shape[0]} vs {k.shape[0]}")
    check_backend(backend)
    check_sinks(sinks, q.shape[1], q)
    spec = make_spec(q.shape[-1], softmax_scale, causal, window_size, 0.0)
    check_window_backend(backend, q[None], k[None], spec)
    plan = varlen_plan(group, cu_seqlens, max_seqlen, q.shape[0], layout, causal, tuple(window_size), q)
    with activity("ring varlen attention"):
        out, lse = run_ring(q[None], k[None], v[None], _Ring(group, plan, spec, backend, stats), sinks)
    return (out[0], lse[0]) if return_lse else out[0]
