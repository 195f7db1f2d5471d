"""Prefill (time to the first token) of one prompt: prompt chunks in the compiled graph vs eagerly vs transformers.

Model: the trained demo model (``make demo``'s, trained here once if absent), float32, 2 threads.  Prompts: the
first L tokens of standard-library sources, L = 32 / 192 / 512 / 1024, four prompts each, one request at a time
(no prefix cache: every prompt is computed).  Engines, each built (and compiled) first, then taking turns
``--rounds`` times: the eager engine (``decode_graph="off"``), the compiled decode graph with prompt chunks eager
(``prefill_graph=False``, the default before the prompt graph) and with them in the graph (``prefill_graph=True``,
the default of ``ringmoe serve``: up to 512 rows a call, so 1024 tokens are two calls).  Peer: transformers' model
of the same checkpoint, one forward over the prompt (SDPA attention, its MoE block), the last position's logits.
Per engine and length: the median seconds to a prompt's first token (``generate`` with max_tokens 1: prefill,
head, sampling), and whether every engine and the peer take the same first token.  Writes
benchmarks/results/prefill.json and prefill.png.

    python benchmarks/bench_prefill.py [--lengths 32,192,512,1024] [--rounds 5]
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import pyplot, write_results  # noqa: E402

from ringmoe.apps.demo_model import trained_demo_checkpoint  # noqa: E402
from ringmoe.serve import Engine, SamplingParams  # noqa: E402
from ringmoe.text import Tokenizer, stdlib_texts  # noqa: E402

ENGINES = {"eager": dict(decode_graph="off"), "graph_prompts_eager": dict(decode_graph="compiled"),
           "graph_prompts_in_graph": dict(decode_graph="compiled", prefill_graph=True)}
PER_LENGTH = 4


def prompts(tokenizer, lengths: list[int]) -> dict[int, list[list[int]]]:
    """PER_LENGTH prompts of each length: the first L tokens of sources long enough."""
    texts = [t for t in stdlib_texts() if len(t) > 20000]
    random.Random(1).shuffle(texts)
    ids = [tokenizer.encode(t) for t in texts[:PER_LENGTH]]
    return {length: [i[:length] for i in ids] for length in lengths}


def peer(path):
    """transformers' model of the checkpoint: prompt ids -> the first token (the last position's argmax)."""
    import transformers

    logging.getLogger("transformers").setLevel(logging.ERROR)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    @torch.no_grad()
    def first_token(ids: list[int]) -> int:
        return int(model(torch.tensor([ids]), logits_to_keep=1).logits[0, -1].argmax())

    return first_token


def plot(data, path):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    lengths = data["config"]["lengths"]
    for name in list(ENGINES) + ["transformers"]:
        ax.plot(lengths, [data["rows"][str(length)][name]["median_ms"] for length in lengths], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token, ms (median)")
    ax.set_title("Prefill of one prompt, trained demo model, 2 CPU threads")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="32,192,512,1024")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(2)
    lengths = [int(x) for x in args.lengths.split(",")]
    path = trained_demo_checkpoint()
    by_length = prompts(Tokenizer(path), lengths)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    engines, compile_s = {}, {}
    for name, options in ENGINES.items():
        engine = Engine.from_checkpoint(path, max_num_seqs=1, kv_cache_tokens=8192, prefix_caching=False, **options)
        engine.generate(by_length[lengths[0]][:1], one)  # (warm-up: the graphs are compiled at start-up)
        engines[name], compile_s[name] = engine, engine.compile_seconds
    runners = {name: (lambda ids, engine=engine: engine.generate([ids], one)[0].output_ids[0])
               for name, engine in engines.items()}
    runners["transformers"] = peer(path)
    for fn in runners.values():  # every path's first call of each length outside the timed rounds
        for length in lengths:
            fn(by_length[length][0])
    times = {(name, length): [] for name in runners for length in lengths}
    firsts = {}
    for _ in range(args.rounds):
        for name, fn in runners.items():
            for length in lengths:
                for i, ids in enumerate(by_length[length]):
                    start = time.perf_counter()
                    firsts[name, length, i] = fn(ids)
                    times[name, length].append(time.perf_counter() - start)
    rows = {}
    for length in lengths:
        row = {name: {"median_ms": statistics.median(times[name, length]) * 1e3} for name in runners}
        for name in runners:
            row[name]["vs_eager"] = row["eager"]["median_ms"] / row[name]["median_ms"]
            row[name]["vs_transformers"] = row["transformers"]["median_ms"] / row[name]["median_ms"]
        row["same_first_tokens"] = all(firsts[name, length, i] == firsts["eager", length, i]
                                       for name in runners for i in range(PER_LENGTH))
        rows[str(length)] = row
        print(f"{length:5d} tokens: " + "  ".join(f"{name} {row[name]['median_ms']:.1f} ms" for name in runners)
              + f"  same first tokens {row['same_first_tokens']}", flush=True)
    payload = {"config": {"lengths": lengths, "prompts_per_length": PER_LENGTH, "rounds": args.rounds,
                          "model": "trained demo model", "dtype": "float32", "engines": ENGINES, "compile_s": compile_s},
               "rows": rows}
    write_results("prefill", payload, plot, payload)


if __name__ == "__main__":
    main()
