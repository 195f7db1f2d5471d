"""Expert parallelism on 2 local ranks (one thread each): where the time goes, overlap, skew, replicas.

T=4096 tokens per rank, hidden 512, ffn 1024, 8 experts, top-2, float32, forward (serving).
Configurations: balanced vs skewed routing (experts 0 and 1, both on rank 0, take most tokens),
overlap_chunks 1 vs 4, and hot-expert replicas (plan_replicas on the measured skewed load, two
spare slots per rank).  Reports per-rank route / dispatch / experts / combine seconds, the
per-rank load max/mean, and dispatch bytes vs the minimum (one row per token and remote rank).
Writes benchmarks/results/ep.json and ep.png.

    python benchmarks/bench_ep.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import pyplot, write_results  # noqa: E402

from ringmoe.moe import MoELayer, plan_replicas  # noqa: E402
from ringmoe.parallel.launch import spawn  # noqa: E402

T, HIDDEN, FFN, E, K, WORLD = 4096, 512, 1024, 8, 2, 2


def full_layer(skewed):
    gen = torch.Generator().manual_seed(0)
    layer = MoELayer(HIDDEN, FFN, E, K)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        if skewed:
            layer.router.weight[0] = layer.router.weight[0].abs() * 4
            layer.router.weight[1] = layer.router.weight[0] * 0.9 + 0.01
    return layer


def tokens(rank, skewed):
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, HIDDEN, generator=gen)
    return x + 0.5 if skewed else x


def min_bytes(layer, x, rank):
    """One row per (token, remote rank) it needs: the least any dispatch can send."""
    idx = layer.router(x).topk_idx
    owner = idx // (E // WORLD)
    remote = torch.zeros(T, WORLD, dtype=torch.bool)
    remote.scatter_(1, owner, True)
    remote[:, rank] = False
    return int(remote.sum()) * HIDDEN * x.element_size()


def rank_main(rank, world, repeats):
    rows = []
    for skewed in (False, True):
        full = full_layer(skewed)
        x = tokens(rank, skewed)
        load = None
        variants = [("no_overlap", 1, False), ("overlap_4", 4, False)] + ([("replicas", 1, True)] if skewed else [])
        for name, chunks, replicated in variants:
            plan = None
            if replicated:
                plan = plan_replicas(load, WORLD, E // WORLD + 2)
            layer = MoELayer(HIDDEN, FFN, E, K, group=dist.group.WORLD, overlap_chunks=chunks, replicas=plan)
            with torch.no_grad():
                layer.router.weight.copy_(full.router.weight)
            layer.load_expert_weights(full.experts.gate_up, full.experts.down)
            times, parts = [], []
            with torch.no_grad():
                for i in range(repeats + 1):
                    dist.barrier()
                    start = time.perf_counter()
                    layer(x)
                    elapsed = time.perf_counter() - start
                    if i:
                        times.append(elapsed)
                        parts.append(layer.last_stats.timings)
            stats = layer.last_stats
            load = stats.routed_per_expert if load is None else load
            rows.append(dict(
                routing="skewed" if skewed else "balanced", variant=name, rank=rank,
                seconds=statistics.median(times),
                **{k: statistics.median(p[k] for p in parts) for k in ("route_s", "dispatch_s", "experts_s", "combine_s")},
                rank_load=stats.tokens_per_rank.tolist(), rank_imbalance=stats.rank_imbalance,
                dispatch_bytes=stats.timings["dispatch_bytes"], min_bytes=min_bytes(full, x, rank),
            ))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    per_rank = spawn(rank_main, WORLD, args.repeats, timeout=1200)
    rows = [r for rank_rows in per_rank for r in rank_rows]
    summary = {}
    for routing in ("balanced", "skewed"):
        for variant in ("no_overlap", "overlap_4", "replicas"):
            sel = [r for r in rows if r["routing"] == routing and r["variant"] == variant]
            if not sel:
                continue
            summary[f"{routing}/{variant}"] = dict(
                seconds=max(r["seconds"] for r in sel),
                exchange_s=max(r["dispatch_s"] + r["combine_s"] for r in sel),
                experts_s=max(r["experts_s"] for r in sel),
                rank_imbalance=sel[0]["rank_imbalance"],
                bytes_over_minimum=sum(r["dispatch_bytes"] for r in sel) / max(1, sum(r["min_bytes"] for r in sel)),
            )
    for routing in ("balanced", "skewed"):
        base, lapped = summary[f"{routing}/no_overlap"], summary[f"{routing}/overlap_4"]
        hidden = (base["seconds"] - lapped["seconds"]) / base["exchange_s"] if base["exchange_s"] > 0 else 0.0
        summary[f"{routing}/overlap_hidden_fraction_of_exchange"] = hidden
    for key, value in summary.items():
        print(f"{key:45s} {value}")
    write_results("ep", {"config": dict(T_per_rank=T, hidden=HIDDEN, ffn=FFN, experts=E, top_k=K,
                                               world_size=WORLD, dtype="float32"),
                                "rows": rows, "summary": summary}, plot, summary)


def plot(summary, path):
    plt = pyplot()
    keys = [k for k, v in summary.items() if isinstance(v, dict)]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    axes[0].bar(keys, [summary[k]["seconds"] for k in keys], label="total", color="C0")
    axes[0].bar(keys, [summary[k]["exchange_s"] for k in keys], label="dispatch + combine (slowest rank)",
                color="C3", alpha=0.7)
    axes[0].set(title=f"EP forward, {WORLD} ranks, T={T}/rank, E={E}, top-{K}", ylabel="seconds")
    axes[0].tick_params(axis="x", rotation=30)
    axes[0].legend(fontsize=8)
    axes[1].bar(keys, [summary[k]["rank_imbalance"] for k in keys], color="C2")
    axes[1].axhline(1.2, color="k", lw=0.8, ls="--")
    axes[1].set(title="per-rank load max/mean", ylim=(0.9, None))
    axes[1].tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
