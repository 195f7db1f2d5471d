"""Decode attention over the paged cache in one C call per layer (``paged_attention.c``), for the compiled decode step.

``paged_decode`` in tensor ops gathers every row's blocks into a contiguous copy of its keys and values, then runs
the scores, the mask, the softmax's passes and the weighted sum as separate kernels: in a compiled batch-32 step of
the small preset the gather alone was the step's largest kernel (~1 ms per pair of layers, 2 CPU threads).  The C
kernel walks each (row, K/V head)'s blocks where they lie in the cache, once, with the online softmax, and returns
the output and the log-sum-exp of the cached keys (the caller merges the keys not yet in the cache).

It runs where ``applies``: float32 query and cache on a CPU where ``panel_gemm``'s library builds (x86-64, AVX2, a C
compiler); elsewhere (float64 references, bf16, FP8 caches, GPUs) the tensor ops run.  A torch operator
(``ringmoe::paged_cached_attention``, declared in ``ringmoe.operators``) so a compiled graph calls it as one node.
Its CPU kernel is C too where torch's C shim allows (``torch_ops.c``, ``operators.c_kernels``): a compiled graph
then calls the kernel without entering Python (~25 us a call less; in one process the small preset's compiled steps
of 8 / 32 rows 1.02x / 1.01x faster, and a batch of one, which took the gather in tensor ops while the call cost
that much, 1.09-1.21x: ``paged.paged_decode``); elsewhere the operator's kernel is the Python function below, which
calls the same C code.
"""

from __future__ import annotations

import torch

from .. import panel_gemm
from ..operators import LIBRARY, c_kernels

__all__ = ["applies", "native", "paged_cached_attention"]



def applies(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Does the C kernel run for this query and cache (float32 on a CPU with the kernel library)."""
    return (q.dtype == k_cache.dtype == v_cache.dtype == torch.float32 and q.device.type == "cpu"
            and k_cache.device.type == "cpu" and _built())


@torch.compiler.assume_constant_result
def _built() -> bool:
    """Whether the kernel library loaded here (and its C kernel registered for the operator where it can be):
    torch.compile takes it as a constant of the graph it traces (it would otherwise trace into the build)."""
    if panel_gemm._library() is None:
        return False
    c_kernels()
    return True


@torch.compiler.assume_constant_result
def native() -> bool:
    """Whether the operator's CPU kernel is C (``torch_ops.c``): a call costs the dispatcher only (a constant of
    a traced graph, as ``_built``)."""
    return _built() and c_kernels()


def paged_cached_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                           first: torch.Tensor, last: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The operator's contract (``_paged_cached_attention``), its arguments checked here (ValueError; traced, the
    checks run once, on the graph's shapes) and made contiguous as its kernels read them."""
    _check(q, k_cache, v_cache, tables, first, last)
    return _operator(q.contiguous(), k_cache, v_cache, tables.contiguous(), first.contiguous(), last.contiguous(),
                     scale)


def _check(q, k_cache, v_cache, tables, first, last) -> None:
    n, heads, dim = q.shape
    kv_heads, cache_dim = k_cache.shape[2:]
    if (not applies(q, k_cache, v_cache) or v_cache.shape != k_cache.shape or cache_dim != dim
            or heads % kv_heads or tables.dtype != torch.int64 or tables.dim() != 2 or tables.shape[0] != n
            or first.dtype != torch.int64 or last.dtype != torch.int64 or first.shape != (n,) or last.shape != (n,)
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
        raise ValueError(f"paged_cached_attention: q {tuple(q.shape)} {q.dtype}, caches {tuple(k_cache.shape)} "
                         f"{k_cache.dtype} / {tuple(v_cache.shape)}, tables {tuple(tables.shape)} {tables.dtype}, "
                         f"first / last {tuple(first.shape)} / {tuple(last.shape)} do not fit together")


def _paged_cached_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                            first: torch.Tensor, last: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q (n, heads, D) float32; k_cache, v_cache (blocks, block_size, kv_heads, D) float32; tables (n, width) int64;
    first, last (n,) int64: row r attends to the positions [first[r], last[r]) of its sequence (position p at slot
    p % block_size of block tables[r, p // block_size]), scores scaled by ``scale``.  -> out (n, heads, D) float32
    (0 for a row that sees no key) and lse (n, heads) float32 (-inf there).  A table entry or a range outside the
    cache or the table: RuntimeError (the engine's own tables: never a request's input), as from the C kernel."""
    _check(q, k_cache, v_cache, tables, first, last)
    n, heads, dim = q.shape
    blocks, block_size, kv_heads, _ = k_cache.shape
    q, tables, first, last = q.contiguous(), tables.contiguous(), first.contiguous(), last.contiguous()
    out = torch.empty(n, heads, dim, dtype=torch.float32)
    lse = torch.empty(n, heads, dtype=torch.float32)
    status = panel_gemm._library().paged_cached_attention(
        q.data_ptr(), n, heads, dim, k_cache.data_ptr(), v_cache.data_ptr(), blocks, block_size, kv_heads,
        tables.data_ptr(), tables.shape[1], first.data_ptr(), last.data_ptr(), float(scale), out.data_ptr(),
        lse.data_ptr(), torch.get_num_threads())
    if status == -2:
        raise RuntimeError("paged_cached_attention: a block table entry or a row's key range lies outside the cache "
                         "or the table")
    if status != 0:
        raise MemoryError("paged_cached_attention: out of memory for the scratch of a thread")
    return out, lse


def _shapes(q, k_cache, v_cache, tables, first, last, scale):
    return q.new_empty(q.shape, dtype=torch.float32), q.new_empty(q.shape[:2], dtype=torch.float32)


LIBRARY.impl("paged_cached_attention", _paged_cached_attention, "CompositeExplicitAutograd")
torch.library.register_fake("ringmoe::paged_cached_attention", _shapes, lib=LIBRARY)
_operator = torch.ops.ringmoe.paged_cached_attention.default
