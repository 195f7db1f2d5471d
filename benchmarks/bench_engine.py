"""The serving engine vs transformers' continuous batching, same checkpoint and requests, one process each.

Checkpoint: a random MixtralForCausalLM with the small preset's shapes (4 layers, hidden 256, 8 experts
top-2), float32, written by transformers.  Requests: prompt lengths drawn uniformly from
[16, max_len], greedy, a fixed number of new tokens each (EOS ignored, so both sides do the same work).
Peer: ``model.generate_batch`` (transformers' continuous batching manager with its paged cache).
Also, on the ringmoe side: the deterministic mode, the prefix cache on a shared 512-token system
prompt (on vs off), and the time to first token of one long prompt at cp=2 (2 ranks x 1 thread, ring
prefill) vs one process (2 threads).  Each run is its own forked process, so the peak RSS is its own.
Writes benchmarks/results/engine.json and engine.png.

    python benchmarks/bench_engine.py [--workloads 64:1024:128,256:512:32] [--long 32768]
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


def ringmoe_rank(rank, world, path, requests, new, prefix_caching=True, deterministic=False):
    from ringmoe.serve import Engine, SamplingParams

    engine = Engine(load_checkpoint(path), kv_cache_tokens=sum(len(p) + new for p in requests) + 1024,
                    max_num_seqs=64, max_num_batched_tokens=2048, prefix_caching=prefix_caching,
                    deterministic=deterministic)
    engine.generate([requests[0][:16]], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)) for p in requests]
    usage, start, final = [], time.perf_counter(), {}
    while engine.has_unfinished:
        final.update((out.request_id, out) for out in engine.step() if out.finished)
        usage.append(engine.last_stats.kv_usage)
    seconds = time.perf_counter() - start
    done = [final[i] for i in ids]
    return {"seconds": seconds, "output_tokens": sum(len(r.output_ids) for r in done),
            "ttft_s_p50": sorted(r.timings["ttft_s"] for r in done)[len(done) // 2],
            "peak_rss_mib": peak_rss_bytes() / 2**20, "kv_usage_peak": max(usage),
            "kv_usage_mean": sum(usage) / len(usage), "prefix_hit_tokens": engine.blocks.hit_tokens,
            "tokens": [r.output_ids for r in done]}


def long_prompt_rank(rank, world, path, length, cp):
    """Time to first token of one ``length``-token prompt on a cp x 1 mesh (ring prefill when cp > 1)."""
    from ringmoe.parallel import make_mesh
    from ringmoe.serve import Engine, SamplingParams

    engine = Engine(load_checkpoint(path, make_mesh(cp, 1)), kv_cache_tokens=length // cp + 256,
                    max_num_batched_tokens=length, prefix_caching=False)
    prompt = torch.randint(0, preset("small").vocab_size, (length,), generator=torch.Generator().manual_seed(5))
    if rank != 0:
        engine.run_worker()
        return {"peak_rss_mib": peak_rss_bytes() / 2**20}
    engine.generate([prompt[:64].tolist()], SamplingParams(temperature=0, max_tokens=1))  # warm-up
    start = time.perf_counter()
    out = engine.generate([prompt.tolist()], SamplingParams(temperature=0, max_tokens=1))[0]
    ttft = time.perf_counter() - start
    engine.shutdown()
    return {"ttft_s": ttft, "token": out.output_ids[0], "peak_rss_mib": peak_rss_bytes() / 2**20}


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
    fig, ax = plt.subplots(figsize=(10, 4))
    names = list(data)
    ax.bar(range(len(names)), [data[n] for n in names], color=["C0", "C1", "C2"] * (len(names) // 3 + 1))
    ax.set_xticks(range(len(names)), names, fontsize=7)
    ax.set_ylabel("output tokens / s")
    ax.set_title("serving throughput, same checkpoint and requests (2 threads)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _strip(run: dict) -> dict:
    out = {k: v for k, v in run.items() if k != "tokens"}
    out["output_tokens_per_s"] = run["output_tokens"] / run["seconds"]
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workloads", default="64:1024:128,256:512:32",
                        help="requests:max_prompt_len:new_tokens, comma separated")
    parser.add_argument("--long", type=int, default=32768, help="tokens of the long prompt (0: skip)")
    args = parser.parse_args()
    workloads, bars = [], {}
    with tempfile.TemporaryDirectory() as folder:
        spawn(save_checkpoint, 1, folder)
        for spec in args.workloads.split(","):
            count, max_len, new = (int(x) for x in spec.split(":"))
            requests = prompts(count, max_len)
            runs = {}
            for name, fn, extra in [("ringmoe", ringmoe_rank, (True, False)),
                                    ("ringmoe_deterministic", ringmoe_rank, (True, True)),
                                    ("transformers_generate_batch", transformers_rank, ())]:
                runs[name] = spawn(fn, 1, folder, requests, new, *extra, threads_per_rank=2, timeout=3600)[0]
                print(spec, name, f"{runs[name]['output_tokens'] / runs[name]['seconds']:.1f} tok/s", flush=True)
            same = sum(a == b for a, b in zip(runs["ringmoe"]["tokens"], runs["transformers_generate_batch"]["tokens"]))
            ours, theirs = (runs[k]["output_tokens"] / runs[k]["seconds"] for k in ("ringmoe", "transformers_generate_batch"))
            det = runs["ringmoe_deterministic"]["output_tokens"] / runs["ringmoe_deterministic"]["seconds"]
            workloads.append({"requests": count, "prompt_len": [16, max_len], "new_tokens": new,
                              "runs": {k: _strip(v) for k, v in runs.items()},
                              "throughput_ratio_vs_transformers": ours / theirs,
                              "deterministic_slowdown": ours / det,
                              "requests_with_identical_greedy_tokens": f"{same} of {count}"})
            bars.update({f"{k}\n{spec}": v["output_tokens"] / v["seconds"] for k, v in runs.items()})
            print(workloads[-1]["throughput_ratio_vs_transformers"], workloads[-1]["deterministic_slowdown"], flush=True)
        shared = prompts(32, 32, seed=2, shared=512)
        hit = spawn(ringmoe_rank, 1, folder, shared, 32, True, threads_per_rank=2, timeout=3600)[0]
        miss = spawn(ringmoe_rank, 1, folder, shared, 32, False, threads_per_rank=2, timeout=3600)[0]
        prefix = {"requests": 32, "shared_tokens": 512, "own_tokens": [16, 32], "new_tokens": 32,
                  "on": _strip(hit), "off": _strip(miss), "speedup": miss["seconds"] / hit["seconds"]}
        print("prefix", prefix["speedup"], flush=True)
        long = {}
        if args.long:
            one = spawn(long_prompt_rank, 1, folder, args.long, 1, threads_per_rank=2, timeout=3600)[0]
            ring = spawn(long_prompt_rank, 2, folder, args.long, 2, threads_per_rank=1, timeout=3600)
            long = {"tokens": args.long, "one_process_ttft_s": one["ttft_s"], "cp2_ttft_s": ring[0]["ttft_s"],
                    "speedup": one["ttft_s"] / ring[0]["ttft_s"], "same_first_token": one["token"] == ring[0]["token"],
                    "peak_rss_mib": {"one_process": one["peak_rss_mib"],
                                     "cp2_per_rank": [r["peak_rss_mib"] for r in ring]}}
            print("long", long, flush=True)
    write_results("engine", {"dtype": "float32", "threads": 2, "workloads": workloads, "prefix_cache": prefix,
                             "long_prompt": long}, plot, bars)


if __name__ == "__main__":
    main()
