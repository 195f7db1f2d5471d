"""The demo model (what `make demo` serves): its training run's loss curves and a few of its completions.

Trains it if the cache does not hold it yet (``--retrain`` forces; about two minutes on 2 cores), then
writes benchmarks/results/demo_model.json (the run's settings, its summary, the evaluation curve and
completions at temperature 0 and 0.7) and demo_model.png (train and validation loss per step).

    python benchmarks/bench_demo_model.py [--retrain] [--sweep]

--sweep first trains each recipe of SWEEP (fresh folders, same data) and records the validation loss (and its
ratio to the unigram entropy of its own tokenizer's tokens) and router imbalance each reaches: the evidence behind
DEMO_TRAINING's settings.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import pyplot, write_results  # noqa: E402

from ringmoe.apps.demo_model import DEMO_TRAINING, trained_demo_checkpoint  # noqa: E402
from ringmoe.serve import Engine, SamplingParams  # noqa: E402
from ringmoe.train.run import TrainOptions, run_training  # noqa: E402

# recipes compared, each a change of DEMO_TRAINING's settings (900 steps of 2048 tokens, the data in its order of
# now: the cuts of the stream in a seeded random order).  The sweep of the data's earlier order (one file after
# another, 500 steps, sequences of 128; validation loss over 0.74x the unigram entropy at best) chose the vocabulary,
# the learning rate and the balancing weight: results/demo_model_sweep_stream_order.json.
SWEEP = {"sequences of 128 (the previous recipe's)": dict(seqlen=128, eval_sequences=64),
         "sequences of 512": dict(seqlen=512, eval_sequences=16),
         "lr 3e-3": dict(lr=3e-3)}

PROMPTS = ["def read_config(path):\n", "class Stack:\n    def push(self, item):\n", "import os\nimport sys\n\n",
           "    for i in range("]


def plot(rows, path):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.plot([r["step"] for r in rows["train"]], [r["loss"] for r in rows["train"]], lw=0.8, label="train (per step)")
    ax.plot([r["step"] for r in rows["val"]], [r["val_loss"] for r in rows["val"]], "o-", label="validation")
    ax.axhline(rows["unigram"], color="gray", ls="--", label="unigram entropy")
    ax.set_xlabel(f"step ({DEMO_TRAINING['tokens_per_step']} tokens)")
    ax.set_ylabel("next-token loss (nats)")
    ax.set_title("demo preset on the standard library, 2 CPU cores")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def sweep() -> dict:
    import tempfile

    results = {}
    for name, change in SWEEP.items():
        with tempfile.TemporaryDirectory() as out:
            steps = change.get("steps", DEMO_TRAINING["steps"])
            settings = {**DEMO_TRAINING, "eval_every": steps, "log_every": steps, "save_every": steps, **change}
            result = run_training(TrainOptions(out=out, **settings))
            rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        results[name] = {"settings": change, "val_loss": result["val_loss"],
                         "unigram_entropy": result["unigram_entropy"],
                         "ratio_to_unigram": result["val_loss"] / result["unigram_entropy"],
                         "router_imbalance_last_10": sum(r["router_imbalance"] for r in rows[-10:]) / 10,
                         "tokens_per_s": sorted(r["tokens_per_s"] for r in rows)[len(rows) // 2]}
        print(name, results[name], flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--retrain", action="store_true")
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    recipes = sweep() if args.sweep else None
    hf = trained_demo_checkpoint(retrain=args.retrain)
    summary = json.loads((hf.parent / "summary.json").read_text())
    rows = [json.loads(line) for line in (hf.parent / "metrics.jsonl").read_text().splitlines() if line.strip()]
    engine = Engine.from_checkpoint(hf)
    completions = {}
    for temperature in (0.0, 0.7):
        outs = engine.generate(PROMPTS, SamplingParams(temperature=temperature, max_tokens=48, seed=0))
        completions[str(temperature)] = [{"prompt": p, "completion": o.text} for p, o in zip(PROMPTS, outs)]
    seconds = sum(r["tokens"] / r["tokens_per_s"] for r in rows)
    val = [r for r in rows if "val_loss" in r]
    write_results("demo_model", {
        "training": DEMO_TRAINING, "summary": summary, "train_seconds": seconds,
        "val_over_unigram_entropy": summary["val_loss"] / summary["unigram_entropy"],
        "median_tokens_per_s": sorted(r["tokens_per_s"] for r in rows)[len(rows) // 2],
        "validation": [{"step": r["step"], "val_loss": r["val_loss"]} for r in val], "completions": completions,
        "router_imbalance_last_10": sum(r["router_imbalance"] for r in rows[-10:]) / 10,
        **({"sweep": recipes} if recipes else {}),
    }, plot, {"train": rows, "val": val, "unigram": summary["unigram_entropy"]})


if __name__ == "__main__":
    main()
