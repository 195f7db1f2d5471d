"""Training throughput and the longest trainable sequence: ringmoe's Trainer vs transformers in the same loop.

Part 1, side by side: the small preset (Mixtral architecture, 4 layers, hidden 256, 8 experts top-2),
float32, one sequence of ``--seqlen`` tokens per row, ``--rows`` rows per step, AdamW and gradient
clipping in both; ringmoe's ``Trainer`` (balancing losses off, so both minimise the same cross entropy)
vs transformers' MixtralForCausalLM (SDPA attention, its default experts) loaded from the same weights.
Median step time of ``--steps`` steps after one warm-up step, tokens/s and peak RSS, each in its own
process with 2 threads.

Part 2: the longest sequence one training step fits under ``--cap-gib`` of peak RSS per process, on one
process (2 threads) vs cp=2 (2 ranks x 1 thread, ring attention, each rank half the tokens), tiny preset,
lengths doubling from 4096.  Writes benchmarks/results/train.json and train.png.

    python benchmarks/bench_train.py [--seqlen 4096] [--rows 2] [--steps 3] [--cap-gib 1.5]
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
from bench_model import save_checkpoint  # noqa: E402
from common import peak_rss_bytes, pyplot, write_results  # noqa: E402

from ringmoe.model import MoETransformer, load_checkpoint, preset  # noqa: E402
from ringmoe.parallel import make_mesh  # noqa: E402
from ringmoe.parallel.launch import spawn  # noqa: E402
from ringmoe.train import PackedStream, TrainConfig, Trainer  # noqa: E402


def _documents(count: int, seqlen: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (seqlen,), generator=gen).tolist() for _ in range(count)]


def ringmoe_rank(rank, world, path, seqlen, rows, steps):
    model = load_checkpoint(path)
    stream = PackedStream(_documents(rows * (steps + 1), seqlen, model.config.vocab_size), seqlen)
    trainer = Trainer(model, TrainConfig(rows=rows, lr=1e-3, warmup=1, steps=steps + 1, clip=1.0, balance="none",
                                         z_coef=0.0), stream)
    trainer.step()  # warm-up
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.step()
        times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times), "tokens_per_s": rows * seqlen / statistics.median(times),
            "peak_rss_mib": peak_rss_bytes() / 2**20}


def transformers_rank(rank, world, path, seqlen, rows, steps):
    import transformers

    logging.getLogger("transformers").setLevel(logging.ERROR)
    model = transformers.MixtralForCausalLM.from_pretrained(path, attn_implementation="sdpa").train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    docs = _documents(rows * (steps + 1), seqlen, model.config.vocab_size)
    times = []
    for step in range(steps + 1):
        ids = torch.tensor(docs[step * rows:(step + 1) * rows])
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step:
            times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times), "tokens_per_s": rows * seqlen / statistics.median(times),
            "peak_rss_mib": peak_rss_bytes() / 2**20}


def memory_rank(rank, world, seqlen, cp):
    """Peak RSS of one training step on one sequence of ``seqlen`` tokens on a cp x 1 mesh (tiny preset)."""
    model = MoETransformer(preset("tiny"), make_mesh(cp, 1))
    model.init_weights(0)
    stream = PackedStream(_documents(2, seqlen, model.config.vocab_size), seqlen)
    Trainer(model, TrainConfig(rows=1, balance="none", z_coef=0.0), stream).step()
    return peak_rss_bytes() / 2**30


def longest(cap_gib: float, cp: int, start: int, limit: int) -> tuple[int, list]:
    seqlen, fitted, trail = start, 0, []
    while seqlen <= limit:
        threads = 2 if cp == 1 else 1
        peak = max(spawn(memory_rank, cp, seqlen, cp, threads_per_rank=threads, timeout=1800))
        trail.append({"seqlen": seqlen, "peak_rss_gib_per_process": peak})
        print(f"cp={cp} seqlen={seqlen}: {peak:.2f} GiB", flush=True)
        if peak > cap_gib:
            break
        fitted, seqlen = seqlen, seqlen * 2
    return fitted, trail


def plot(data, path):
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(data["throughput"])
    left.bar(names, [data["throughput"][n]["tokens_per_s"] for n in names], color=["C0", "C2"])
    left.set_ylabel("training tokens / s")
    left.set_title(f"small preset, seqlen {data['seqlen']}, fp32, 2 threads")
    for cp, trail in data["memory"].items():
        right.plot([t["seqlen"] for t in trail], [t["peak_rss_gib_per_process"] for t in trail], "o-", label=cp)
    right.axhline(data["cap_gib"], color="k", ls="--", lw=0.8, label="cap")
    right.set_xscale("log", base=2)
    right.set_xlabel("sequence length")
    right.set_ylabel("peak RSS per process, GiB")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cap-gib", type=float, default=1.5)
    parser.add_argument("--max-seqlen", type=int, default=262144)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        spawn(save_checkpoint, 1, folder)
        ours = spawn(ringmoe_rank, 1, folder, args.seqlen, args.rows, args.steps, threads_per_rank=2, timeout=3600)[0]
        print("ringmoe", ours, flush=True)
        theirs = spawn(transformers_rank, 1, folder, args.seqlen, args.rows, args.steps, threads_per_rank=2,
                       timeout=3600)[0]
        print("transformers", theirs, flush=True)
    one, one_trail = longest(args.cap_gib, 1, 4096, args.max_seqlen)
    two, two_trail = longest(args.cap_gib, 2, 4096, args.max_seqlen)
    summary = {"speedup_vs_transformers": ours["tokens_per_s"] / theirs["tokens_per_s"],
               "longest_one_process": one, "longest_cp2": two, "longest_ratio": two / one if one else None}
    print(summary)
    write_results("train", {"seqlen": args.seqlen, "rows": args.rows, "cap_gib": args.cap_gib,
                            "throughput": {"ringmoe": ours, "transformers": theirs},
                            "memory": {"one process": one_trail, "cp=2": two_trail}, "summary": summary},
                  plot, {"seqlen": args.seqlen, "cap_gib": args.cap_gib,
                         "throughput": {"ringmoe": ours, "transformers": theirs},
                         "memory": {"one process": one_trail, "cp=2": two_trail}})


if __name__ == "__main__":
    main()
