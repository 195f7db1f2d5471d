"""Decode attention over the paged cache in one C call per layer (``paged_attention.c``), for the compiled decode step.

``paged_decode`` in tensor ops gathers every row's blocks into a contiguous copy of its keys and values, then runs
the scores, the mask, the softmax's passes and the weighted sum as separate kernels: in a compiled batch-32 step of
the small preset the gather alone was the step's largest kernel (~1 ms per pair of layers, 2 CPU threads).  The C
kernel walks each (row, K/V head)'s blocks where they lie in the cache, once, with the online softmax, and returns
the output and the log-sum-exp of the cached keys (the caller merges the keys not yet in the cache).

It runs where ``applies``: float32 query and cache on a CPU where ``panel_gemm``'s library builds (x86-64, AVX2, a C
compiler); elsewhere (float64 references, bf16, FP8 caches, GPUs) the tensor ops run.  A torch operator
(``ringmoe::paged_cached_attention``, declared through ``torch.library.Library``: ``grouped_op`` says why) so a
compiled graph calls it as one node.
"""

from __future__ import annotations

import torch

from .. import panel_gemm

__all__ = ["applies", "paged_cached_attention"]

_LIBRARY = torch.library.Library("ringmoe", "FRAGMENT")
_LIBRARY.define("paged_cached_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor first, "
                "Tensor last, float scale) -> (Tensor, Tensor)")


def applies(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Does the C kernel run for this query and cache (float32 on a CPU with the kernel library)."""
    return (q.dtype == k_cache.dtype == v_cache.dtype == torch.float32 and q.device.type == "cpu"
            and k_cache.device.type == "cpu" and _built())


@torch.compiler.assume_constant_result
def _built() -> bool:
    """Whether the kernel library loaded here: torch.compile takes it as a constant of the graph it traces (it
    would otherwise trace into the build)."""
    return panel_gemm._library() is not None


def _paged_cached_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                            first: torch.Tensor, last: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q (n, heads, D) float32; k_cache, v_cache (blocks, block_size, kv_heads, D) float32; tables (n, width) int64;
    first, last (n,) int64: row r attends to the positions [first[r], last[r]) of its sequence (position p at slot
    p % block_size of block tables[r, p // block_size]), scores scaled by ``scale``.  -> out (n, heads, D) float32
    (0 for a row that sees no key) and lse (n, heads) float32 (-inf there)."""
    n, heads, dim = q.shape
    blocks, block_size, kv_heads, cache_dim = k_cache.shape
    if (not applies(q, k_cache, v_cache) or v_cache.shape != k_cache.shape or cache_dim != dim
            or heads % kv_heads or tables.dtype != torch.int64 or tables.dim() != 2 or tables.shape[0] != n
            or first.dtype != torch.int64 or last.dtype != torch.int64 or first.shape != (n,) or last.shape != (n,)
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
        raise ValueError(f"paged_cached_attention: q {tuple(q.shape)} {q.dtype}, caches {tuple(k_cache.shape)} "
                         f"{k_cache.dtype} / {tuple(v_cache.shape)}, tables {tuple(tables.shape)} {tables.dtype}, "
                         f"first / last {tuple(first.shape)} / {tuple(last.shape)} do not fit together")
    q, tables, first, last = q.contiguous(), tables.contiguous(), first.contiguous(), last.contiguous()
    out = torch.empty(n, heads, dim, dtype=torch.float32)
    lse = torch.empty(n, heads, dtype=torch.float32)
    status = panel_gemm._library().paged_cached_attention(
        q.data_ptr(), n, heads, dim, k_cache.data_ptr(), v_cache.data_ptr(), blocks, block_size, kv_heads,
        tables.data_ptr(), tables.shape[1], first.data_ptr(), last.data_ptr(), float(scale), out.data_ptr(),
        lse.data_ptr(), torch.get_num_threads())
    if status == -2:
        raise ValueError("paged_cached_attention: a block table entry or a row's key range lies outside the cache "
                         "or the table")
    if status != 0:
        raise MemoryError("paged_cached_attention: out of memory for the scratch of a thread")
    return out, lse


def _shapes(q, k_cache, v_cache, tables, first, last, scale):
    return q.new_empty(q.shape, dtype=torch.float32), q.new_empty(q.shape[:2], dtype=torch.float32)


_LIBRARY.impl("paged_cached_attention", _paged_cached_attention, "CompositeExplicitAutograd")
torch.library.register_fake("ringmoe::paged_cached_attention", _shapes, lib=_LIBRARY)
paged_cached_attention = torch.ops.ringmoe.paged_cached_attention.default
