"""Tool-call syntaxes: a forced call (the structural tag through the grammar backend) always parses back into a
call whose arguments match the function's schema; the parsers read calls whole and streamed; the served
model's default name."""

from __future__ import annotations

import json

import pytest

from ringmoe.serve import Engine, SamplingParams
from ringmoe.serve.service import ServeOptions
from ringmoe.serve.tool_calls import FORMATS, StreamParser

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer",
                                                                                        "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {},
                                                                          "additionalProperties": False}}}]


@pytest.mark.parametrize("syntax", sorted(FORMATS))
@pytest.mark.parametrize("choice, parallel", [("required", True), ("required", False), ("get_weather", True)])
def test_forced_calls_always_parse_and_match_the_schema(served_checkpoint, harmony_checkpoint, syntax, choice,
                                                        parallel):
    pytest.importorskip("xgrammar")
    jsonschema = pytest.importorskip("jsonschema")
    from ringmoe.serve.structured import GrammarBackend, GrammarSpec

    engine = Engine.from_checkpoint(harmony_checkpoint if syntax == "harmony" else served_checkpoint)
    backend = GrammarBackend(engine.tokenizer, engine.model.config.vocab_size, engine.eos_ids)
    fmt = FORMATS[syntax]
    grammar = backend.compile(GrammarSpec("structural_tag", fmt.structural_tag(TOOLS, choice, parallel)))
    outs = engine.generate(["call a tool"] * 4, [SamplingParams(grammar=grammar, seed=s, max_tokens=400)
                                                  for s in range(4)])
    for out in outs:
        assert out.finish_reason == "stop", out.text
        text = engine.tokenizer.decode(out.output_ids, skip_special_tokens=False) if fmt.special_tokens else out.text
        content, calls = fmt.parse(text)
        assert content == "" and calls, text
        if fmt.special_tokens:  # the markers are the special tokens themselves, not their spelling in bytes
            markers = {engine.tokenizer.backend.token_to_id(t) for t in ("<|channel|>", "<|message|>", "<|call|>")}
            assert markers <= set(out.output_ids)
        if not parallel or choice != "required" or syntax == "harmony":
            assert len(calls) == 1
        for call in calls:
            assert call.name in ({"get_weather", "noop"} if choice == "required" else {choice})
            jsonschema.validate(json.loads(call.arguments), WEATHER if call.name == "get_weather" else {})


def test_parsers_read_calls_and_leave_other_text_alone():
    hermes, deepseek = FORMATS["hermes"], FORMATS["deepseek_v3"]
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n' \
           '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'
    content, calls = hermes.parse(text)
    assert content == "Let me check." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("noop", {})]
    assert hermes.parse("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert hermes.parse("plain text") == ("plain text", [])
    ds = ("Sure<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
          '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    content, calls = deepseek.parse(ds)
    assert content == "Sure" and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Paris"}
    assert len({c.id for c in hermes.parse(text)[1]}) == 2  # ids are unique
    harmony = FORMATS["harmony"]
    turn = ("<|channel|>analysis<|message|>The user wants weather.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>')
    content, calls = harmony.parse(turn)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    answer = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.<|return|>"
    assert harmony.parse(answer) == ("Sunny.", [])


def test_a_call_nested_too_deeply_to_parse_is_no_call():
    """A model looping on "[" inside a call: arguments too deep for the JSON parser (RecursionError, not a
    ValueError) make no call, whole or streamed, in every syntax; the text stays content (harmony: a commentary
    message is never content)."""
    deep = "[" * 5000 + "]" * 5000
    texts = {"hermes": f'<tool_call>{{"name": "f", "arguments": {deep}}}</tool_call>',
             "deepseek_v3": f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{deep}\n```"
                            "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
             "harmony": f"<|channel|>commentary to=functions.f <|constrain|>json<|message|>{deep}<|call|>"}
    for name, text in texts.items():
        content, calls = FORMATS[name].parse(text)
        assert calls == [] and (deep in content) == (name != "harmony"), name
        parser = StreamParser(FORMATS[name])
        sent = "".join(parser.feed(text[i:i + 997]) for i in range(0, len(text), 997))
        rest, calls = parser.finish()
        assert calls == [] and (deep in sent + rest) == (name != "harmony"), name


@pytest.mark.parametrize("cut", [1, 3, 7])
def test_stream_parser_holds_back_a_possible_marker(cut):
    text = 'Hello <tool world <tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'
    parser = StreamParser(FORMATS["hermes"])
    sent = "".join(parser.feed(text[i:i + cut]) for i in range(0, len(text), cut))
    rest, calls = parser.finish()
    assert sent + rest == "Hello <tool world " and [c.name for c in calls] == ["noop"]
    plain = StreamParser(FORMATS["hermes"])
    sent = "".join(plain.feed(part) for part in ["a <tool", "s> b <", "tool_"])
    assert sent + plain.finish()[0] == "a <tools> b <tool_" and plain.finish()[1] == []


def test_default_served_name(tmp_path):
    run = tmp_path / "my-run" / "hf"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"model_type": "mixtral", "_name_or_path": str(run)}))
    assert ServeOptions(model=str(run)).name == "my-run"  # a training export is named after its run
    named = tmp_path / "snapshot"
    named.mkdir()
    (named / "config.json").write_text(json.dumps({"model_type": "deepseek_v3",
                                                   "_name_or_path": "deepseek-ai/DeepSeek-V3"}))
    assert ServeOptions(model=str(named)).name == "deepseek-ai/DeepSeek-V3"
    assert ServeOptions(model=str(named), served_model_name="x").name == "x"
    assert ServeOptions(model=str(named)).tool_parser() == "deepseek_v3"
    assert ServeOptions(model=str(run)).tool_parser() == "hermes"
    assert ServeOptions(model=str(run), tool_call_parser="none").tool_parser() is None
    (named / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    assert ServeOptions(model=str(named)).tool_parser() == "harmony" and ServeOptions(model=str(named)).name == "snapshot"
