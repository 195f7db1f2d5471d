"""Sequence parallelism three ways: the ring, Ulysses and the Ulysses x ring hybrid (USP), side by side.

Part 1, measured on this CPU: cp = 2 and 4 local gloo ranks (one thread each), N tokens, H = 8 query heads,
2 K/V heads (GQA: Ulysses 4 repeats them), D = 64, float32, causal, zigzag; forward and forward + backward;
per rank the bytes it sends in the forward (the ring's K/V blocks, Ulysses's all-to-alls) and the median
wall time, next to one process's flash attention on the machine's threads and the cost model's prediction
with this machine's profile calibrated in the same run.

Part 2, the cost model (ringmoe.sim.sequence_parallel) for 8 to 64 H100s / H200s (8 per node) at 128K to
1M tokens, for a GQA model (32 q heads, 8 K/V heads, D 128) and DeepSeek-V3 (MLA, 128 heads): the
factorization it picks and its time against the pure ring and pure Ulysses.

Writes benchmarks/results/sp.json and sp.png.

    python benchmarks/bench_sp.py [--seqlen 8192] [--repeats 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median_time, pyplot, write_results  # noqa: E402

from ringmoe import flash_attn_func  # noqa: E402
from ringmoe.model import ModelConfig, preset  # noqa: E402
from ringmoe.parallel import RingStats, make_mesh, shard  # noqa: E402
from ringmoe.parallel.launch import spawn  # noqa: E402
from ringmoe.parallel.ulysses import usp_attn_func  # noqa: E402
from ringmoe.sim.calibrate import calibrate_this_machine  # noqa: E402
from ringmoe.sim.hardware import PROFILES  # noqa: E402
from ringmoe.sim.sequence_parallel import choose_sequence_parallel, sp_cost  # noqa: E402

H, HKV, D = 8, 2, 64
CPU_SHAPE = ModelConfig(num_heads=H, num_kv_heads=HKV, head_dim=D, hidden_size=H * D, num_layers=1,
                        num_experts=2, top_k=1, ffn_size=64, vocab_size=64)


def inputs(n):
    gen = torch.Generator().manual_seed(n)
    q = torch.randn(1, n, H, D, generator=gen)
    k, v = (torch.randn(1, n, HKV, D, generator=gen) for _ in range(2))
    return q, k, v, torch.randn(1, n, H, D, generator=gen)


def sp_rank(rank, world, n, ulysses, repeats):
    mesh = make_mesh(cp=world, ulysses=ulysses)
    q, k, v, dout = (shard(x, world, rank, "zigzag") for x in inputs(n))
    result = {}
    for backward in (False, True):
        leaves = [x.clone().requires_grad_(backward) for x in (q, k, v)]
        times, stats = [], None
        for i in range(repeats + 1):
            stats = RingStats()
            dist.barrier()
            start = time.perf_counter()
            out = usp_attn_func(*leaves, mesh.ulysses_group, mesh.ring_group, causal=True, layout="zigzag",
                                stats=stats)
            if backward:
                out.backward(dout)
            dist.barrier()
            if i:
                times.append(time.perf_counter() - start)
        key = "fwd_bwd_s" if backward else "fwd_s"
        result[key] = statistics.median(times)
        if not backward:
            result["bytes_sent_fwd"] = stats.totals("forward")["bytes_sent"]
            result["all_to_all_s"] = sum(s["wait_s"] for s in stats.forward if s["step"] == "all_to_all")
    return result


def single_process(n, repeats):
    q, k, v, dout = inputs(n)
    fwd = median_time(lambda: flash_attn_func(q, k, v, causal=True), repeats)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]

    def both():
        flash_attn_func(*leaves, causal=True).backward(dout)
    return {"fwd_s": fwd, "fwd_bwd_s": median_time(both, repeats)}


def measured(n, repeats):
    # this machine's rates measured in the same run (2 ranks x 1 thread, as the ranks below), so the predictions
    # see today's machine; with more ranks than cores each rank gets cores / ranks of its rate
    profile = calibrate_this_machine()
    cores = len(os.sched_getaffinity(0))
    rows = [{"cp": 1, "ulysses": 1, "ring": 1, "mode": "one process", **single_process(n, repeats)}]
    for cp in (2, 4):
        for u in (1, 2, 4):
            if cp % u:
                continue
            mode = "ring" if u == 1 else ("ulysses" if u == cp else "usp")
            got = spawn(sp_rank, cp, n, u, repeats, timeout=1800)
            row = {"cp": cp, "ulysses": u, "ring": cp // u, "mode": mode,
                   "fwd_s": max(r["fwd_s"] for r in got), "fwd_bwd_s": max(r["fwd_bwd_s"] for r in got),
                   "bytes_sent_fwd": max(r["bytes_sent_fwd"] for r in got),
                   "all_to_all_s": max(r["all_to_all_s"] for r in got)}
            shared = dataclasses.replace(profile, attention_flops=profile.attention_flops * min(1.0, cores / cp))
            row["predicted_fwd_s"] = sp_cost(CPU_SHAPE, shared, n, cp, u, element_bytes=4).seconds
            rows.append(row)
            print(f"cp={cp} {mode:8s} U={u} R={cp // u}: fwd {row['fwd_s']:.3f} s  fwd+bwd {row['fwd_bwd_s']:.3f} s  "
                  f"sent {row['bytes_sent_fwd'] / 2**20:.1f} MiB  predicted {row['predicted_fwd_s']:.3f} s")
    return rows, dataclasses.asdict(profile)


GQA = ModelConfig(num_heads=32, num_kv_heads=8, head_dim=128, hidden_size=4096, num_layers=1, num_experts=8,
                  top_k=2, ffn_size=1024, vocab_size=1024)


def predicted():
    models = {"gqa-32x8": GQA, "deepseek-v3": preset("deepseek-v3")}
    rows = []
    for hw_name in ("h100", "h200"):
        hw = PROFILES[hw_name]
        for name, config in models.items():
            for gpus in (8, 16, 32, 64):
                for seqlen in (131072, 262144, 524288, 1048576):
                    best, costs, reason = choose_sequence_parallel(config, hw, seqlen, gpus)
                    by_u = {c.ulysses: c for c in costs}
                    widest = max(by_u)
                    rows.append({"hw": hw_name, "model": name, "gpus": gpus, "seqlen": seqlen,
                                 "best_ulysses": best.ulysses, "best_ring": best.ring, "best_s": best.seconds,
                                 "ring_s": by_u[1].seconds, "widest_ulysses": widest,
                                 "widest_ulysses_s": by_u[widest].seconds, "reason": reason})
    return rows


def plot(data, path):
    plt = pyplot()
    cpu, model, seqlen = data
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    labels = [f"{r['mode']}\n{r['ulysses']}x{r['ring']}" if r["cp"] > 1 else "1 process" for r in cpu]
    xs = range(len(cpu))
    left.bar([x - 0.2 for x in xs], [r["fwd_s"] for r in cpu], 0.4, label="forward")
    left.bar([x + 0.2 for x in xs], [r["fwd_bwd_s"] for r in cpu], 0.4, label="forward + backward")
    left.set_xticks(list(xs), labels, fontsize=8)
    left.set_ylabel("seconds (median, slowest rank)")
    left.set_title(f"this CPU: cp = 2 and 4 local ranks, N = {seqlen}")
    left.legend()
    for seqlen, style in ((131072, "-"), (1048576, "--")):  # h200 = h100 here: same compute and links
        for name, color in (("gqa-32x8", "C0"), ("deepseek-v3", "C1")):
            rows = [r for r in model if r["hw"] == "h100" and r["model"] == name and r["seqlen"] == seqlen]
            right.plot([r["gpus"] for r in rows], [r["ring_s"] / r["best_s"] for r in rows], style, color=color,
                       marker="o", label=f"{name}, {seqlen // 1024}K tokens")
            for r in rows:
                right.annotate(f"{r['best_ulysses']}x{r['best_ring']}", (r["gpus"], r["ring_s"] / r["best_s"]),
                               fontsize=7, color=color)
    right.set_xscale("log", base=2)
    right.set_xlabel("H100s (8 per node)")
    right.set_ylabel("pure ring time / chosen U x R time")
    right.set_title("cost model: the chosen factorization (U x R)")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--plot-only", action="store_true", help="redraw sp.png from sp.json")
    args = parser.parse_args()
    if args.plot_only:
        import json

        from common import RESULTS

        saved = json.loads((RESULTS / "sp.json").read_text())
        plot((saved["cpu"]["rows"], saved["cost_model"], saved["cpu"]["seqlen"]), RESULTS / "sp.png")
        return
    cpu, profile = measured(args.seqlen, args.repeats)
    model = predicted()
    for r in model:
        if r["seqlen"] in (131072, 1048576):
            print(f"{r['hw']} {r['model']:12s} {r['gpus']:3d} GPUs {r['seqlen'] // 1024:5d}K: "
                  f"U x R = {r['best_ulysses']} x {r['best_ring']}  ring/chosen {r['ring_s'] / r['best_s']:.2f}  "
                  f"widest-Ulysses/chosen {r['widest_ulysses_s'] / r['best_s']:.2f}")
    write_results("sp", {"cpu": {"seqlen": args.seqlen, "heads": H, "kv_heads": HKV, "head_dim": D,
                                 "dtype": "float32", "layout": "zigzag", "threads_per_rank": 1,
                                 "profile_calibrated_in_this_run": profile, "rows": cpu},
                         "cost_model": model}, plot, (cpu, model, args.seqlen))


if __name__ == "__main__":
    main()
