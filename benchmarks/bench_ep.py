"""Expert parallelism on 2 local ranks (one thread each): where the time goes, overlap, skew, replicas.

T=4096 tokens per rank, hidden 1024, ffn 256, 8 experts, top-2, float32, forward (serving).  The
shape keeps the exchange a real share of the layer, as on GPU clusters (DeepSeek-V3 serving on
H800s moves ~21 KB per remote assignment for ~88 MFLOP of expert work: the wire time is of the order
of the compute); with hidden 512 / ffn 1024 the exchange here is ~3% of the layer and lost in noise.

Variants, all timed interleaved (one call of each per round, medians over rounds):
  serial        overlap_chunks=1: dispatch, experts, combine one after the other
  sync_n        n chunks, every exchange waited for as soon as it starts (the same work, no overlap)
  overlap_n     n chunks pipelined: what the overlap hides is sync_n - overlap_n
  replicas      skewed routing with hot-expert replicas (plan_replicas on the measured load), serial
  replicas_overlap_2
Also the exchange alone (the same rows, no compute) with the CPU seconds it burns per second (gloo copies
through TCP loopback take CPU from the experts on 2 busy cores), and the least bytes any dispatch can send.
A rank's exposed exchange is its time blocked waiting on exchanges (``wait_s``) less its straggler wait
(how long before the slowest rank its experts finished: imbalance, not communication); per call, median,
slowest rank.  hidden fraction(n) = 1 - exposed(overlap_n) / exposed(serial); against sync_n as well.
Wall clock: wall_clock_hidden(n) = (sync_n - overlap_n) / exposed(sync_n), the share of the exchange the
layer's time actually loses (the exchange's CPU work still competes with the experts).
Writes benchmarks/results/ep.json and ep.png.

    python benchmarks/bench_ep.py [--rounds 12]
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

T, HIDDEN, FFN, E, K, WORLD = 4096, 1024, 256, 8, 2, 2
CHUNKS = (2, 3, 4)
PHASES = ("route_s", "dispatch_s", "experts_s", "combine_s", "wait_s", "straggler_s")


def full_layer(skewed):
    gen = torch.Generator().manual_seed(0)
    layer = MoELayer(HIDDEN, FFN, E, K)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        if skewed:  # experts 0 and 1, both on rank 0, take most tokens
            layer.router.weight[0] = layer.router.weight[0].abs() * 4
            layer.router.weight[1] = layer.router.weight[0] * 0.9 + 0.01
    return layer


def tokens(rank, skewed):
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, HIDDEN, generator=gen)
    return x + 0.5 if skewed else x


def remote_rows(layer, x, rank):
    """(P,) rows this rank must send to each rank: one per (token, remote rank owning one of its experts)."""
    owner = layer.router(x).topk_idx // (E // WORLD)
    needs = torch.zeros(T, WORLD, dtype=torch.bool)
    needs.scatter_(1, owner, True)
    needs[:, rank] = False
    return needs.sum(0)


def exchange_alone(send):
    """The serial layer's two exchanges without the compute: rows + 2k meta columns out, rows back."""
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    s, r = send.tolist(), recv.tolist()
    out, back = torch.randn(sum(s), HIDDEN + 2 * K), torch.randn(sum(r), HIDDEN)

    def run():
        dist.all_to_all_single(torch.empty(sum(r), HIDDEN + 2 * K), out, r, s)
        dist.all_to_all_single(torch.empty(sum(s), HIDDEN), back, s, r)

    return run


def ep_layer(full, chunks, sync=False, replicas=None):
    layer = MoELayer(HIDDEN, FFN, E, K, group=dist.group.WORLD, overlap_chunks=chunks, replicas=replicas)
    layer.sync_exchanges = sync
    with torch.no_grad():
        layer.router.weight.copy_(full.router.weight)
    layer.load_expert_weights(full.experts.gate_up, full.experts.down)
    return layer


