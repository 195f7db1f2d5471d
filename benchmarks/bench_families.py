"""Sliding windows in the ring, and decoding per model family against transformers.

Part 1 (ring): causal attention over N tokens on cp=2 ranks (1 thread each), float32, 4 heads (2 K/V heads)
of 64: a 128-token window vs full attention, under the contiguous and the zigzag layouts, and contiguous at
cp=4 (4 ranks on the 2 cores: the bytes are the point there).  Reported per
rank: forward seconds (median of 3), query-key pairs the ring's blocks compute (from the ring's plan),
ring steps and bytes sent.  The window skips every block it does not reach; under the contiguous layout
the ring also stops after the one neighbour it needs.

Part 2 (decode): one random checkpoint per family at the small preset's shapes (4 layers, hidden 256,
8 experts top-2, vocab 4096), written by ringmoe's save_pretrained in transformers' format: gpt-oss
(sinks, 128-token windows on alternate layers, biases, clamped SwiGLU, YaRN), Qwen2-MoE (gated shared
expert, a dense layer), OLMoE (whole-projection qk-norm), Qwen3-MoE with a dense layer, Mixtral.  8 prompts
of 256 tokens, 64 greedy new tokens each: ringmoe's Engine vs transformers' ``generate`` (SDPA where the
family supports it, else eager), each in its own process with 2 threads: output tokens/s and peak RSS,
and whether the greedy tokens agree.  Writes benchmarks/results/families.json and families.png.

    python benchmarks/bench_families.py [--seqlen 16384] [--window 128]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import peak_rss_bytes, pyplot, write_results  # noqa: E402

from ringmoe.model import MoETransformer, preset, save_pretrained  # noqa: E402
from ringmoe.parallel.launch import spawn  # noqa: E402

SHAPES = dict(vocab_size=4096, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=32,
              ffn_size=512, num_experts=8, top_k=2)
FAMILIES = {
    "gpt-oss": preset("gpt-oss-tiny").replace(**SHAPES, sliding_window=128, layer_types=(
        "sliding_attention", "full_attention") * 2),
    "qwen2-moe": preset("qwen2-moe-tiny").replace(**SHAPES, shared_ffn_size=512, dense_layers=(3,),
                                                  dense_ffn_size=1024),
    "olmoe": preset("olmoe-tiny").replace(**SHAPES),
    "qwen3-moe-dense": preset("qwen3-moe-dense-tiny").replace(**SHAPES, dense_ffn_size=1024),
    "mixtral": preset("small"),
}


# -- part 1: the ring with a window ------------------------------------------------------------------------
def ring_rank(rank, world, seqlen, window, layout):
    from ringmoe.parallel import RingStats, ring_flash_attn_func, shard
    from ringmoe.parallel.ring import dense_plan

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, seqlen, 4, 64, generator=gen)
    k, v = torch.randn(1, seqlen, 2, 64, generator=gen), torch.randn(1, seqlen, 2, 64, generator=gen)
    local = [shard(x, world, rank, layout) for x in (q, k, v)]
    size = (window, 0) if window else (-1, -1)
    times, stats = [], None
    for _ in range(3):
        stats = RingStats()
        start = time.perf_counter()
        ring_flash_attn_func(*local, causal=True, layout=layout, window_size=size, stats=stats)
        times.append(time.perf_counter() - start)
    plan = dense_plan(seqlen // world, world, layout, True, size)
    pairs = 0
    for step in range(plan.steps):
        for task in plan.tasks(rank, (rank - step) % world):
            rows, keys = task.q1 - task.q0, task.k1 - task.k0
            for i in range(rows):  # visible keys of row i: [i + lo, i + hi] within [0, keys)
                lo = 0 if task.lo is None else max(0, i + task.lo)
                hi = keys - 1 if task.hi is None else min(keys - 1, i + task.hi)
                pairs += max(0, hi - lo + 1)
    return {"seconds": statistics.median(times), "pairs": pairs, "steps": len(stats.forward),
            "bytes_sent": stats.totals()["bytes_sent"]}


# -- part 2: decoding per family ---------------------------------------------------------------------------
def _requests(vocab, count, length):
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (length,), generator=gen).tolist() for _ in range(count)]


def ringmoe_rank(rank, world, path, requests, new):
    from ringmoe.model import load_checkpoint
    from ringmoe.serve import Engine, SamplingParams

    engine = Engine(load_checkpoint(path), kv_cache_tokens=len(requests) * (len(requests[0]) + new) + 512,
                    max_num_seqs=len(requests), max_num_batched_tokens=4096)
    engine.generate([requests[0][:16]], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    start = time.perf_counter()
    outs = engine.generate(requests, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "output_tokens": sum(len(o.output_ids) for o in outs),
            "peak_rss_mib": peak_rss_bytes() / 2**20, "tokens": [o.output_ids for o in outs]}


def transformers_rank(rank, world, path, requests, new, attention):
    import transformers

    logging.getLogger("transformers").setLevel(logging.ERROR)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation=attention).eval()
    ids = torch.tensor(requests)
    with torch.no_grad():
        model.generate(ids[:1, :16], max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
        seconds = time.perf_counter() - start
    tokens = out[:, ids.shape[1]:].tolist()
    return {"seconds": seconds, "output_tokens": sum(len(t) for t in tokens), "peak_rss_mib": peak_rss_bytes() / 2**20,
            "tokens": tokens}


def save(rank, world, config, folder):
    model = MoETransformer(config)
    model.init_weights(0, std=0.05)
    save_pretrained(model, folder)


def plot(data, path):
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(data["decode"])
    x = range(len(names))
    left.bar([i - 0.2 for i in x], [data["decode"][n]["ringmoe"]["tokens_per_s"] for n in names], 0.4, label="ringmoe")
    left.bar([i + 0.2 for i in x], [data["decode"][n]["transformers"]["tokens_per_s"] for n in names], 0.4,
             label="transformers generate")
    left.set_xticks(list(x), names, rotation=20)
    left.set_ylabel("output tokens/s (8 x 64 new, 2 threads)")
    left.legend()
    rows = data["ring"]
    labels = [f"{r['layout']} cp={r['cp']}\n{'window ' + str(r['window']) if r['window'] else 'full'}" for r in rows]
    right.bar(labels, [r["seconds"] for r in rows])
    right.set_ylabel(f"ring forward seconds, N={data['seqlen']}")
    right.tick_params(axis="x", labelsize=7, rotation=30)
    for i, r in enumerate(rows):
        right.text(i, r["seconds"], f"{r['bytes_sent'] / 2**20:.1f} MiB sent", ha="center", va="bottom", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    args = parser.parse_args()
    ring = []
    for layout, cp in (("contiguous", 2), ("zigzag", 2), ("contiguous", 4)):
        for window in (None, args.window):
            result = spawn(ring_rank, cp, args.seqlen, window, layout, threads_per_rank=max(1, 2 // cp), timeout=1800)
            row = {"layout": layout, "cp": cp, "window": window, "seconds": max(r["seconds"] for r in result),
                   "pairs_per_rank": [r["pairs"] for r in result], "steps": result[0]["steps"],
                   "bytes_sent": sum(r["bytes_sent"] for r in result)}
            ring.append(row)
            print(row, flush=True)
    decode = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in FAMILIES.items():
            folder = str(Path(tmp) / name)
            spawn(save, 1, config, folder)
            requests = _requests(config.vocab_size, 8, 256)
            ours = spawn(ringmoe_rank, 1, folder, requests, args.new, threads_per_rank=2, timeout=1800)[0]
            attention = "eager" if name == "gpt-oss" else "sdpa"
            theirs = spawn(transformers_rank, 1, folder, requests, args.new, attention, threads_per_rank=2,
                           timeout=1800)[0]
            same = sum(a == b for a, b in zip(ours.pop("tokens"), theirs.pop("tokens")))
            for run in (ours, theirs):
                run["tokens_per_s"] = run["output_tokens"] / run["seconds"]
            decode[name] = {"ringmoe": ours, "transformers": theirs, "attention": attention,
                            "speedup": ours["tokens_per_s"] / theirs["tokens_per_s"], "identical_requests": same}
            print(name, decode[name], flush=True)
    summary = {
        "ring_window_speedup": {f"{r['layout']} cp={r['cp']}": full["seconds"] / r["seconds"]
                                for full, r in zip(ring[::2], ring[1::2])},
        "ring_window_bytes_ratio": {f"{r['layout']} cp={r['cp']}": r["bytes_sent"] / full["bytes_sent"]
                                    for full, r in zip(ring[::2], ring[1::2])},
        "decode_speedup": {name: d["speedup"] for name, d in decode.items()},
    }
    write_results("families", {"seqlen": args.seqlen, "window": args.window, "ring": ring, "decode": decode,
                               "summary": summary}, plot, {"ring": ring, "decode": decode, "seqlen": args.seqlen})
    print(summary)


if __name__ == "__main__":
    main()
