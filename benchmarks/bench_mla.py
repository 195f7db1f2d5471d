"""Multi-head latent attention: bytes, the latent ring vs the expanded ring, and decoding vs transformers.

1. Bytes per cached token and per ring step, latent vs expanded, for DeepSeek-V3 (128 heads) and the
   deepseek-v2-lite preset (16 heads): the latent is kv_lora_rank + rope numbers per token and layer;
   expanded K/V are heads x (nope + rope + v).
2. One MLA layer's attention at cp=2 (2 ranks x 1 thread), deepseek-v2-lite's attention shapes (16 heads,
   nope 128, rope 64, v 128, rank 512), float32, causal, zigzag, N tokens: the ring carrying latents
   (every rank expands every block it receives) vs the ring carrying expanded K/V (each rank expands its
   own block once, then K and V travel).  Forward and forward + backward seconds (median of 3) and the
   bytes each sends.
3. Decoding: a random deepseek-v3-tiny-shaped checkpoint scaled to the small preset's size (4 layers,
   hidden 256), written by save_pretrained; 8 prompts of 256 tokens, 64 greedy tokens: ringmoe's engine
   (latent cache, absorbed attention) vs transformers' DeepseekV3ForCausalLM ``generate`` (eager),
   tokens/s, peak RSS and whether the greedy tokens agree.
Writes benchmarks/results/mla.json and mla.png.

    python benchmarks/bench_mla.py [--seqlen 4096]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_families import _requests, ringmoe_rank, save, transformers_rank  # noqa: E402
from common import pyplot, write_results  # noqa: E402

from ringmoe.model import preset  # noqa: E402
from ringmoe.parallel.launch import spawn  # noqa: E402

HEADS, NOPE, ROPE, V, RANK = 16, 128, 64, 128, 512


def bytes_per_token(heads, nope, rope, v, rank, element=2):
    return {"latent": (rank + rope) * element, "expanded": heads * (nope + rope + v) * element}


def ring_rank(rank, world, seqlen, mode):
    from ringmoe.parallel import RingStats, ring_flash_attn_func, shard
    from ringmoe.parallel.ring_mla import LatentBlocks, ring_mla_attn_func

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, seqlen, HEADS, NOPE + ROPE, generator=gen)
    latent = torch.randn(1, seqlen, RANK, generator=gen)
    k_rope = torch.randn(1, seqlen, ROPE, generator=gen)
    w = torch.randn(HEADS * (NOPE + V), RANK, generator=gen) * RANK**-0.5
    mine = [shard(x, world, rank, "zigzag").requires_grad_() for x in (q, latent, k_rope)]
    weight = w.clone().requires_grad_()

    def run():
        stats = RingStats()
        if mode == "latent":
            out = ring_mla_attn_func(*mine, weight, V, stats=stats)
        else:
            k, v = LatentBlocks(weight, HEADS, NOPE, V).unpack(torch.cat(mine[1:], dim=-1))
            out = ring_flash_attn_func(mine[0], k, v, stats=stats)[..., :V]
        return out, stats

    forward, both, stats = [], [], None
    for _ in range(3):
        start = time.perf_counter()
        with torch.no_grad():
            run()
        forward.append(time.perf_counter() - start)
        start = time.perf_counter()
        out, stats = run()
        out.sum().backward()
        both.append(time.perf_counter() - start)
    return {"forward_s": statistics.median(forward), "fwd_bwd_s": statistics.median(both),
            "forward_bytes": stats.totals("forward")["bytes_sent"], "backward_bytes": stats.totals("backward")["bytes_sent"]}


def plot(data, path):
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    modes = ["latent", "expanded"]
    x = range(2)
    left.bar([i - 0.2 for i in x], [data["ring"][m]["forward_s"] for m in modes], 0.4, label="forward")
    left.bar([i + 0.2 for i in x], [data["ring"][m]["fwd_bwd_s"] for m in modes], 0.4, label="forward + backward")
    left.set_xticks(list(x), [f"{m}\n{data['ring'][m]['forward_bytes'] / 2**20:.1f} MiB sent (fwd)" for m in modes])
    left.set_ylabel(f"seconds, N={data['seqlen']}, cp=2")
    left.legend()
    decode = data["decode"]
    right.bar(["ringmoe (latent cache)", "transformers"], [decode["ringmoe"]["tokens_per_s"],
                                                           decode["transformers"]["tokens_per_s"]])
    right.set_ylabel("decode output tokens/s (8 x 64)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--new", type=int, default=64)
    args = parser.parse_args()
    sizes = {"deepseek-v3": bytes_per_token(128, 128, 64, 128, 512),
             "deepseek-v2-lite": bytes_per_token(HEADS, NOPE, ROPE, V, RANK)}
    for row in sizes.values():
        row["ratio"] = row["expanded"] / row["latent"]
    print(sizes, flush=True)
    ring = {}
    for mode in ("latent", "expanded"):
        result = spawn(ring_rank, 2, args.seqlen, mode, threads_per_rank=1, timeout=1800)
        ring[mode] = {"forward_s": max(r["forward_s"] for r in result), "fwd_bwd_s": max(r["fwd_bwd_s"] for r in result),
                      "forward_bytes": sum(r["forward_bytes"] for r in result),
                      "backward_bytes": sum(r["backward_bytes"] for r in result)}
        print(mode, ring[mode], flush=True)
    config = preset("deepseek-v3-tiny").replace(vocab_size=4096, hidden_size=256, num_layers=4, num_heads=8,
                                                num_kv_heads=8, head_dim=48, qk_nope_head_dim=32, qk_rope_head_dim=16,
                                                v_head_dim=32, kv_lora_rank=128, q_lora_rank=192, ffn_size=256,
                                                shared_ffn_size=256, dense_ffn_size=1024)
    with tempfile.TemporaryDirectory() as tmp:
        spawn(save, 1, config, tmp)
        requests = _requests(config.vocab_size, 8, 256)
        ours = spawn(ringmoe_rank, 1, tmp, requests, args.new, threads_per_rank=2, timeout=1800)[0]
        theirs = spawn(transformers_rank, 1, tmp, requests, args.new, "eager", threads_per_rank=2, timeout=1800)[0]
    same = sum(a == b for a, b in zip(ours.pop("tokens"), theirs.pop("tokens")))
    for run in (ours, theirs):
        run["tokens_per_s"] = run["output_tokens"] / run["seconds"]
    decode = {"ringmoe": ours, "transformers": theirs, "speedup": ours["tokens_per_s"] / theirs["tokens_per_s"],
              "identical_requests": same}
    print(decode, flush=True)
    summary = {"cache_bytes_ratio": {k: v["ratio"] for k, v in sizes.items()},
               "ring_bytes_ratio": ring["expanded"]["forward_bytes"] / max(1, ring["latent"]["forward_bytes"]),
               "ring_latent_vs_expanded_time": {p: ring["latent"][p] / ring["expanded"][p] for p in ("forward_s", "fwd_bwd_s")},
               "decode_speedup": decode["speedup"]}
    write_results("mla", {"seqlen": args.seqlen, "bytes_per_token": sizes, "ring": ring, "decode": decode,
                          "summary": summary}, plot, {"ring": ring, "decode": decode, "seqlen": args.seqlen})
    print(summary)


if __name__ == "__main__":
    main()
