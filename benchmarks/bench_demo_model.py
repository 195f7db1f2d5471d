"""The demo model (what `make demo` serves): its training run's loss curves and a few of its completions.

Trains it if the cache does not hold it yet (``--retrain`` forces; about two minutes on 2 cores), then
writes benchmarks/results/demo_model.json (the run's settings, its summary, the evaluation curve and
completions at temperature 0 and 0.7) and demo_model.png (train and validation loss per step).

    python benchmarks/bench_demo_model.py [--retrain]
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

PROMPTS = ["def read_config(path):\n", "class Stack:\n    def push(self, item):\n", "import os\nimport sys\n\n",
           "    for i in range("]


def plot(rows, path):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.plot([r["step"] for r in rows["train"]], [r["loss"] for r in rows["train"]], lw=0.8, label="train (per step)")
    ax.plot([r["step"] for r in rows["val"]], [r["val_loss"] for r in rows["val"]], "o-", label="validation")
    ax.axhline(rows["unigram"], color="gray", ls="--", label="unigram entropy")
    ax.set_xlabel("step (2048 tokens)")
    ax.set_ylabel("next-token loss (nats)")
    ax.set_title("demo preset on the standard library, 2 CPU cores")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--retrain", action="store_true")
    args = parser.parse_args()
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
        "median_tokens_per_s": sorted(r["tokens_per_s"] for r in rows)[len(rows) // 2],
        "validation": [{"step": r["step"], "val_loss": r["val_loss"]} for r in val], "completions": completions,
    }, plot, {"train": rows, "val": val, "unigram": summary["unigram_entropy"]})


if __name__ == "__main__":
    main()
