"""Speculative decoding with n-gram prompt lookup: output tokens/s and mean accepted length, with and without it.

Model: the trained demo model (``make demo``'s, trained here once if absent: ~3 minutes), float32, 2 threads.
Prompts: code completion of the standard library's sources (each prompt: the first ~400 tokens of a .py file;
code repeats its identifiers, so the continuation often copies an earlier run), greedy, 64 new tokens.
At concurrency c: max(4, c) requests, c running at once (max_num_seqs = c), on the offline engine.
Each concurrency runs four engines: eager / compiled decode graph, each without and with
``{"method": "ngram", "num_speculative_tokens": K}`` (steps without drafts use the compiled graph too).
Greedy outputs are checked equal with and without speculation.

Writes benchmarks/results/spec.json and spec.png.

    python benchmarks/bench_spec.py [--concurrency 1,4,16] [--k 4] [--new 64]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import pyplot, write_results  # noqa: E402

from ringmoe.apps.demo_model import trained_demo_checkpoint  # noqa: E402
from ringmoe.serve import Engine, SamplingParams  # noqa: E402
from ringmoe.text.corpus import stdlib_texts  # noqa: E402

PROMPT_TOKENS = 400


def prompts(tokenizer, count: int) -> list[list[int]]:
    texts = [t for t in stdlib_texts() if len(t) > 4000]
    random.Random(0).shuffle(texts)
    return [tokenizer.encode(t)[:PROMPT_TOKENS] for t in texts[:count]]


def run(path, prompt_ids, concurrency, new, spec, graph):
    engine = Engine.from_checkpoint(path, max_num_seqs=concurrency, kv_cache_tokens=65536,
                                    decode_graph="compiled" if graph else "off", speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    engine.generate(prompt_ids[:1], params)  # warm-up (the compiled graph is already built)
    accepted_before, drafts_before = engine.spec_stats.num_accepted_tokens, engine.spec_stats.num_drafts
    per_position_before = list(engine.spec_stats.accepted_per_position)
    start = time.perf_counter()
    outs = engine.generate(prompt_ids, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.output_ids) for o in outs)
    drafts = engine.spec_stats.num_drafts - drafts_before
    accepted = engine.spec_stats.num_accepted_tokens - accepted_before
    per_position = [a - (per_position_before[i] if i < len(per_position_before) else 0)
                    for i, a in enumerate(engine.spec_stats.accepted_per_position)]
    return {"tokens_per_s": tokens / seconds, "seconds": seconds, "output_tokens": tokens,
            "drafted_steps": drafts, "accepted_tokens": accepted,
            "mean_accepted_length": 1 + accepted / drafts if drafts else 1.0,
            "acceptance_per_position": [a / drafts for a in per_position] if drafts else [],
            "compile_s": engine.compile_seconds}, [o.output_ids for o in outs]


def plot(rows, path):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    levels = sorted({r["concurrency"] for r in rows})
    for label, spec, graph in (("eager", False, False), ("eager + n-gram", True, False),
                               ("compiled", False, True), ("compiled + n-gram", True, True)):
        ys = [next(r["tokens_per_s"] for r in rows if r["concurrency"] == c and r["spec"] == spec
                   and r["compiled"] == graph) for c in levels]
        ax.plot(levels, ys, marker="o", label=label, linestyle="--" if not spec else "-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens / s")
    ax.set_title("n-gram speculative decoding, stdlib code completion, demo model")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--new", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(2)
    path = trained_demo_checkpoint()
    from ringmoe.text import Tokenizer

    tokenizer = Tokenizer(path)
    levels = [int(c) for c in args.concurrency.split(",")]
    rows = []
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    for concurrency in levels:
        prompt_ids = prompts(tokenizer, max(4, concurrency))
        outputs = {}
        for graph in (False, True):
            for speculative in (False, True):
                row, outputs[(graph, speculative)] = run(path, prompt_ids, concurrency, args.new,
                                                         spec if speculative else None, graph)
                row.update(concurrency=concurrency, spec=speculative, compiled=graph)
                rows.append(row)
                print(f"c={concurrency:3d} {'compiled' if graph else 'eager   '} {'ngram' if speculative else 'plain'}: "
                      f"{row['tokens_per_s']:7.1f} tok/s  mean accepted length {row['mean_accepted_length']:.2f}",
                      flush=True)
        same = all(outputs[(g, True)] == outputs[(g, False)] for g in (False, True))
        for row in rows[-4:]:
            row["same_tokens_as_plain"] = same
    summary = {}
    for concurrency in levels:
        pick = {(r["spec"], r["compiled"]): r for r in rows if r["concurrency"] == concurrency}
        summary[str(concurrency)] = {
            "ngram_vs_plain_eager": pick[(True, False)]["tokens_per_s"] / pick[(False, False)]["tokens_per_s"],
            "ngram_vs_plain_compiled": pick[(True, True)]["tokens_per_s"] / pick[(False, True)]["tokens_per_s"],
            "best_ngram_vs_best_plain": max(pick[(True, g)]["tokens_per_s"] for g in (False, True))
            / max(pick[(False, g)]["tokens_per_s"] for g in (False, True)),
            "mean_accepted_length": pick[(True, False)]["mean_accepted_length"],
        }
        print(concurrency, summary[str(concurrency)])
    write_results("spec", {"config": {"k": args.k, "new_tokens": args.new, "prompt_tokens": PROMPT_TOKENS,
                                      "speculative_config": spec, "model": "trained demo model", "dtype": "float32"},
                           "rows": rows, "summary": summary}, plot, rows)


if __name__ == "__main__":
    main()
