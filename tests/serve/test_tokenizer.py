"""A real byte-level BPE built with `tokenizers` on the fly: chat templates, UTF-8-safe streaming, stop strings."""

from __future__ import annotations

import json

import pytest
import torch

from ringmoe.model import MoETransformer, preset
from ringmoe.serve import Engine, IncrementalDetokenizer, SamplingParams, Tokenizer

CORPUS = ["def add(a, b):\n    return a + b\n", "naïve café — 東京 🚀 déjà vu", "print('hello, world')\n",
          "for i in range(10):\n    total += i * i\n", "Größe: 12 €, ½ kg 🍣🍣"] * 20
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    path = tmp_path_factory.mktemp("tok")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "chat_template": TEMPLATE}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    return path


def test_round_trip_eos_and_chat_template(folder):
    tok = Tokenizer(folder)
    text = CORPUS[1]
    assert tok.decode(tok.encode(text)) == text
    assert tok.eos_token_ids == (0,)
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|user|>hi<eos><|assistant|>"
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        tok.apply_chat_template([{"content": "no role"}])


def test_streaming_never_emits_a_broken_character(folder):
    tok = Tokenizer(folder)
    for text in CORPUS[:5]:
        ids = tok.encode(text)
        stream = IncrementalDetokenizer(tok)
        deltas = [stream.add(i) for i in ids] + [stream.flush()]
        assert "".join(deltas) == tok.decode(ids) == text
        assert not any("\ufffd" in d for d in deltas)
    # single bytes of a 4-byte emoji: nothing until the character is whole
    emoji = [i for i in tok.encode("🚀")]
    stream = IncrementalDetokenizer(tok)
    assert "".join(stream.add(i) for i in emoji) == "🚀"


def test_stop_strings_across_token_boundaries_and_streamed_text(folder):
    tok = Tokenizer(folder)
    model = MoETransformer(preset("tiny").replace(vocab_size=tok.vocab_size)).double()
    model.init_weights(4, std=0.5)
    engine = Engine(model, tokenizer=tok, block_size=4)
    prompt = "def add(a, b):"
    free = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.text) > 6
    pieces = [tok.decode([i]) for i in free.output_ids]
    # a stop string that starts inside one token and ends inside a later one
    start = len(pieces[0]) + len(pieces[1]) - 1
    stop = free.text[start:start + 3]
    assert len(stop) == 3 and free.text.index(stop) >= start - 3
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=24, stop=[stop], ignore_eos=True))
    streamed, final = "", None
    while engine.has_unfinished:
        for out in engine.step():
            streamed += out.text_delta
            final = out
    assert final.request_id == rid and final.finish_reason == "stop"
    assert final.text == free.text[:free.text.index(stop)] == streamed
    assert stop not in streamed
