"""Blockwise FlashAttention vs torch SDPA vs naive attention on this CPU.

B=1, H=8, D=64, float32, N = 1024 .. 16384, causal and not; forward and
forward+backward; median wall time and peak extra resident memory of each.
Writes benchmarks/results/attention.json and attention.png.

    python benchmarks/bench_attention.py [--max-n 16384] [--repeats 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import measure_in_subprocess, median_time, peak_rss_bytes, pyplot, reset_peak_rss, rss_bytes, write_results  # noqa: E402

from ringmoe import flash_attn_func  # noqa: E402

B, H, D = 1, 8, 64


def naive(q, k, v, causal):
    """Materialised softmax(q k^T / sqrt(d)) v in (B, H, N, D) layout."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * D**-0.5
    if causal:
        n = q.shape[-2]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def implementations():
    """name -> (layout, fn(q, k, v, causal)); 'bshd' is flash-attn's layout, 'bhsd' torch's."""
    return {
        "ringmoe_blockwise": ("bshd", lambda q, k, v, c: flash_attn_func(q, k, v, causal=c, backend="blockwise")),
        "torch_sdpa": ("bhsd", lambda q, k, v, c: F.scaled_dot_product_attention(q, k, v, is_causal=c)),
        "naive": ("bhsd", naive),
    }


def make_inputs(layout, n, backward):
    gen = torch.Generator().manual_seed(n)
    shape = (B, n, H, D) if layout == "bshd" else (B, H, n, D)
    q, k, v = (torch.randn(*shape, generator=gen).requires_grad_(backward) for _ in range(3))
    return q, k, v, torch.randn(*shape, generator=gen)


def make_call(name, n, causal, backward):
    layout, fn = implementations()[name]
    q, k, v, dout = make_inputs(layout, n, backward)

    def call():
        out = fn(q, k, v, causal)
        if backward:
            out.backward(dout)
            for x in (q, k, v):
                x.grad = None

    return call


def probe(name, n, causal, backward):
    """In a fresh process: peak resident memory of one call above the level after making inputs."""
    call = make_call(name, n, causal, backward)
    reset_peak_rss()
    base = rss_bytes()
    call()
    print(json.dumps({"peak_extra_bytes": max(0, peak_rss_bytes() - base)}))


def run_one(name, n, causal, backward, repeats):
    seconds = median_time(make_call(name, n, causal, backward), repeats=repeats)
    gc.collect()
    memory = measure_in_subprocess("bench_attention", name, str(n), str(int(causal)), str(int(backward)))
    return seconds, memory["peak_extra_bytes"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-n", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--naive-max-n", type=int, default=8192, help="naive attention needs N^2 memory")
    parser.add_argument("--probe", nargs=4, metavar=("IMPL", "N", "CAUSAL", "BACKWARD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        name, n, causal, backward = args.probe
        probe(name, int(n), bool(int(causal)), bool(int(backward)))
        return
    sizes = [n for n in (1024, 2048, 4096, 8192, 16384) if n <= args.max_n]
    rows = []
    for causal in (False, True):
        for backward in (False, True):
            for n in sizes:
                for name in implementations():
                    if name == "naive" and n > args.naive_max_n:
                        continue
                    seconds, memory = run_one(name, n, causal, backward, args.repeats if n < 16384 else 1)
                    flops = 4 * B * H * n * n * D * (0.5 if causal else 1.0) * (3.5 if backward else 1.0)
                    row = dict(impl=name, n=n, causal=causal, backward=backward, seconds=seconds,
                               gflops=flops / seconds / 1e9, peak_extra_mib=memory / 2**20)
                    rows.append(row)
                    print(f"{name:18s} N={n:6d} causal={causal!s:5s} bwd={backward!s:5s} "
                          f"{seconds * 1e3:9.1f} ms {row['gflops']:6.1f} GFLOP/s {row['peak_extra_mib']:9.1f} MiB", flush=True)
    summary = summarize(rows)
    for line in summary["lines"]:
        print(line)
    write_results("attention", {"config": dict(B=B, H=H, D=D, dtype="float32"), "rows": rows, "summary": summary}, plot, rows)


def _get(rows, impl, n, causal, backward, key):
    for r in rows:
        if (r["impl"], r["n"], r["causal"], r["backward"]) == (impl, n, causal, backward):
            return r[key]
    return None


def summarize(rows):
    """Ratios blockwise / SDPA per config, and memory vs naive at the largest N naive ran."""
    out = {"time_ratio_vs_sdpa": {}, "memory_ratio_vs_naive": {}, "lines": []}
    for r in rows:
        if r["impl"] != "ringmoe_blockwise":
            continue
        key = f"N={r['n']},causal={r['causal']},{'fwd+bwd' if r['backward'] else 'fwd'}"
        sdpa = _get(rows, "torch_sdpa", r["n"], r["causal"], r["backward"], "seconds")
        out["time_ratio_vs_sdpa"][key] = round(r["seconds"] / sdpa, 3)
        naive_mem = _get(rows, "naive", r["n"], r["causal"], r["backward"], "peak_extra_mib")
        if naive_mem:
            out["memory_ratio_vs_naive"][key] = round(r["peak_extra_mib"] / naive_mem, 4)
    for key, ratio in out["time_ratio_vs_sdpa"].items():
        mem = out["memory_ratio_vs_naive"].get(key)
        out["lines"].append(f"blockwise/SDPA time {ratio:5.2f}x  {key}" + (f"  memory vs naive {mem:.3f}" if mem else ""))
    return out


def plot(rows, path):
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    styles = {"ringmoe_blockwise": "C0", "torch_sdpa": "C1", "naive": "C2"}
    for col, backward in enumerate((False, True)):
        for impl, color in styles.items():
            for causal, dash in ((False, "-"), (True, "--")):
                pts = sorted((r["n"], r["seconds"], r["peak_extra_mib"]) for r in rows
                             if r["impl"] == impl and r["causal"] == causal and r["backward"] == backward)
                if not pts:
                    continue
                ns, secs, mems = zip(*pts)
                label = f"{impl} {'causal' if causal else 'full'}"
                axes[0, col].plot(ns, secs, dash, color=color, marker="o", label=label)
                axes[1, col].plot(ns, mems, dash, color=color, marker="o", label=label)
        title = "forward + backward" if backward else "forward"
        axes[0, col].set(title=f"time, {title}", xscale="log", yscale="log", xlabel="N", ylabel="seconds")
        axes[1, col].set(title=f"peak extra memory, {title}", xscale="log", yscale="log", xlabel="N", ylabel="MiB")
        axes[0, col].legend(fontsize=7)
    fig.suptitle(f"attention on CPU, B={B} H={H} D={D} fp32, {torch.get_num_threads()} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
