"""A small served checkpoint: a tiny Mixtral written by transformers with a real byte-level BPE tokenizer
(trained on the fly with `tokenizers`), a chat template and generation_config's end-of-sequence id."""

from __future__ import annotations

import json
import logging

import pytest
import torch

CORPUS = ["def add(a, b):\n    return a + b\n", "naïve café — 東京 🚀 déjà vu", "print('hello, world')\n",
          "for i in range(10):\n    total += i * i\n", "Größe: 12 €, ½ kg 🍣🍣",
          "The quick brown fox jumps over the lazy dog.", "Serving mixture-of-experts models across ranks."] * 20
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def write_tokenizer(path) -> int:
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "chat_template": TEMPLATE}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    return tok.get_vocab_size()


@pytest.fixture(scope="session")
def served_checkpoint(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    path = tmp_path_factory.mktemp("served")
    vocab = write_tokenizer(path)
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                     intermediate_size=96, initializer_range=0.1, eos_token_id=0)
    transformers.MixtralForCausalLM(cfg).save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    return path
