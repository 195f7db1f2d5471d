"""Speculative decoding, n-gram prompt lookup and DeepSeek-V3 MTP: output tokens/s and accepted lengths, with and
without it.

n-gram (``--only ngram``):
Model: the trained demo model (``make demo``'s, trained here once if absent: ~3 minutes), float32, 2 threads.
Prompts: code completion of the standard library's sources (each prompt: the first 192 tokens of a .py file;
code repeats its identifiers, so the continuation often copies an earlier run), greedy, 64 new tokens.
At concurrency c: max(8, 3c) requests, c running at once (max_num_seqs = c: a finished request's place is taken
by the next, so the load stays at c while any wait, as under a server's steady load; with only c requests a
request that speculation finishes early leaves the others to run on with fewer rows, and the run lasts as long as
the one whose drafts fail), on the offline engine; each engine
runs them five times, taking turns with the other engines of its concurrency; the median run is kept.
Each concurrency runs six engines: eager / compiled decode graph (prompt chunks in the graph too,
``prefill_graph=True``, as ``ringmoe serve`` runs them), each without drafts, with
``{"method": "ngram", "num_speculative_tokens": K}`` (every draft proposed is verified; steps without drafts use the
compiled graph too) and with ``"draft_length": "goodput"`` added (each step keeps the drafts that raise its expected
tokens per second, from the acceptance and step times the engine measures: ``serve/draft_budget.py``).  Greedy
outputs are checked equal with and without speculation.  At one request, ``fixed_ceiling_compiled``: the speed-up
the accepted drafts would give if verifying them cost nothing (each run's prefill timed apart: the prompts alone).

MTP (``--only mtp``): the demo's size in DeepSeek-V3's form trained with its multi-token prediction module by the
demo's recipe (``apps.demo_model.MTP_TRAINING``: ``ringmoe train --preset deepseek-v3-demo --mtp``, cached), exported
with its MTP layer and served by the engine with ``{"method": "mtp", "num_speculative_tokens": k}``, k = 1, 2, on
held-out files (the validation split the training never saw), greedy; eager, and with the compiled decode graph
(MLA's latent cache inside it), which verifies the drafts and runs the plain engine's steps, and runs the module
too: over each step's rows inside the step's own graph (its catch-up), its chained drafts as graphs of their own.
Also the training's teacher-forced figure: how often the module's first draft equals the model's next greedy token
on held-out text.

``--processes P`` (n-gram, one client): the compiled engines with and without drafts measured again in P - 1 fresh
processes, each building its own engines.  Their speed is a draw per process and per engine: three identical plain
engines built in one process differed by up to 20%, and the one-client ratio of seven processes in one hour ranged
over 1.13x-1.62x.  The summary gives every process's ratio and their median (``compiled_ratio_per_process``,
``compiled_ratio_median``).

Writes benchmarks/results/spec.json (one run of one part keeps the other part's figures, a run of some
concurrencies keeps the others' rows) and spec.png.

    python benchmarks/bench_spec.py [--only ngram|mtp] [--concurrency 1,4,16] [--k 4] [--new 64] [--processes 1]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import pyplot, write_results  # noqa: E402

from ringmoe.apps.demo_model import DEMO_TRAINING, MTP_TRAINING, default_cache, trained_demo_checkpoint  # noqa: E402
from ringmoe.serve import Engine, SamplingParams  # noqa: E402
from ringmoe.text.corpus import split_corpus, stdlib_texts  # noqa: E402

# prompt and the 64 new tokens inside the 256-token sequences the demo models were trained on (past them these small
# models lose the thread: with 400-token prompts the n-gram drafts' first-token acceptance fell to 31%)
PROMPT_TOKENS = DEMO_TRAINING["seqlen"] - 64
REPEATS = 5  # timed runs of each engine (the median is kept)


def prompts(tokenizer, count: int, held_out: bool = False) -> list[list[int]]:
    """The first PROMPT_TOKENS tokens of ``count`` long stdlib files (``held_out``: from the validation split)."""
    texts = split_corpus(stdlib_texts())[1] if held_out else stdlib_texts()
    texts = [t for t in texts if len(t) > 4000]
    random.Random(0).shuffle(texts)
    return [tokenizer.encode(t)[:PROMPT_TOKENS] for t in texts[:count]]


def run(path, prompt_ids, concurrency, new, variants: dict) -> dict:
    """{key: (row, output ids per request)} for each variant {key: (speculative_config, compiled graph)}: every
    engine is built and warmed up first, then the engines take turns, REPEATS times, each generating for every
    prompt (the median run is kept: this machine's speed drifts, and taking turns moves every engine alike)."""
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    engines, before, times, outs = {}, {}, {}, {}
    for key, (spec, graph) in variants.items():
        engine = Engine.from_checkpoint(path, max_num_seqs=concurrency, kv_cache_tokens=65536,
                                        decode_graph="compiled" if graph else "off", speculative_config=spec,
                                        prefill_graph=graph, prefix_caching=False)  # every run prefills its prompts
        engine.generate(prompt_ids[:1], params)  # warm-up (the compiled graph is already built)
        engines[key], times[key] = engine, []
        before[key] = (engine.spec_stats.num_drafts, engine.spec_stats.num_accepted_tokens,
                       list(engine.spec_stats.accepted_per_position), engine.spec_stats.num_draft_tokens)
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prefills = {key: [] for key in engines}  # the prompts' prefill alone (and each one's first token)
    for _ in range(REPEATS):
        for key, engine in engines.items():
            start = time.perf_counter()
            outs[key] = engine.generate(prompt_ids, params)
            times[key].append(time.perf_counter() - start)
            start = time.perf_counter()
            engine.generate(prompt_ids, first)
            prefills[key].append(time.perf_counter() - start)
    results = {}
    for key, engine in engines.items():
        seconds = sorted(times[key])[REPEATS // 2]
        tokens = sum(len(o.output_ids) for o in outs[key])
        drafts_before, accepted_before, per_position_before, draft_tokens_before = before[key]
        drafts = (engine.spec_stats.num_drafts - drafts_before) // REPEATS  # per run (fixed drafts: every run alike)
        accepted = (engine.spec_stats.num_accepted_tokens - accepted_before) // REPEATS
        draft_tokens = (engine.spec_stats.num_draft_tokens - draft_tokens_before) / REPEATS
        per_position = [(a - (per_position_before[i] if i < len(per_position_before) else 0)) // REPEATS
                        for i, a in enumerate(engine.spec_stats.accepted_per_position)]
        results[key] = ({"tokens_per_s": tokens / seconds, "seconds": seconds, "output_tokens": tokens,
                         "prefill_seconds": sorted(prefills[key])[REPEATS // 2],
                         "drafted_steps": drafts, "accepted_tokens": accepted,
                         "drafts_per_drafted_step": draft_tokens / drafts if drafts else 0.0,
                         "mean_accepted_length": 1 + accepted / drafts if drafts else 1.0,
                         "acceptance_per_position": [a / drafts for a in per_position] if drafts else [],
                         "compile_s": engine.compile_seconds}, [o.output_ids for o in outs[key]])
    return results


def plot(data, path):
    rows, mtp_rows = data
    plt = pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    levels = sorted({r["concurrency"] for r in rows})
    for graph in (False, True):
        for mode, label in ((None, ""), ("fixed", " + n-gram"), ("goodput", " + n-gram, goodput drafts")):
            ys = [next((r["tokens_per_s"] for r in rows if r["concurrency"] == c and r.get("draft_length") == mode
                        and r["compiled"] == graph), None) for c in levels]
            if None not in ys:
                ax.plot(levels, ys, marker="o", label=("compiled" if graph else "eager") + label,
                        linestyle="--" if mode is None else "-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens / s")
    ax.set_title("n-gram speculative decoding, stdlib code completion, demo model")
    ax.legend()
    levels = sorted({r["concurrency"] for r in mtp_rows})
    for graph in sorted({r.get("compiled", False) for r in mtp_rows}):
        for k in sorted({r["k"] for r in mtp_rows}):
            ys = [next(r["tokens_per_s"] for r in mtp_rows if r["concurrency"] == c and r["k"] == k
                       and r.get("compiled", False) == graph) for c in levels]
            ax2.plot(levels, ys, marker="o", linestyle="--" if not k else "-",
                     label=("compiled, " if graph else "eager, ") + (f"MTP, {k} draft(s)" if k else "no speculation"))
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("concurrent requests")
    ax2.set_ylabel("output tokens / s")
    ax2.set_title("DeepSeek-V3 MTP drafts, held-out stdlib files, deepseek-v3-demo")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def mtp_part(levels: list[int], new: int) -> dict:
    """The MTP rows: plain vs k = 1, 2 drafts at each concurrency, eager and with the compiled decode graph, and the
    training's teacher-forced acceptance."""
    from ringmoe.text import Tokenizer

    path = trained_demo_checkpoint(default_cache() / "demo-deepseek-mtp", training=MTP_TRAINING)
    training = json.loads((path.parent / "summary.json").read_text())
    tokenizer = Tokenizer(path)
    rows, variants = [], [(k, graph) for graph in (False, True) for k in (0, 1, 2)]
    for concurrency in levels:
        prompt_ids = prompts(tokenizer, max(4, concurrency), held_out=True)
        outputs = {}
        measured = run(path, prompt_ids, concurrency, new,
                       {(k, graph): ({"method": "mtp", "num_speculative_tokens": k} if k else None, graph)
                        for k, graph in variants})
        for k, graph in variants:
            row, outputs[k, graph] = measured[k, graph]
            row.update(concurrency=concurrency, k=k, compiled=graph)
            rows.append(row)
            print(f"c={concurrency:3d} {'compiled' if graph else 'eager':8s} mtp k={k}: {row['tokens_per_s']:7.1f} "
                  f"tok/s  mean accepted length {row['mean_accepted_length']:.2f}  per position "
                  f"{row['acceptance_per_position']}", flush=True)
        for row in rows[-len(variants):]:
            row["same_tokens_as_plain"] = outputs[row["k"], row["compiled"]] == outputs[0, False]
            row["repeated_share"] = repeated_share(prompt_ids, outputs[0, False])
            row["sample_outputs"] = [tokenizer.decode(ids) for ids in outputs[0, False][:2]]

    def speed(c, k, graph):
        return next(r["tokens_per_s"] for r in rows if r["concurrency"] == c and r["k"] == k
                    and r["compiled"] == graph)

    summary = {str(c): {**{f"mtp_k{k}_vs_plain": speed(c, k, False) / speed(c, 0, False) for k in (1, 2)},
                        **{f"compiled_mtp_k{k}_vs_plain_compiled": speed(c, k, True) / speed(c, 0, True)
                           for k in (1, 2)},
                        "best_mtp_vs_best_plain": max(speed(c, k, g) for k in (1, 2) for g in (False, True))
                        / max(speed(c, 0, g) for g in (False, True))} for c in levels}
    return {"training": {key: training.get(key) for key in ("steps", "val_loss", "unigram_entropy", "mtp_val_loss",
                                                             "mtp_draft_acceptance")},
            "recipe": MTP_TRAINING, "rows": rows, "summary": summary}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", choices=["ngram", "mtp"], default=None)
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # a fresh process's one-client figures
    args = parser.parse_args()
    torch.set_num_threads(2)
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.child is not None:
        Path(args.child).write_text(json.dumps(compiled_pair(args.k, args.new)))
        return
    previous = Path(__file__).resolve().parent / "results" / "spec.json"
    kept = json.loads(previous.read_text()) if previous.is_file() else {}
    if args.only != "mtp":
        ngram = keep_other_levels(ngram_part(levels, args.k, args.new), kept, levels)
        if args.processes > 1 and 1 in levels:
            more = [fresh_process(args.k, args.new) for _ in range(args.processes - 1)]
            ngram["summary"]["1"].update(across_processes(ngram["rows"], more))
            print("one client across processes", ngram["summary"]["1"], flush=True)
    else:
        ngram = {key: kept.get(key) for key in ("config", "rows", "summary")}
    mtp = mtp_part(levels, args.new) if args.only != "ngram" else kept.get("mtp")
    write_results("spec", {**ngram, "mtp": mtp}, plot, (ngram["rows"] or [], (mtp or {}).get("rows", [])))


def repeated_share(prompt_ids: list[list[int]], outputs: list[list[int]], n: int = 8) -> float:
    """The share of output tokens that end an n-gram seen earlier in their prompt or output: how much of what the
    model wrote repeats (copies or loops), which is what prompt lookup can draft."""
    repeated = total = 0
    for prompt, output in zip(prompt_ids, outputs):
        tokens = prompt + output
        for i in range(len(prompt), len(tokens)):
            gram = tokens[i - n + 1:i + 1]
            total += 1
            repeated += any(tokens[j - n + 1:j + 1] == gram for j in range(n - 1, i))
    return repeated / max(1, total)


def requests(concurrency: int) -> int:
    """Requests of the n-gram runs at ``concurrency`` (see the module's docstring)."""
    return max(8, 3 * concurrency)


def ceiling(plain: dict, drafted: dict, count: int) -> float:
    """At one request at a time (``count`` requests), the speed-up the accepted drafts would give if a step carrying
    drafts cost what a step without them does: the plain run spends its time less the prompts' prefill on one step
    per output token after each request's first, and the run with drafts needs ``accepted_tokens`` fewer steps."""
    decode_tokens = plain["output_tokens"] - count
    decode_s = plain["seconds"] - plain["prefill_seconds"]
    steps = decode_tokens - drafted["accepted_tokens"]
    return plain["seconds"] / (plain["prefill_seconds"] + decode_s * steps / decode_tokens)


def ngram_part(levels: list[int], k: int, new: int) -> dict:
    path = trained_demo_checkpoint()
    from ringmoe.text import Tokenizer

    tokenizer = Tokenizer(path)
    rows = []
    spec = spec_config(k)
    configs = {"plain": None, "fixed": spec, "goodput": {**spec, "draft_length": "goodput"}}
    for concurrency in levels:
        prompt_ids = prompts(tokenizer, requests(concurrency))
        variants = {(graph, mode): (config, graph) for graph in (False, True) for mode, config in configs.items()}
        measured = run(path, prompt_ids, concurrency, new, variants)
        outputs = {key: ids for key, (_, ids) in measured.items()}
        plain = outputs[(True, "plain")]
        for (graph, mode), (row, _) in measured.items():
            row.update(concurrency=concurrency, spec=mode != "plain", compiled=graph,
                       draft_length=None if mode == "plain" else mode,
                       same_tokens_as_plain=all(ids == plain for ids in outputs.values()),
                       repeated_share=repeated_share(prompt_ids, plain),
                       sample_outputs=[tokenizer.decode(ids) for ids in plain[:2]])
            rows.append(row)
            print(f"c={concurrency:3d} {'compiled' if graph else 'eager   '} {mode:8s}: {row['tokens_per_s']:7.1f} "
                  f"tok/s  mean accepted length {row['mean_accepted_length']:.2f}", flush=True)
    summary = {}
    for concurrency in levels:
        pick = {(r["compiled"], r["draft_length"] or "plain"): r for r in rows if r["concurrency"] == concurrency}
        ratio = {f"{mode}_vs_plain_{'compiled' if graph else 'eager'}":
                 pick[(graph, mode)]["tokens_per_s"] / pick[(graph, "plain")]["tokens_per_s"]
                 for graph in (False, True) for mode in ("fixed", "goodput")}
        summary[str(concurrency)] = {
            **ratio,
            "best_ngram_vs_best_plain": max(pick[(g, m)]["tokens_per_s"] for g in (False, True)
                                            for m in ("fixed", "goodput"))
            / max(pick[(g, "plain")]["tokens_per_s"] for g in (False, True)),
            "mean_accepted_length": pick[(True, "fixed")]["mean_accepted_length"],
            "fixed_ceiling_compiled": ceiling(pick[(True, "plain")], pick[(True, "fixed")], requests(concurrency))
            if concurrency == 1 else None,
        }
        print(concurrency, summary[str(concurrency)])
    return {"config": {"k": k, "new_tokens": new, "prompt_tokens": PROMPT_TOKENS, "speculative_config": spec,
                       "model": "trained demo model", "dtype": "float32"}, "rows": rows, "summary": summary}


def spec_config(k: int) -> dict:
    """The n-gram drafter's configuration of every run: k drafts, lookups of 2 to 4 tokens."""
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def compiled_pair(k: int, new: int) -> dict:
    """One client, the compiled engines without and with every draft (as ``ngram_part``): {"plain" | "fixed":
    tokens/s}, and whether their tokens agree."""
    from ringmoe.text import Tokenizer

    path = trained_demo_checkpoint()
    prompt_ids = prompts(Tokenizer(path), requests(1))
    measured = run(path, prompt_ids, 1, new, {"plain": (None, True), "fixed": (spec_config(k), True)})
    return {**{key: row["tokens_per_s"] for key, (row, _) in measured.items()},
            "same_tokens": measured["plain"][1] == measured["fixed"][1]}


def fresh_process(k: int, new: int) -> dict:
    """``compiled_pair`` in a new Python process (its own engines, compiled graphs and memory)."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "pair.json"
        subprocess.run([sys.executable, __file__, "--child", str(out), "--k", str(k), "--new", str(new)],
                       check=True, timeout=1800)
        return json.loads(out.read_text())


def across_processes(rows: list[dict], more: list[dict]) -> dict:
    """The one-client compiled figures of this process (``rows``) and of ``more`` fresh ones: every process's
    ratio with every draft verified vs without drafts, and the medians."""
    here = [r for r in rows if r["concurrency"] == 1 and r["compiled"]]
    pick = {r["draft_length"] or "plain": r["tokens_per_s"] for r in here}
    pairs = [{"plain": pick["plain"], "fixed": pick["fixed"],
              "same_tokens": all(r["same_tokens_as_plain"] for r in here)}, *more]
    if not all(pair["same_tokens"] for pair in pairs):
        raise RuntimeError("a fresh process's tokens with drafts differ from its tokens without")
    ratios = [pair["fixed"] / pair["plain"] for pair in pairs]
    return {"compiled_ratio_per_process": ratios, "compiled_ratio_median": statistics.median(ratios),
            "compiled_plain_tokens_per_s_per_process": [pair["plain"] for pair in pairs],
            "compiled_fixed_tokens_per_s_per_process": [pair["fixed"] for pair in pairs]}


def keep_other_levels(ngram: dict, kept: dict, levels: list[int]) -> dict:
    """``ngram`` with the previous file's rows and summaries of the concurrencies this run did not measure."""
    rows = [r for r in kept.get("rows") or () if r["concurrency"] not in levels]
    summary = {c: v for c, v in (kept.get("summary") or {}).items() if int(c) not in levels}
    ngram["rows"] = sorted(rows + ngram["rows"], key=lambda r: r["concurrency"])
    ngram["summary"] = dict(sorted({**summary, **ngram["summary"]}.items(), key=lambda item: int(item[0])))
    return ngram


if __name__ == "__main__":
    main()
