"""Self-made checkpoints for the demo and the serving benchmark: no download needed.

A byte-level BPE tokenizer is trained with the `tokenizers` library on the standard library's own
Python sources (present on every machine with Python), with ChatML-style special tokens and chat
template.  ``build_demo_checkpoint``: a preset with random weights (the serving benchmark and the tests:
the machinery is what they measure), written by ``save_pretrained`` so transformers loads it too.
``trained_demo_checkpoint``: the "demo" preset trained by ``ringmoe train`` on those sources for about
two minutes on 2 cores (what ``make demo`` serves: a model that writes Python-looking text).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..model import MoETransformer, preset, save_pretrained
from ..text import stdlib_texts, train_tokenizer
from ..train.data import PackedStream
from ..train.run import TrainOptions, run_training

__all__ = ["build_demo_checkpoint", "trained_demo_checkpoint", "DEMO_TRAINING", "MTP_TRAINING", "default_cache"]


def default_cache() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "ringmoe"


def build_demo_checkpoint(folder: str | Path | None = None, preset_name: str = "small", seed: int = 0,
                          rebuild: bool = False) -> Path:
    """The checkpoint folder (built once, then reused): tokenizer + random ``preset_name`` weights."""
    folder = Path(folder) if folder is not None else default_cache() / f"demo-{preset_name}-seed{seed}"
    done = folder / ".complete"
    if done.is_file() and not rebuild:
        return folder
    building = folder.with_name(folder.name + ".building")
    shutil.rmtree(building, ignore_errors=True)
    building.mkdir(parents=True)
    config = preset(preset_name)
    eos = train_tokenizer(stdlib_texts(), config.vocab_size, building)
    model = MoETransformer(config)
    model.init_weights(seed)
    save_pretrained(model, building, eos_token_id=eos)
    (building / ".complete").write_text("ok\n")
    shutil.rmtree(folder, ignore_errors=True)
    building.replace(folder)  # appears whole or not at all
    return folder


# The demo model's training run: 900 steps of 2048 tokens (~1.8M tokens, ~2 minutes on 2 cores) in sequences of 256,
# a BPE vocabulary of 384.  The recorded sweeps (benchmarks/bench_demo_model.py --sweep) chose each part: at 500
# steps a vocabulary of 384 reaches 0.74x its unigram entropy where 1024 reaches 0.82x (bytes alone, 259, learn
# slowest); lr 2e-3 (5e-3 stalls with the router collapsed, 1e-3 and 3e-3 are no better); a balancing-loss weight of
# 0.1 (0.3 and 1.0 cost loss and balance the experts no better, 0.01 leaves them at 1.7); sequences of 256 tokens
# (128 and 512 end higher); more steps pay until the end.  What moved the loss most is the data's order: steps
# drawn from the whole corpus rather than one file after another (``PackedStream``), 0.67x -> 0.48x.
DEMO_TRAINING = dict(preset="demo", vocab_size=384, seqlen=256, tokens_per_step=2048, steps=900, lr=2e-3,
                     aux_coef=0.1, warmup=20, balance="aux", eval_every=150, save_every=900, log_every=50,
                     eval_sequences=32)


# the demo's recipe on the demo's size in DeepSeek-V3's form, with its multi-token prediction module, for longer (the
# MTP speculative-decoding benchmark's model: benchmarks/bench_spec.py --only mtp; about 5 minutes on 2 cores); its
# held-out figures over 32 sequences
MTP_TRAINING = {**DEMO_TRAINING, "preset": "deepseek-v3-demo", "mtp": True, "steps": 1500, "eval_every": 300,
                "save_every": 1500}


def trained_demo_checkpoint(folder: str | Path | None = None, retrain: bool = False, console=None,
                            training: dict | None = None) -> Path:
    """The trained demo model's transformers folder (trained once, then reused; ``retrain`` trains anew).

    ``training``: TrainOptions fields (default ``DEMO_TRAINING``); a cached model trained with other fields is
    trained anew.
    Trains in ``folder.building`` and renames it when done, so an interrupted run never leaves a
    half-trained model in the cache.  Returns ``folder / "hf"``.
    """
    folder = Path(folder) if folder is not None else default_cache() / "demo-trained"
    done = folder / ".complete"
    # the stamp names the data order too: a model trained on the stream's earlier order is trained anew
    recipe = json.dumps({**(training or DEMO_TRAINING), "data_order": PackedStream.ORDER}, sort_keys=True) + "\n"
    if done.is_file() and done.read_text() == recipe and not retrain:  # a model of an older recipe is trained anew
        return folder / "hf"
    building = folder.with_name(folder.name + ".building")
    shutil.rmtree(building, ignore_errors=True)
    building.parent.mkdir(parents=True, exist_ok=True)
    result = run_training(TrainOptions(out=str(building), **(training or DEMO_TRAINING)), console)
    result["hf"] = str(folder / "hf")  # where it lives once renamed
    (building / "summary.json").write_text(json.dumps(result, indent=2))
    (building / ".complete").write_text(recipe)
    shutil.rmtree(folder, ignore_errors=True)
    building.replace(folder)
    return folder / "hf"
