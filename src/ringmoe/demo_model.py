"""A self-made checkpoint for the demo and the serving benchmark: no download needed.

A byte-level BPE tokenizer is trained with the `tokenizers` library on the standard library's own
Python sources (present on every machine with Python), with ChatML-style special tokens and chat
template; the model is a preset with random weights, written by ``save_pretrained`` so transformers
loads it too.  The weights are random: the text it writes is noise until it is trained.
"""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

__all__ = ["build_demo_checkpoint", "stdlib_texts", "train_tokenizer", "default_cache"]

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def default_cache() -> Path:
    import os

    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "ringmoe"


def stdlib_texts(max_bytes: int = 4_000_000) -> list[str]:
    """The standard library's .py files, in name order, up to ``max_bytes`` in all."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for file in sorted(root.rglob("*.py")):
        if "site-packages" in file.parts or "test" in file.parts:
            continue
        try:
            text = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return texts


def train_tokenizer(texts: list[str], vocab_size: int, folder: Path) -> int:
    """Train a byte-level BPE on ``texts``; write tokenizer.json, tokenizer_config.json, generation_config.json.

    Returns the end-of-sequence id.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    eos = tokenizer.token_to_id("<|im_end|>")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE,
        "model_max_length": 131072, "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "do_sample": False}, indent=2))
    return eos


def build_demo_checkpoint(folder: str | Path | None = None, preset_name: str = "small", seed: int = 0,
                          rebuild: bool = False) -> Path:
    """The checkpoint folder (built once, then reused): tokenizer + random ``preset_name`` weights."""
    from .model import MoETransformer, preset, save_pretrained

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
