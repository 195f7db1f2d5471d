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
# ChatML with Hermes-style tools (Qwen's convention): the tool definitions in a system block, calls as
# <tool_call>{"name": ..., "arguments": {...}}</tool_call>, results back as <tool_response> in a user turn
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions. The functions:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n\nFor each call, return a JSON object "
    "within <tool_call></tool_call> tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\n</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' and tools and loop.first %}"
    "{% elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{% if m.content %}{{ m.content }}\n"
    "{% endif %}{% for call in m.tool_calls %}<tool_call>\n{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
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
