"""How a sequence is split across the ranks of a context-parallel group.

Three layouts, for P ranks and a sequence of N tokens:

* ``contiguous``: rank r holds tokens [r N/P, (r+1) N/P).  Simple, but under a
  causal mask the last rank does ~2P/(P+1) times the mean work.
* ``zigzag``: the sequence is cut into 2P chunks; rank r holds chunks r and
  2P-1-r, pairing an early (cheap) chunk with a late (expensive) one, so every
  rank does the same causal work.
* ``striped``: token t lives on rank t mod P; every rank sees an evenly spread
  sample of positions, which also balances causal work.

A rank's tokens are described as ``Segment``s: runs of global positions
``start, start + stride, ...`` stored consecutively at ``local_start`` in the
rank's local tensor.  Ring attention derives every block's mask from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["LAYOUTS", "Segment", "segments", "positions", "shard", "unshard", "check_layout"]

LAYOUTS = ("contiguous", "zigzag", "striped")


@dataclass(frozen=True)
class Segment:
    """Local rows [local_start, local_start + length) hold global positions start + stride * i."""

    start: int
    stride: int
    length: int
    local_start: int

    @property
    def local_stop(self) -> int:
        return self.local_start + self.length


def _parts(layout: str) -> int:
    return 2 if layout == "zigzag" else 1


def check_layout(seqlen: int, world_size: int, layout: str) -> None:
    """ValueError unless ``layout`` is known and ``seqlen`` splits evenly under it."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    need = world_size * _parts(layout)
    if seqlen % need:
        raise ValueError(
            f"seqlen {seqlen} must be divisible by {need} for layout={layout!r} with world_size={world_size}"
        )


def check_local_length(local_len: int, layout: str) -> None:
    """ValueError unless a rank's local token count fits the layout (zigzag needs two equal chunks)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if local_len < 1 or local_len % _parts(layout):
        raise ValueError(f"local seqlen {local_len} must be a positive multiple of {_parts(layout)} for layout={layout!r}")


def segments(local_len: int, world_size: int, rank: int, layout: str) -> list[Segment]:
    """The global positions of a rank's ``local_len`` tokens, as segments."""
    check_local_length(local_len, layout)
    if layout == "contiguous":
        return [Segment(rank * local_len, 1, local_len, 0)]
    if layout == "zigzag":
        chunk = local_len // 2
        return [Segment(rank * chunk, 1, chunk, 0), Segment((2 * world_size - 1 - rank) * chunk, 1, chunk, chunk)]
    return [Segment(rank, world_size, local_len, 0)]


def positions(seqlen: int, world_size: int, rank: int, layout: str = "zigzag") -> torch.Tensor:
    """Global token indices held by ``rank``, in local order: int64 (seqlen / world_size,)."""
    check_layout(seqlen, world_size, layout)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    parts = [
        torch.arange(s.start, s.start + s.stride * s.length, s.stride)
        for s in segments(seqlen // world_size, world_size, rank, layout)
    ]
    return torch.cat(parts)


def shard(x: torch.Tensor, world_size: int, rank: int, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """The part of ``x`` (tokens along ``dim``) that ``rank`` holds; a new contiguous tensor."""
    dim = dim % x.dim()
    index = positions(x.shape[dim], world_size, rank, layout).to(x.device)
    return x.index_select(dim, index)


def unshard(locals_: Sequence[torch.Tensor], layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """Inverse of ``shard``: the full tensor from every rank's local part, in rank order."""
    if not locals_:
        raise ValueError("unshard needs at least one local tensor")
    world_size = len(locals_)
    dim = dim % locals_[0].dim()
    seqlen = sum(t.shape[dim] for t in locals_)
    shape = list(locals_[0].shape)
    shape[dim] = seqlen
    full = locals_[0].new_empty(shape)
    for rank, part in enumerate(locals_):
        full.index_copy_(dim, positions(seqlen, world_size, rank, layout).to(part.device), part)
    return full