def rank_main(rank, world, rounds):
    rows = []
    for skewed in (False, True):
        full, x = full_layer(skewed), tokens(rank, skewed)
        variants = {"serial": ep_layer(full, 1)}
        for n in CHUNKS if not skewed else CHUNKS[:1]:
            variants[f"sync_{n}"] = ep_layer(full, n, sync=True)
            variants[f"overlap_{n}"] = ep_layer(full, n)
        if skewed:
            with torch.no_grad():
                variants["serial"](x)
            plan = plan_replicas(variants["serial"].last_stats.routed_per_expert, WORLD, E // WORLD + 2)
            variants["replicas"] = ep_layer(full, 1, replicas=plan)
            variants["replicas_overlap_2"] = ep_layer(full, 2, replicas=plan)
        send = remote_rows(full, x, rank)
        alone = exchange_alone(send)
        times = {name: [] for name in [*variants, "exchange_alone"]}
        parts = {name: [] for name in variants}
        cpu_share = []
        with torch.no_grad():
            for i in range(rounds + 1):  # round 0 warms up
                for name in times:
                    dist.barrier()
                    cpu, start = time.process_time(), time.perf_counter()
                    variants[name](x) if name in variants else alone()
                    elapsed = time.perf_counter() - start
                    if i:
                        times[name].append(elapsed)
                        if name in variants:
                            parts[name].append(variants[name].last_stats.timings)
                        else:  # CPU seconds of every thread of this rank (gloo's included) per second
                            cpu_share.append((time.process_time() - cpu) / elapsed)
        routing = "skewed" if skewed else "balanced"
        rows.append(dict(routing=routing, variant="exchange_alone", rank=rank,
                         seconds=statistics.median(times["exchange_alone"]), cpu_share=statistics.median(cpu_share)))
        for name, layer in variants.items():
            stats = layer.last_stats
            rows.append(dict(
                routing=routing, variant=name, rank=rank, seconds=statistics.median(times[name]),
                **{k: statistics.median(p[k] for p in parts[name]) for k in PHASES},
                exposed_s=statistics.median(max(0.0, p["wait_s"] - p["straggler_s"]) for p in parts[name]),
                rank_load=stats.tokens_per_rank.tolist(), rank_imbalance=stats.rank_imbalance,
                dispatch_bytes=stats.timings["dispatch_bytes"], min_bytes=int(send.sum()) * HIDDEN * x.element_size(),
            ))
    return rows


def summarize(rows):
    summary = {}
    for routing in ("balanced", "skewed"):
        names = dict.fromkeys(r["variant"] for r in rows if r["routing"] == routing)
        for name in names:
            sel = [r for r in rows if r["routing"] == routing and r["variant"] == name]
            entry = dict(seconds=max(r["seconds"] for r in sel))
            if name == "exchange_alone":
                entry["cpu_share"] = statistics.mean(r["cpu_share"] for r in sel)
            else:
                entry.update({k: max(r[k] for r in sel) for k in PHASES})
                entry["exchange_s"] = max(r["dispatch_s"] + r["combine_s"] for r in sel)
                entry["exposed_s"] = max(r["exposed_s"] for r in sel)
                slowest = max(sel, key=lambda r: r["seconds"])
                entry["slowest_rank"] = {k: slowest[k] for k in ("rank", *PHASES)}
                entry["rank_imbalance"] = sel[0]["rank_imbalance"]
                entry["bytes_over_minimum"] = (sum(r["dispatch_bytes"] for r in sel)
                                               / max(1, sum(r["min_bytes"] for r in sel)))
            summary[f"{routing}/{name}"] = entry
        hidden = {}
        for n in CHUNKS:
            sync, lapped = summary.get(f"{routing}/sync_{n}"), summary.get(f"{routing}/overlap_{n}")
            if sync and lapped:
                hidden[n] = 1.0 - lapped["exposed_s"] / summary[f"{routing}/serial"]["exposed_s"]
                lapped["hidden_fraction"] = hidden[n]
                lapped["hidden_fraction_vs_sync"] = 1.0 - lapped["exposed_s"] / sync["exposed_s"]
                lapped["saved_vs_sync_s"] = sync["seconds"] - lapped["seconds"]
                lapped["wall_clock_hidden"] = lapped["saved_vs_sync_s"] / sync["exposed_s"]
                lapped["speedup_vs_serial"] = summary[f"{routing}/serial"]["seconds"] / lapped["seconds"]
        best = max(hidden, key=hidden.get)
        summary[f"{routing}/best_overlap"] = dict(chunks=best, hidden_fraction=hidden[best])
    return summary


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    per_rank = spawn(rank_main, WORLD, args.rounds, timeout=1800)
    rows = [r for rank_rows in per_rank for r in rank_rows]
    summary = summarize(rows)
    for key, value in summary.items():
        print(f"{key:32s} " + ", ".join(f"{k}={v:.4g}" for k, v in value.items() if not isinstance(v, dict)))
    write_results("ep", {"config": dict(T_per_rank=T, hidden=HIDDEN, ffn=FFN, experts=E, top_k=K, world_size=WORLD,
                                        dtype="float32", rounds=args.rounds),
                         "rows": rows, "summary": summary}, plot, summary)


def plot(summary, path):
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    keys = [k for k, v in summary.items() if "slowest_rank" in v]
    bottom = [0.0] * len(keys)
    for phase, color in zip(("route_s", "dispatch_s", "experts_s", "combine_s"), ("C7", "C3", "C0", "C1")):
        values = [summary[k]["slowest_rank"][phase] for k in keys]
        axes[0].bar(keys, values, bottom=bottom, color=color, label=phase[:-2] + " (slowest rank)")
        bottom = [b + v for b, v in zip(bottom, values)]
    axes[0].scatter(keys, [summary[k]["seconds"] for k in keys], color="k", zorder=3, label="layer time")
    axes[0].set(title=f"EP forward, {WORLD} ranks, T={T}/rank, H={HIDDEN}, F={FFN}, E={E}, top-{K}", ylabel="seconds")
    axes[0].tick_params(axis="x", rotation=70, labelsize=7)
    axes[0].legend(fontsize=7)
    for routing, marker in (("balanced", "o"), ("skewed", "s")):
        for metric, style in (("hidden_fraction", "-"), ("wall_clock_hidden", ":")):
            points = [(n, summary[f"{routing}/overlap_{n}"][metric]) for n in CHUNKS
                      if f"{routing}/overlap_{n}" in summary]
            axes[1].plot(*zip(*points), marker=marker, ls=style, label=f"{routing}: {metric.replace('_', ' ')}")
    axes[1].axhline(0.5, color="k", lw=0.8, ls="--")
    top = max(v.get(m, 0.0) for v in summary.values() for m in ("hidden_fraction", "wall_clock_hidden"))
    axes[1].set(title="share of the exchange hidden by overlap", xlabel="overlap_chunks", xticks=list(CHUNKS),
                ylim=(0, max(1.05, top + 0.05)))
    axes[1].legend(fontsize=8)
    skew = [k for k in keys if k.startswith("skewed/")]
    axes[2].bar(skew, [summary[k]["rank_imbalance"] for k in skew], color="C2")
    axes[2].axhline(1.2, color="k", lw=0.8, ls="--")
    axes[2].set(title="skewed routing: per-rank load max/mean", ylim=(0.9, None))
    axes[2].tick_params(axis="x", rotation=30, labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
