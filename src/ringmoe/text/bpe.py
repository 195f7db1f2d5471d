"""Training a byte-level BPE tokenizer with the `tokenizers` library, ChatML-style special tokens and chat template.

``train_tokenizer(texts, vocab_size, folder)`` writes what ``Tokenizer`` (and transformers) read:
tokenizer.json, tokenizer_config.json (special tokens, chat template) and generation_config.json
(the end-of-sequence id).  ``ringmoe train`` and the demo's checkpoints use it.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["train_tokenizer", "SPECIAL", "CHAT_TEMPLATE", "MIN_VOCAB"]

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# the smallest byte-level BPE: its 256-byte alphabet and the special tokens
MIN_VOCAB = 256 + len(SPECIAL)


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
