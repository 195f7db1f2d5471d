"""The serving engine vs transformers' continuous batching, same checkpoint and requests, one process each.

Checkpoint: a random MixtralForCausalLM with the small preset's shapes (4 layers, hidden 256, 8 experts
top-2), float32, written by transformers.  Requests: prompt lengths drawn uniformly from
[16, max_len], greedy, a fixed number of new tokens each (EOS ignored, so both sides do the same work).
Peer: ``model.generate_batch`` (transformers' continuous batching manager, paged cache, SDPA-paged attention).
Also: the prefix cache on a shared system prompt (on vs off).  Each run is its own forked process
(2 threads), so the peak RSS is its own.  Writes benchmarks/results/engine.json and engine.png.

    python benchmarks/bench_engine.py [--requests 64] [--max-len 512] [--new 32]
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import save_checkpoint  # noqa: E402
from common import peak_rss_bytes, pyplot, write_results  # noqa: E402

from ringmoe.model import load_checkpoint, preset  # noqa: E402
from ringmoe.parallel.launch import spawn  # noqa: E402


def prompts(count: int, max_len: int, seed: int = 1, shared: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    vocab = preset("small").vocab_size
    system = torch.randint(0, vocab, (shared,), generator=gen).tolist()
    lengths = torch.randint(16, max_len + 1, (count,), generator=gen).tolist()
    return [system + torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def ringmoe_rank(rank, world, path, requests, new, prefix_caching=True):
    from ringmoe.serve import Engine, SamplingParams

    engine = Engine(load_checkpoint(path), kv_cache_tokens=sum(len(p) + new for p in requests) + 1024,
                    max_num_seqs=64, max_num_batched_tokens=2048, prefix_caching=prefix_caching)
    engine.generate([requests[0][:16]], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    start = time.perf_counter()
    outs = engine.generate(requests, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "output_tokens": sum(len(o.output_ids) for o in outs),
            "ttft_s": sorted(o.timings["ttft_s"] for o in outs), "peak_rss_mib": peak_rss_bytes() / 2**20,
            "prefix_hit_tokens": engine.blocks.hit_tokens, "tokens": [o.output_ids for o in outs]}


def transformers_rank(rank, world, path, requests, new):
    import transformers

    logging.getLogger("transformers").setLevel(logging.ERROR)
    model = transformers.MixtralForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    config = transformers.GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    with torch.no_grad():
        model.generate_batch(inputs=[requests[0][:16]], generation_config=transformers.GenerationConfig(
            max_new_tokens=2, do_sample=False, eos_token_id=-1, pad_token_id=0))
        start = time.perf_counter()
        outs = model.generate_batch(inputs=requests, generation_config=config)
        seconds = time.perf_counter() - start
    ordered = [outs[k] for k in sorted(outs, key=lambda k: int(k.split("_")[-1]) if k.split("_")[-1].isdigit() else k)]
    return {"seconds": seconds, "output_tokens": sum(len(o.generated_tokens) for o in ordered),
            "peak_rss_mib": peak_rss_bytes() / 2**20, "tokens": [list(o.generated_tokens) for o in ordered]}


def plot(data, path):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(data)
    ax.bar(names, [data[n] for n in names])
    ax.set_ylabel("output tokens / s")
    ax.set_title("serving throughput, same checkpoint and requests (2 threads)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--new", type=int, default=32)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        spawn(save_checkpoint, 1, folder)
        requests = prompts(args.requests, args.max_len)
        ours = spawn(ringmoe_rank, 1, folder, requests, args.new, threads_per_rank=2, timeout=3600)[0]
        print("ringmoe engine", ours["seconds"], ours["output_tokens"] / ours["seconds"])
        theirs = spawn(transformers_rank, 1, folder, requests, args.new, threads_per_rank=2, timeout=3600)[0]
        print("transformers generate_batch", theirs["seconds"], theirs["output_tokens"] / theirs["seconds"])
        shared = prompts(32, 32, seed=2, shared=512)
        hit = spawn(ringmoe_rank, 1, folder, shared, args.new, True, threads_per_rank=2, timeout=3600)[0]
        miss = spawn(ringmoe_rank, 1, folder, shared, args.new, False, threads_per_rank=2, timeout=3600)[0]
    same = sum(a == b for a, b in zip(ours["tokens"], theirs["tokens"]))
    rows = {
        "ringmoe_engine": {k: v for k, v in ours.items() if k != "tokens"},
        "transformers_generate_batch": {k: v for k, v in theirs.items() if k != "tokens"},
        "prefix_cache_on": {k: v for k, v in hit.items() if k != "tokens"},
        "prefix_cache_off": {k: v for k, v in miss.items() if k != "tokens"},
    }
    for row in rows.values():
        row["output_tokens_per_s"] = row["output_tokens"] / row["seconds"]
    summary = {
        "throughput_ratio_vs_transformers": rows["ringmoe_engine"]["output_tokens_per_s"]
        / rows["transformers_generate_batch"]["output_tokens_per_s"],
        "prefix_hit_speedup": miss["seconds"] / hit["seconds"],
        "requests_with_identical_greedy_tokens": f"{same} of {len(requests)}",
    }
    print(summary)
    write_results("engine", {"requests": args.requests, "prompt_len": [16, args.max_len], "new_tokens": args.new,
                             "dtype": "float32", "threads": 2, "runs": rows, "summary": summary},
                  plot, {k: v["output_tokens_per_s"] for k, v in rows.items()})


if __name__ == "__main__":
    main()
