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


def _parallel_rank(rank: int, world: int, seqlen: int, seed: int) -> dict:
    """One rank of the parallel showcase: ring attention and expert parallelism vs one device."""
    import torch.distributed as dist

    from ringmoe import flash_attn_func
    from ringmoe.moe import MoELayer
    from ringmoe.parallel import RingStats, ring_flash_attn_func, shard

    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, seqlen, 8, 64, generator=gen) for _ in range(3))
    want = shard(flash_attn_func(q, k, v, causal=True), world, rank, "zigzag")
    stats = RingStats()
    start = time.perf_counter()
    got = ring_flash_attn_func(*(shard(x, world, rank, "zigzag") for x in (q, k, v)), causal=True,
                               layout="zigzag", stats=stats)
    ring_ms = (time.perf_counter() - start) * 1e3
    totals = stats.totals("forward")

    full = MoELayer(256, 512, 8, 2)
    with torch.no_grad():
        for p in full.parameters():
            p.normal_(0.0, 0.05, generator=gen)
    ep = MoELayer(256, 512, 8, 2, group=dist.group.WORLD, overlap_chunks=2)
    with torch.no_grad():
        ep.router.weight.copy_(full.router.weight)
    ep.load_expert_weights(full.experts.gate_up, full.experts.down)
    tokens = torch.randn(world * 1024, 256, generator=gen)
    rows = slice(rank * 1024, (rank + 1) * 1024)
    with torch.no_grad():
        moe_err = (ep(tokens[rows]) - full(tokens)[rows]).abs().max().item()
    return {
        "ring_err": (got - want).abs().max().item(),
        "ring_ms": ring_ms,
        "compute_s": totals["compute_s"],
        "exposed": totals["exposed_comm_fraction"],
        "moe_err": moe_err,
        "tokens_per_rank": ep.last_stats.tokens_per_rank.tolist(),
        "dropped": ep.last_stats.dropped_tokens,
    }


def _parallel_showcase(args) -> bool:
    """Ring attention (zigzag) and expert parallelism on 2 local gloo ranks, checked against one device."""
    from rich.console import Console
    from rich.table import Table

    from ringmoe.parallel.launch import spawn

    console = Console()
    with console.status("ring attention and expert parallelism on 2 CPU ranks..."):
        ranks = spawn(_parallel_rank, 2, args.seqlen, args.seed, timeout=600)
    computes = [r["compute_s"] for r in ranks]
    table = Table(title=f"2 gloo ranks: ring attention (zigzag, causal, N={args.seqlen}) and expert parallelism (E=8, top-2)")
    for col in ("rank", "ring max err", "ring ms", "exposed comm", "EP max err", "EP rows per rank", "dropped"):
        table.add_column(col, justify="right")
    ok = True
    for rank, r in enumerate(ranks):
        ok &= r["ring_err"] < 1e-4 and r["moe_err"] < 1e-4
        table.add_row(str(rank), f"{r['ring_err']:.1e}", f"{r['ring_ms']:.0f}", f"{r['exposed']:.1%}",
                      f"{r['moe_err']:.1e}", str(r["tokens_per_rank"]), str(r["dropped"]))
    console.print(table)
    console.print(f"causal work imbalance (max/mean compute): {max(computes) / (sum(computes) / len(computes)):.3f}")
    console.print(f"parallel exactness check: {'[green]PASS' if ok else '[red]FAIL'}")
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
        ok = _attention_showcase(args)
        ok = _parallel_showcase(args) and ok
        return 0 if ok else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
