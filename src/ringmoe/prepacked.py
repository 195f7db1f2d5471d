"""Weights kept a second time in a layout for the CPU products of few rows that decode steps run.

A decode step multiplies a handful of rows (one per request, or per request routed to an expert) by each weight
matrix.  MKL's sgemm packs the weight into its own panel layout on every call, and for a few rows that packing
is most of the work: a (8, 256) x (256, 1024) product from cold memory took ~190 us on the 2-core development
machine (an AMD EPYC, AVX2), about 5 GB/s of weights.  oneDNN multiplies a weight that was reordered once into
its blocked layout (the pair of private operators torch's inductor uses for the same purpose) in ~85 us, and an
LM head (4096 x 256) at 8 rows in ~320 us instead of ~1050 us (each product alone, cold; whole decode steps:
``benchmarks/bench_decode.py``).  A stack of expert matrices (E, out, in) is packed instead into the 16-column
panels of ``ringmoe.panel_gemm`` where that kernel runs (x86-64 with AVX2), whose grouped product of all the
experts in one call is faster still (2.4-4x the oneDNN copies at 2-128 rows): ``packed_panels`` returns it.

``prepack(weight)`` stores the blocked copy beside the parameter (a side table keyed by the tensor: modules,
state dicts and deep copies never see it); ``packed(weight, x)`` returns it only where it gives the plain
product: float32 on a CPU, no gradient wanted, outside a graph torch.compile traces, and only while the weight
is unchanged since it was packed (its version counter and storage: an optimizer step, ``copy_`` or
``module.to(...)`` make the copy stale and the plain product is used).  The copy costs the weight's bytes
again: the serving engine packs the products a step runs eagerly (``prepack_weights``) and its memory check
counts them.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from . import panel_gemm

__all__ = ["prepack_supported", "prepack", "packed", "packed_panels", "has_panels", "panel_copy", "packed_linear",
           "prepacked_bytes", "prepack_module"]


@dataclass
class _Pack:
    source: weakref.ref   # the parameter it copies (an id may be reused once that one is freed)
    version: int          # the parameter's version counter when it was packed
    data_ptr: int         # and where its values lay (``module.to(...)``, ``.data = ...`` move them)
    matrices: list | None         # oneDNN: one blocked copy per (out, in) matrix (one for a 2-D weight, E for a stack)
    panels: torch.Tensor | None   # or a stack's panel copy (E, out * in) for ``panel_gemm.grouped_linear``
    nbytes: int


_PACKS: dict[int, _Pack] = {}


def prepack_supported(weight: torch.Tensor) -> bool:
    """Can ``weight`` ((out, in) or a stack (E, out, in)) be packed: float32 on a CPU with oneDNN."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() in (2, 3)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def prepack(weight: torch.Tensor, rows_hint: int = 8) -> int:
    """Store a second copy of ``weight``: a stack (E, out, in) as ``panel_gemm``'s panels where that kernel runs,
    else (and a 2-D weight always) oneDNN's blocked copy of each matrix; its bytes, 0 when the weight cannot be
    packed (``prepack_supported``).  ``rows_hint``: the rows a product usually has (a hint to oneDNN's choice of
    layout; products of any row count use the copy)."""
    if not prepack_supported(weight):
        return 0
    key = id(weight)
    matrices = panels = None
    with torch.no_grad():
        stack = weight.detach()
        if stack.dim() == 3 and panel_gemm.available():
            panels = panel_gemm.pack(stack)
        else:
            matrices = [torch.ops.mkldnn._reorder_linear_weight(m.contiguous(), rows_hint)
                        for m in (stack.unbind(0) if stack.dim() == 3 else (stack,))]
    if key not in _PACKS:
        weakref.finalize(weight, _PACKS.pop, key, None)
    nbytes = weight.numel() * weight.element_size()
    _PACKS[key] = _Pack(weakref.ref(weight), weight._version, weight.data_ptr(), matrices, panels, nbytes)
    return nbytes


def _current(weight: torch.Tensor) -> _Pack | None:
    """``weight``'s pack if it is unchanged since it was packed (same tensor, version and storage)."""
    pack = _PACKS.get(id(weight))
    if (pack is None or pack.source() is not weight or pack.version != weight._version
            or pack.data_ptr != weight.data_ptr()):
        return None
    return pack


def _usable(weight: torch.Tensor, x: torch.Tensor) -> _Pack | None:
    """``weight``'s pack when a product of x by it may use it: packed and unchanged since, x of its dtype, no
    gradient through the product, not traced."""
    if torch.compiler.is_compiling():  # first: a traced graph keeps the plain product and never sees the table
        return None
    pack = _current(weight)
    if pack is None or x.dtype != weight.dtype:
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return None
    return pack


def packed(weight: torch.Tensor, x: torch.Tensor) -> list | None:
    """The oneDNN copies of ``weight`` (a list: one per matrix) when a product of x by it may use them, else None."""
    pack = _usable(weight, x)
    return None if pack is None else pack.matrices


def packed_panels(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
    """The panel copy of the stack ``weight`` (E, out * in) when a product of x by it may use it, else None."""
    pack = _usable(weight, x)
    return None if pack is None else pack.panels


def packed_linear(x: torch.Tensor, matrix: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) @ W.T (+ bias) for one blocked copy of W (out, in) from ``packed``: (..., out)."""
    return torch.ops.mkldnn._linear_pointwise(x, matrix, bias, "none", [], "")


def has_panels(weight: torch.Tensor) -> bool:
    """Does the stack ``weight`` have a current panel copy (``packed_panels`` hands it to the products that may
    use it).  Call outside torch.compile (a traced graph never sees the table)."""
    return panel_copy(weight) is not None


def panel_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """The current panel copy of the stack ``weight`` (E, out * in), or None.  Call outside torch.compile."""
    pack = _current(weight)
    return None if pack is None else pack.panels


def prepacked_bytes(weight: torch.Tensor) -> int:
    """Bytes of ``weight``'s blocked copy, 0 when it has none."""
    pack = _PACKS.get(id(weight))
    return 0 if pack is None or pack.source() is not weight else pack.nbytes


def prepack_module(module: torch.nn.Module) -> int:
    """Pack every weight that ``module``'s submodules name in ``prepack_weights()`` (the layers that multiply
    through ``packed``); the bytes added."""
    total = 0
    for sub in module.modules():
        for weight in getattr(sub, "prepack_weights", lambda: ())():
            total += prepack(weight)
    return total
