"""A real byte-level BPE built with `tokenizers` on the fly: chat templates, UTF-8-safe streaming, stop strings."""

from __future__ import annotations

import pytest

from ringmoe.model import MoETransformer, preset
from ringmoe.serve import Engine, SamplingParams
from ringmoe.text import IncrementalDetokenizer, Tokenizer

from ..served import CORPUS, write_tokenizer


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(path)
    return path


def test_round_trip_eos_and_chat_template(folder):
    tok = Tokenizer(folder)
    text = CORPUS[1]
    assert tok.decode(tok.encode(text)) == text
    assert tok.eos_token_ids == (tok.backend.token_to_id("<|im_end|>"),)
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
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


def test_min_tokens_is_a_floor_on_the_encoding(folder):
    import random

    tok = Tokenizer(folder)
    rng = random.Random(7)
    alphabet = "".join(CORPUS) + "<|im_start|><|im_end|>"
    texts = list(CORPUS) + ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3000))) for _ in range(50)]
    texts += ["    " * 400, "<|im_end|>" * 30, "é" * 999]
    for text in texts:
        assert tok.min_tokens(text) <= len(tok.encode(text, add_special_tokens=False)), text[:40]
    assert tok.min_tokens("x" * 10**6) > 10**6 // 100  # and it is not vacuous
