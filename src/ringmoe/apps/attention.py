"""`ringmoe attention`: flash_attn_func's backends against the float64 oracle and torch SDPA, on one screen."""

from __future__ import annotations

import time

import torch
from rich.console import Console
from rich.table import Table

from ..attention import AttentionSpec, attention_reference, flash_attn_func
from ..resources import require_memory

__all__ = ["attention_showcase"]


def attention_showcase(seqlen: int, seed: int) -> bool:
    """Exactness and speed of flash_attn_func against the float64 oracle and torch SDPA."""
    b, n, h, hkv, d = 1, seqlen, 8, 2, 64
    # the float64 oracle materialises (B, H, N, N) scores, exponentials and probabilities
    require_memory(f"attention --seqlen {seqlen}", {"float64 oracle": 3 * 8 * b * h * n * n,
                                                    "inputs and outputs": 40 * b * n * h * d},
                   advice="the exactness check materialises N x N scores: lower --seqlen")
    console = Console()
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, n, h, d, generator=gen)
    k = torch.randn(b, n, hkv, d, generator=gen)
    v = torch.randn(b, n, hkv, d, generator=gen)
    ref_out, ref_lse = attention_reference(q, k, v, AttentionSpec(d**-0.5, causal=True))
    table = Table(title=f"FlashAttention, causal GQA {h}/{hkv} heads, N={n}, D={d}, fp32, {torch.get_num_threads()} threads")
    for col in ("backend", "max |out - fp64|", "max |lse - fp64|", "ms"):
        table.add_column(col, justify="right")
    ok = True
    for backend in ("blockwise", "native", "auto"):
        flash_attn_func(q, k, v, causal=True, backend=backend)  # warm-up
        start = time.perf_counter()
        out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True, backend=backend)
        ms = (time.perf_counter() - start) * 1e3
        err_out = (out.double() - ref_out).abs().max().item()
        err_lse = (lse.double() - ref_lse).abs().max().item()
        ok &= err_out < 1e-4 and err_lse < 1e-4
        table.add_row(backend, f"{err_out:.2e}", f"{err_lse:.2e}", f"{ms:.1f}")
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k.repeat_interleave(h // hkv, 2), v.repeat_interleave(h // hkv, 2)))
    torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)  # warm-up, like the others
    start = time.perf_counter()
    torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    table.add_row("torch SDPA (peer)", "-", "-", f"{(time.perf_counter() - start) * 1e3:.1f}")
    console.print(table)
    console.print(f"exactness check: {'[green]PASS' if ok else '[red]FAIL'}")
    return ok
