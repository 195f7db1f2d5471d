"""Batch-invariant matrix products: a token's result does not depend on the other tokens in the call.

A GEMM library picks its kernel (and so its summation order) from the matrix shapes: the same row
multiplied alone (M = 1) and inside a batch (M = 2048) can differ in the last bits.  Inside
``batch_invariant()``, ``linear`` cuts the rows into fixed tiles of ``rows`` (the last one padded)
and multiplies them with one batched GEMM whose every item has the same shape, so each row is
computed by the same kernel in the same order whatever surrounds it.  The serving engine's
deterministic mode runs every step inside it (attention has its own fixed-tile path,
``attention.paged``).  Outside it, ``linear`` is ``torch.nn.functional.linear``, or the product with the
weight's oneDNN copy where it was prepacked (``prepacked``).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn as nn
import torch.nn.functional as F

from .prepacked import module_state, packed, packed_linear, packed_panels, panel_linear, traced_panels

__all__ = ["batch_invariant", "tile_rows", "linear", "rowwise", "InvariantLinear"]

_ROWS: contextvars.ContextVar[int | None] = contextvars.ContextVar("ringmoe_batch_invariant_rows", default=None)


@contextlib.contextmanager
def batch_invariant(rows: int = 16):
    """Within the block, ``linear`` (and the kernels that ask ``tile_rows``) are batch-invariant."""
    if not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows must be a positive int, got {rows!r}")
    token = _ROWS.set(rows)
    try:
        yield
    finally:
        _ROWS.reset(token)


def tile_rows() -> int | None:
    """The fixed tile height in force, or None outside ``batch_invariant`` (and in code torch.compile traces:
    the compiled decode step never runs in the deterministic mode, and a context variable breaks its graph)."""
    return None if torch.compiler.is_compiling() else _ROWS.get()


# An eager product goes through a matrix's panel copy when it has at most this many rows and the matrix at least this
# many values (of several rows, of one): called from Python (~6 us of wrapper and dispatch) the copy is 0.9-1.8x
# MKL's product of the plain weight at 2-32 rows for matrices of 128 x 256 and 256 x 256 and 1.8-3.6x for a
# 4096 x 256 LM head, at one row slower but for the head, and slower for smaller matrices or from ~128 rows on
# (``benchmarks/bench_products.py``; inside a compiled graph, whose C++ calls the operator directly, it always pays)
_PANEL_ROWS, _PANEL_VALUES, _PANEL_VALUES_ONE_ROW = 64, 1 << 15, 1 << 18


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           panels: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) @ weight (out, in).T (+ bias), batch-invariant inside ``batch_invariant``.  panels: the weight's
    panel copy its module holds for a compiled decode step (``prepacked.DecodePanels``), used in traced code."""
    if traced_panels(panels, x):
        return panel_linear(x, panels, bias)
    rows = tile_rows()
    if rows is None:
        copy = packed_panels(weight, x) if weight.dim() == 2 else None
        count = x.numel() // max(1, x.shape[-1])
        least = _PANEL_VALUES_ONE_ROW if count == 1 else _PANEL_VALUES
        if copy is not None and count <= _PANEL_ROWS and weight.numel() >= least:
            return panel_linear(x, copy, bias)
        # one row by a weight stored input-major (the CPU engine's LM head): MKL's gemv streams it as fast
        one_row = x.numel() == x.shape[-1] and weight.stride(0) == 1
        matrices = None if one_row else packed(weight, x)
        return F.linear(x, weight, bias) if matrices is None else packed_linear(x, matrices[0], bias)
    flat = x.reshape(-1, x.shape[-1])
    count = flat.shape[0]
    tiles = -(-count // rows)
    padded = torch.zeros(tiles * rows, flat.shape[1], dtype=flat.dtype, device=flat.device)
    padded[:count] = flat
    out = torch.bmm(padded.view(tiles, rows, -1), weight.t().expand(tiles, *weight.t().shape))
    out = out.reshape(tiles * rows, -1)[:count]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


_ROW_ALIGN = 64  # elements: a multiple of every SIMD width and unroll PyTorch's CPU loops use


def rowwise(fn, x: torch.Tensor) -> torch.Tensor:
    """``fn`` (elementwise) applied to x (..., cols), batch-invariant inside ``batch_invariant``.

    PyTorch's vectorised CPU loops treat the tail of a tensor (numel not a multiple of their unrolled
    vector) with other code, whose rounding may differ in the last bit (sigmoid, silu); which elements
    fall in the tail depends on how many rows the tensor has.  Padding each row to a multiple of 64
    elements puts every element at the same place of its vector whatever the row count, and leaves no tail.
    """
    if tile_rows() is None or x.shape[-1] % _ROW_ALIGN == 0:
        return fn(x)
    cols = x.shape[-1]
    padded = F.pad(x, (0, -cols % _ROW_ALIGN))
    return fn(padded)[..., :cols]


class InvariantLinear(nn.Linear):
    """nn.Linear whose product is batch-invariant inside ``batch_invariant`` (same parameters and names)."""

    decode_panels: torch.Tensor | None = None  # the weight's panel copy for a compiled decode step (``prepacked``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.decode_panels)

    def __getstate__(self) -> dict:
        return module_state(self)

    def prepack_weights(self) -> tuple[torch.Tensor, ...]:
        """The weights ``prepacked.prepack_module`` may pack (``linear`` uses the copy where it applies)."""
        return (self.weight,)
