"""The MoE transformer end to end: prefill + greedy decode, one process vs cp x ep meshes vs transformers.

Model: the "small" preset (Mixtral architecture, 4 layers, hidden 256, 8 experts top-2), float32,
2 prompts of 4096 tokens, 8 new tokens.  Peer: transformers' MixtralForCausalLM (SDPA attention,
its default expert kernel) loaded from the same checkpoint, prefill with logits_to_keep=1 and
generate(do_sample=False).  ringmoe runs on one process (2 threads) and on meshes of gloo ranks
(one thread each): cp=2, ep=2 and cp=2 x ep=2 (4 ranks on 2 cores: oversubscribed twice).
Every run happens in its own forked process so its peak RSS is its own.
Writes benchmarks/results/model.json and model.png.

    python benchmarks/bench_model.py [--seqlen 4096] [--repeats 3]
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

from ringmoe.model import load_checkpoint, preset  # noqa: E402
from ringmoe.serve import generate  # noqa: E402
from ringmoe.parallel import make_mesh  # noqa: E402
from ringmoe.parallel.launch import spawn  # noqa: E402

BATCH, NEW = 2, 8


def save_checkpoint(rank, world, path: str) -> None:
    """A random MixtralForCausalLM with the small preset's shapes, saved by transformers."""
    import transformers

    c = preset("small")
    cfg = transformers.MixtralConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
                                     num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                                     head_dim=c.head_dim, intermediate_size=c.ffn_size, num_local_experts=c.num_experts,
                                     num_experts_per_tok=c.top_k, rope_theta=c.rope_theta, initializer_range=0.05)
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(cfg).save_pretrained(path)


def prompt(seqlen: int) -> torch.Tensor:
    return torch.randint(0, preset("small").vocab_size, (BATCH, seqlen), generator=torch.Generator().manual_seed(1))


def transformers_rank(rank, world, path, seqlen, repeats):
    import transformers

    logging.getLogger("transformers").setLevel(logging.ERROR)
    model = transformers.MixtralForCausalLM.from_pretrained(path).eval()
    ids = prompt(seqlen)
    def run(new_tokens):
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=0)

    prefill, first, total, tokens = [], [], [], None
    with torch.no_grad():
        run(2)  # warm-up
        for _ in range(repeats):
            start = time.perf_counter()
            model(ids, use_cache=True, logits_to_keep=1)
            prefill.append(time.perf_counter() - start)
            start = time.perf_counter()
            run(1)
            first.append(time.perf_counter() - start)
            start = time.perf_counter()
            tokens = run(NEW)[:, seqlen:]
            total.append(time.perf_counter() - start)
    prefill_s = statistics.median(prefill)
    # decode: the NEW - 1 steps after the first token = generate(NEW) - generate(1)
    return {"prefill_s": prefill_s, "decode_s": statistics.median(total) - statistics.median(first),
            "peak_rss_mib": peak_rss_bytes() / 2**20, "tokens": tokens.tolist()}


def ringmoe_rank(rank, world, path, seqlen, repeats, cp, ep):
    mesh = make_mesh(cp, ep)
    model = load_checkpoint(path, mesh)
    ids = prompt(seqlen)
    generate(model, ids, 2)  # warm-up
    runs = [generate(model, ids, NEW) for _ in range(repeats)]
    ring = runs[-1].ring.totals("forward")
    return {"prefill_s": statistics.median(r.prefill_s for r in runs),
            "decode_s": statistics.median(r.decode_s for r in runs),
            "peak_rss_mib": peak_rss_bytes() / 2**20, "tokens": runs[-1].tokens.tolist(),
            "attention_compute_s": ring["compute_s"], "exposed_comm": ring["exposed_comm_fraction"]}


def plot(rows, path):
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["name"] for r in rows]
    x = range(len(rows))
    left.bar([i - 0.2 for i in x], [r["prefill_s"] for r in rows], width=0.4, label="prefill")
    left.bar([i + 0.2 for i in x], [r["decode_s"] for r in rows], width=0.4, label=f"decode ({NEW - 1} steps)")
    left.set_xticks(list(x), names, rotation=20, fontsize=8)
    left.set_ylabel("seconds (slowest rank)")
    left.legend()
    left.set_title("prefill + greedy decode, 2 x 4096 tokens, 2 CPU cores")
    right.bar(list(x), [r["peak_rss_mib"] for r in rows], color="tab:green")
    right.set_xticks(list(x), names, rotation=20, fontsize=8)
    right.set_ylabel("peak RSS per process, MiB")
    right.set_title("memory")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as path:
        spawn(save_checkpoint, 1, path)  # in a child: the parent stays free of torch threads before it forks
        hf = spawn(transformers_rank, 1, path, args.seqlen, args.repeats, threads_per_rank=threads, timeout=3600)[0]
        rows = [{"name": "transformers (1 proc)", "world": 1, **hf}]
        for cp, ep in ((1, 1), (2, 1), (1, 2), (2, 2)):
            ranks = spawn(ringmoe_rank, cp * ep, path, args.seqlen, args.repeats, cp, ep,
                          threads_per_rank=threads if cp * ep == 1 else 1, timeout=3600)
            attention = [r["attention_compute_s"] for r in ranks]
            rows.append({
                "name": f"ringmoe cp={cp} ep={ep}", "world": cp * ep, "cp": cp, "ep": ep,
                "prefill_s": max(r["prefill_s"] for r in ranks), "decode_s": max(r["decode_s"] for r in ranks),
                "peak_rss_mib": max(r["peak_rss_mib"] for r in ranks),
                "attention_imbalance": max(attention) / (sum(attention) / len(attention)) if cp > 1 else 1.0,
                "exposed_comm": max(r["exposed_comm"] for r in ranks),
                "tokens_equal_transformers": all(r["tokens"] == hf["tokens"] for r in ranks),
            })
    for row in rows:
        row.pop("tokens", None)
        row["prefill_vs_transformers"] = row["prefill_s"] / hf["prefill_s"]
        print(f"{row['name']:>24}: prefill {row['prefill_s']:.2f} s ({row['prefill_vs_transformers']:.2f}x HF), "
              f"decode {row['decode_s']:.2f} s, peak {row['peak_rss_mib']:.0f} MiB, "
              f"same tokens as HF: {row.get('tokens_equal_transformers', '-')}")
    write_results("model", {"batch": BATCH, "seqlen": args.seqlen, "new_tokens": NEW, "preset": "small",
                            "dtype": "float32", "rows": rows}, plot, rows)


if __name__ == "__main__":
    main()
