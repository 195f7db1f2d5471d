"""The ``ringmoe`` command.  It only composes library calls; no logic of its own."""

from __future__ import annotations

import argparse
import sys
import time

import torch


def _attention_showcase(args) -> bool:
    """Exactness and speed of flash_attn_func against the float64 oracle and torch SDPA."""
    from rich.console import Console
    from rich.table import Table

    from ringmoe import flash_attn_func
    from ringmoe.attention import AttentionSpec, attention_reference

    console = Console()
    gen = torch.Generator().manual_seed(args.seed)
    b, n, h, hkv, d = 1, args.seqlen, 8, 2, 64
    q = torch.randn(b, n, h, d, generator=gen)
    k = torch.randn(b, n, hkv, d, generator=gen)
    v = torch.randn(b, n, hkv, d, generator=gen)
    spec = AttentionSpec(d**-0.5, causal=True)
    ref_out, ref_lse = attention_reference(q, k, v, spec)
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
    start = time.perf_counter()
    torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    table.add_row("torch SDPA (peer)", "-", "-", f"{(time.perf_counter() - start) * 1e3:.1f}")
    console.print(table)
    console.print(f"exactness check: {'[green]PASS' if ok else '[red]FAIL'}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ringmoe",
        description="Exact long-context mixture-of-experts transformers across devices.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the showcase and check it against the float64 reference")
    demo.add_argument("--seqlen", type=int, default=4096, help="tokens in the prompt (default 4096)")
    demo.add_argument("--seed", type=int, default=0, help="random seed for inputs and weights")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return 0 if _attention_showcase(args) else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
