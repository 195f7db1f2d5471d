"""Which keys a query may see: the attention options every kernel shares.

A query row ``i`` (0-based within the query block) is aligned with key column
``i + offset``.  Public calls use flash-attn's bottom-right alignment,
``offset = seqlen_k - seqlen_q``; ring attention passes other offsets for the
blocks it exchanges (a striped shard sees its neighbour's keys shifted by one).

Row ``i`` sees key ``j`` when

    i + offset - left <= j <= i + offset + right

where an unbounded side (window value -1) drops that inequality, and
``causal=True`` forces ``right = 0`` (flash-attn's rule: causal is a window
whose right side is zero).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["AttentionSpec"]


@dataclass(frozen=True)
class AttentionSpec:
    """Attention options, resolved to numbers.

    softmax_scale: multiplies q.k before the softmax.
    causal: key j visible to row i only when j <= i + offset.
    window_left, window_right: -1 = unbounded, else the band around the diagonal.
    softcap: > 0 replaces scores s by softcap * tanh(s / softcap).
    offset: None = bottom-right alignment (seqlen_k - seqlen_q).
    """

    softmax_scale: float
    causal: bool = False
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    offset: int | None = None

    # -- resolved bounds -------------------------------------------------
    def resolve_offset(self, seqlen_q: int, seqlen_k: int) -> int:
        return seqlen_k - seqlen_q if self.offset is None else self.offset

    @property
    def right(self) -> int | None:
        """Largest visible j - (i + offset), None when unbounded."""
        if self.causal:
            return 0
        return None if self.window_right < 0 else self.window_right

    @property
    def left(self) -> int | None:
        """Largest visible (i + offset) - j, None when unbounded."""
        return None if self.window_left < 0 else self.window_left

    @property
    def is_masked(self) -> bool:
        return self.right is not None or self.left is not None

    # -- per-row key ranges ----------------------------------------------
    def key_range(self, row: int, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
        """Visible keys of query ``row`` as a half-open range [lo, hi) (empty if lo >= hi)."""
        offset = self.resolve_offset(seqlen_q, seqlen_k)
        lo = 0 if self.left is None else max(0, row + offset - self.left)
        hi = seqlen_k if self.right is None else min(seqlen_k, row + offset + self.right + 1)
        return lo, hi

    def tile_kind(self, i0: int, i1: int, j0: int, j1: int, seqlen_q: int, seqlen_k: int) -> str:
        """Classify the tile rows [i0, i1) x keys [j0, j1): "empty", "full" or "partial".

        Both bounds of a row's key range grow with the row, so the first and last
        rows of the tile bound every row in between.
        """
        lo_first, hi_first = self.key_range(i0, seqlen_q, seqlen_k)
        lo_last, hi_last = self.key_range(i1 - 1, seqlen_q, seqlen_k)
        if hi_last <= j0 or lo_first >= j1:
            return "empty"
        if lo_last <= j0 and hi_first >= j1:
            return "full"
        return "partial"

    def tile_mask(
        self, i0: int, i1: int, j0: int, j1: int, seqlen_q: int, seqlen_k: int, device: torch.device
    ) -> torch.Tensor:
        """Bool (i1 - i0, j1 - j0): True where row i sees key j."""
        offset = self.resolve_offset(seqlen_q, seqlen_k)
        rows = torch.arange(i0, i1, device=device).unsqueeze(1) + offset
        cols = torch.arange(j0, j1, device=device).unsqueeze(0)
        visible = torch.ones(i1 - i0, j1 - j0, dtype=torch.bool, device=device)
        if self.right is not None:
            visible &= cols <= rows + self.right
        if self.left is not None:
            visible &= cols >= rows - self.left
        return visible

    def first_key_starts_in(self, i0: int, i1: int, j0: int, j1: int, seqlen_q: int, seqlen_k: int) -> bool:
        """True if some row of [i0, i1) may meet its first visible key inside [j0, j1)."""
        lo_first, _ = self.key_range(i0, seqlen_q, seqlen_k)
        lo_last, _ = self.key_range(i1 - 1, seqlen_q, seqlen_k)
        return lo_first < j1 and lo_last >= j0


def default_scale(head_dim: int) -> float:
    """flash-attn's default softmax scale 1/sqrt(head_dim)."""
    return 1.0 / math.sqrt(head_dim)
