"""Ring attention on 2 local ranks (one thread each) vs single-process attention on 2 threads.

N = 8192 and 16384, H=8, D=64, float32, causal, forward and forward+backward,
every layout.  Reports wall time, per-rank work imbalance (max/mean compute),
the exposed communication fraction, and tries torch's own context parallel
(torch.distributed.tensor.experimental.context_parallel) in the same run.
Writes benchmarks/results/ring.json and ring.png.

    python benchmarks/bench_ring.py [--sizes 8192 16384] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median_time, pyplot, write_results  # noqa: E402

from ringmoe import flash_attn_func  # noqa: E402
from ringmoe.parallel import LAYOUTS, RingStats, ring_flash_attn_func, shard  # noqa: E402
from ringmoe.parallel.launch import spawn  # noqa: E402

B, H, D = 1, 8, 64
WORLD = 2


def full_inputs(n):
    gen = torch.Generator().manual_seed(n)
    return [torch.randn(B, n, H, D, generator=gen) for _ in range(4)]


def ring_rank(rank, world, n, layout, backward, repeats):
    q, k, v, dout = (shard(x, world, rank, layout) for x in full_inputs(n))
    leaves = [x.requires_grad_(backward) for x in (q, k, v)]
    dout = shard(full_inputs(n)[3], world, rank, layout)
    times, last = [], None
    for i in range(repeats + 1):
        stats = RingStats()
        dist.barrier()
        start = time.perf_counter()
        out = ring_flash_attn_func(*leaves, causal=True, layout=layout, stats=stats)
        if backward:
            out.backward(dout)
        dist.barrier()
        if i:
            times.append(time.perf_counter() - start)
        last = stats
    phases = ["forward", "backward"] if backward else ["forward"]
    compute = sum(last.totals(p)["compute_s"] for p in phases)
    wait = sum(last.totals(p)["wait_s"] for p in phases)
    return {
        "seconds": statistics.median(times),
        "compute_s": compute,
        "wait_s": wait,
        "bytes_sent": sum(last.totals(p)["bytes_sent"] for p in phases),
        "steps": {p: getattr(last, p) for p in phases},
    }


def torch_cp_rank(rank, world, n, backward, repeats):
    """torch's context parallel on the same ranks; returns seconds or the reason it cannot run."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        mesh = init_device_mesh("cpu", (world,))
        q, k, v, dout = (x.transpose(1, 2).contiguous() for x in full_inputs(n))
        times = []
        for i in range(repeats + 1):
            qc, kc, vc, dc = (x.clone() for x in (q, k, v, dout))
            start = time.perf_counter()
            with context_parallel(mesh, buffers=[qc, kc, vc, dc], buffer_seq_dims=[2, 2, 2, 2]):
                for x in (qc, kc, vc):
                    x.requires_grad_(backward)
                out = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True)
                if backward:
                    out.backward(dc)
            if i:
                times.append(time.perf_counter() - start)
        return {"seconds": statistics.median(times)}
    except Exception as exc:  # report why the peer cannot run here
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def single_process(n, backward, repeats):
    q, k, v, dout = full_inputs(n)
    leaves = [x.requires_grad_(backward) for x in (q, k, v)]

    def call():
        out = flash_attn_func(*leaves, causal=True)
        if backward:
            out.backward(dout)

    return median_time(call, repeats=repeats)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(WORLD)
    rows = []
    for n in args.sizes:
        for backward in (False, True):
            mode = "fwd+bwd" if backward else "fwd"
            base = single_process(n, backward, args.repeats)
            rows.append(dict(impl="single_process_2_threads", n=n, mode=mode, seconds=base))
            print(f"N={n} {mode:7s} single process, 2 threads: {base * 1e3:8.1f} ms", flush=True)
            cp = spawn(torch_cp_rank, WORLD, n, backward, args.repeats, timeout=900)
            rows.append(dict(impl="torch_context_parallel", n=n, mode=mode, **cp[0]))
            print(f"N={n} {mode:7s} torch context_parallel: {cp[0]}", flush=True)
            for layout in LAYOUTS:
                per_rank = spawn(ring_rank, WORLD, n, layout, backward, args.repeats, timeout=900)
                computes = [r["compute_s"] for r in per_rank]
                row = dict(
                    impl=f"ring_{layout}", n=n, mode=mode,
                    seconds=max(r["seconds"] for r in per_rank),
                    imbalance=max(computes) / statistics.mean(computes),
                    exposed_comm_fraction=statistics.mean(
                        r["wait_s"] / (r["compute_s"] + r["wait_s"]) for r in per_rank),
                    speedup_vs_single=base / max(r["seconds"] for r in per_rank),
                    per_rank=per_rank,
                )
                rows.append(row)
                print(f"N={n} {mode:7s} ring {layout:10s}: {row['seconds'] * 1e3:8.1f} ms  "
                      f"imbalance {row['imbalance']:.3f}  exposed comm {row['exposed_comm_fraction']:.1%}  "
                      f"speedup vs 1 process {row['speedup_vs_single']:.2f}x", flush=True)
    write_results("ring", {"config": dict(B=B, H=H, D=D, world_size=WORLD, dtype="float32", causal=True),
                                   "rows": rows}, plot, rows)


def plot(rows, path):
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    n = max(r["n"] for r in rows)
    zig = next(r for r in rows if r["impl"] == "ring_zigzag" and r["n"] == n and r["mode"] == "fwd+bwd")
    ax = axes[0]
    for rank, data in enumerate(zig["per_rank"]):
        t = 0.0
        for phase in ("forward", "backward"):
            for step in data["steps"].get(phase, []):
                ax.barh(rank, step["compute_s"], left=t, color="C0" if phase == "forward" else "C2", edgecolor="k")
                t += step["compute_s"]
                ax.barh(rank, step["wait_s"], left=t, color="C3", edgecolor="k")
                t += step["wait_s"]
    ax.set(title=f"zigzag ring, N={n}, fwd (blue) + bwd (green) steps, waits red", xlabel="seconds",
           yticks=range(WORLD), ylabel="rank")
    ax = axes[1]
    labels, ratios = [], []
    for layout in LAYOUTS:
        r = next(r for r in rows if r["impl"] == f"ring_{layout}" and r["n"] == n and r["mode"] == "fwd")
        labels.append(layout)
        ratios.append(r["imbalance"])
    ax.bar(labels, ratios, color=["C1", "C0", "C2"])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set(title=f"causal work imbalance (max/mean compute), N={n}, {WORLD} ranks", ylim=(0.9, max(ratios) + 0.1))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
