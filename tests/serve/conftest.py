"""A small served checkpoint: a tiny Mixtral written by transformers with a real byte-level BPE tokenizer
(trained on the fly with `tokenizers` by the library's ``train_tokenizer``), a ChatML template and
generation_config's end-of-sequence id."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from ringmoe.demo_model import train_tokenizer

CORPUS = ["def add(a, b):\n    return a + b\n", "naïve café — 東京 🚀 déjà vu", "print('hello, world')\n",
          "for i in range(10):\n    total += i * i\n", "Größe: 12 €, ½ kg 🍣🍣",
          "The quick brown fox jumps over the lazy dog.", "Serving mixture-of-experts models across ranks."] * 20


def write_tokenizer(path) -> int:
    """A byte-level BPE of 384 tokens trained on CORPUS (ChatML template, EOS <|im_end|>); its vocabulary size."""
    from tokenizers import Tokenizer

    train_tokenizer(CORPUS, 384, path)
    return Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size()


@pytest.fixture(scope="session")
def served_checkpoint(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    path = tmp_path_factory.mktemp("served")
    vocab = write_tokenizer(path)
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                     intermediate_size=96, initializer_range=0.1)
    eos = json.loads((path / "generation_config.json").read_text())
    transformers.MixtralForCausalLM(cfg).save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps(eos))  # save_pretrained writes its own
    return path
