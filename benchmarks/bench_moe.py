"""MoELayer vs transformers' MixtralSparseMoeBlock with the same weights, on this CPU.

T=4096 tokens, hidden 512, ffn 1024, top-2, float32; E in (8, 32, 64);
forward and forward+backward tokens/s, median of repeats; also the capacity
(padded, c=1.25) mode.  Writes benchmarks/results/moe.json and moe.png.

    python benchmarks/bench_moe.py [--experts 8 32 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median_time, pyplot, write_results  # noqa: E402

from ringmoe.moe import MoELayer  # noqa: E402

T, HIDDEN, FFN, TOP_K = 4096, 512, 1024, 2
logging.getLogger("transformers").setLevel(logging.ERROR)


def hf_block(num_experts):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(hidden_size=HIDDEN, intermediate_size=FFN, num_local_experts=num_experts,
                        num_experts_per_tok=TOP_K)
    block = MixtralSparseMoeBlock(cfg)
    gen = torch.Generator().manual_seed(num_experts)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return block


def timed(module, x, backward, repeats):
    x = x.clone().requires_grad_(backward)

    def call():
        y = module(x)
        if backward:
            y.sum().backward()

    return median_time(call, repeats=repeats)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for num_experts in args.experts:
        block = hf_block(num_experts)
        ours = MoELayer.from_hf(block)
        capped = MoELayer.from_hf(block, capacity_factor=1.25)
        x = torch.randn(1, T, HIDDEN, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            err = (ours(x) - block(x)).abs().max().item()
        for backward in (False, True):
            mode = "fwd+bwd" if backward else "fwd"
            times = {name: timed(m, x, backward, args.repeats)
                     for name, m in (("transformers_mixtral", block), ("ringmoe_dropless", ours),
                                     ("ringmoe_capacity_1.25", capped))}
            for name, seconds in times.items():
                rows.append(dict(impl=name, experts=num_experts, mode=mode, seconds=seconds, tokens_per_s=T / seconds,
                                 speedup_vs_transformers=times["transformers_mixtral"] / seconds,
                                 max_abs_diff_vs_transformers=err if name == "ringmoe_dropless" else None))
                print(f"E={num_experts:3d} {mode:7s} {name:22s} {T / seconds:10.0f} tokens/s  "
                      f"x{times['transformers_mixtral'] / seconds:.2f} vs transformers", flush=True)
        print(f"E={num_experts}: max |ringmoe - transformers| = {err:.2e}; dropped at c=1.25: "
              f"{capped.last_stats.dropped_assignments} assignments", flush=True)
    write_results("moe", {"config": dict(T=T, hidden=HIDDEN, ffn=FFN, top_k=TOP_K, dtype="float32"),
                                 "rows": rows}, plot, rows)


def plot(rows, path):
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, mode in zip(axes, ("fwd", "fwd+bwd")):
        for impl, color in (("transformers_mixtral", "C1"), ("ringmoe_dropless", "C0"), ("ringmoe_capacity_1.25", "C2")):
            pts = sorted((r["experts"], r["tokens_per_s"]) for r in rows if r["impl"] == impl and r["mode"] == mode)
            ax.plot(*zip(*pts), marker="o", color=color, label=impl)
        ax.set(title=f"MoE {mode}, T={T}, H={HIDDEN}, F={FFN}, top-{TOP_K}", xlabel="experts", ylabel="tokens/s",
               xscale="log")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
