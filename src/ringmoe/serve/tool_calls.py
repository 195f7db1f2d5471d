"""Tool calls in a model's own syntax: the grammar that forces them, and the parser that reads them back.

Three syntaxes, chosen per checkpoint (``ringmoe serve --tool-call-parser``):

- ``hermes`` (Qwen, and the ChatML template of ``train_tokenizer``)::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

- ``deepseek_v3`` (DeepSeek-V3's special tokens)::

      <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
      ```json
      {"city": "Paris"}
      ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

- ``harmony`` (gpt-oss; its markers are special tokens, so it reads the output with them)::

      <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather
      <|constrain|>json<|message|>{"city": "Paris"}<|call|>

  one call per turn (``<|call|>`` ends the turn); the answer is the ``final`` channel's message.

``structural_tag(tools, choice, parallel)`` is the xgrammar structural tag (JSON) of a forced call:
``choice`` "required" (one call or more of any tool; exactly one when ``parallel`` is False) or a tool
name (exactly one call of it); the arguments follow each tool's JSON schema.  ``parse(text)`` splits
a finished output into (content before the calls, [ToolCall]); ``StreamParser`` does it on a stream,
passing content through until a call's opening marker and holding back text that may be its start.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

__all__ = ["ToolCall", "ToolCallFormat", "FORMATS", "StreamParser"]


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _function(tool: dict) -> dict:
    return tool["function"]


def _parameters(tool: dict) -> dict:
    return _function(tool).get("parameters") or {"type": "object", "properties": {}}


class ToolCallFormat:
    """A tool-call syntax: its markers, the structural tag that forces calls, the parser that reads them."""

    name = ""
    start = ""  # the marker a call (or the block of calls) begins with
    special_tokens = False  # the parser reads the output decoded with its special tokens (and streams whole)

    def structural_tag(self, tools: list[dict], choice: str, parallel: bool) -> str:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError

    def _content_and(self, text: str, calls: list[ToolCall]) -> tuple[str, list[ToolCall]]:
        """No call: the text is all content; else the content is what comes before the first call marker."""
        return (text[:text.index(self.start)].strip(), calls) if calls else (text, [])


def _tags(tools: list[dict], choice: str, begin, end: str) -> list[dict]:
    """One structural-tag ``tag`` per callable tool: ``begin(name)``, the arguments by its schema, ``end``."""
    return [{"type": "tag", "begin": begin(_function(t)["name"]), "end": end,
             "content": {"type": "json_schema", "json_schema": _parameters(t)}}
            for t in tools if choice == "required" or _function(t)["name"] == choice]


def _separated(tags: list[dict], separator: str, choice: str, parallel: bool) -> dict:
    """One call or more of ``tags``; exactly one for a named choice or without parallel calls."""
    return {"type": "tags_with_separator", "tags": tags, "separator": separator, "at_least_one": True,
            "stop_after_first": choice != "required" or not parallel}


def _json_calls(found: list[tuple[str, str]]) -> list[ToolCall]:
    """The (name, arguments) pairs whose arguments are JSON, as calls; the rest are not calls."""
    calls = []
    for name, arguments in found:
        try:
            json.loads(arguments)
        except (ValueError, RecursionError):  # (a model that loops on "[" nests too deeply to parse: no call)
            continue
        calls.append(ToolCall(name.strip(), arguments.strip()))
    return calls


class Hermes(ToolCallFormat):
    name, start = "hermes", "<tool_call>"
    _call = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def structural_tag(self, tools, choice, parallel):
        tags = _tags(tools, choice, lambda name: f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": ',
                     "}\n</tool_call>")
        return json.dumps({"type": "structural_tag", "format": _separated(tags, "\n", choice, parallel)})

    def parse(self, text):
        calls = []
        for body in self._call.findall(text):
            try:
                call = json.loads(body)
                name, arguments = call["name"], call.get("arguments", {})
            except (ValueError, KeyError, TypeError, RecursionError):
                continue  # not a call: it stays in the content
            if isinstance(name, str):
                calls.append(ToolCall(name, arguments if isinstance(arguments, str) else json.dumps(arguments)))
        return self._content_and(text, calls)


class DeepSeekV3(ToolCallFormat):
    name, start = "deepseek_v3", "<｜tool▁calls▁begin｜>"
    _call = re.compile(r"<｜tool▁call▁begin｜>function<｜tool▁sep｜>(.*?)\n```json\n(.*?)\n```<｜tool▁call▁end｜>", re.S)

    def structural_tag(self, tools, choice, parallel):
        tags = _tags(tools, choice, lambda name: f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n",
                     "\n```<｜tool▁call▁end｜>")
        return json.dumps({"type": "structural_tag", "format": {
            "type": "tag", "begin": self.start, "end": "<｜tool▁calls▁end｜>",
            "content": _separated(tags, "", choice, parallel)}})

    def parse(self, text):
        if self.start not in text:
            return text, []
        calls = _json_calls(self._call.findall(text))
        return self._content_and(text, calls)


class Harmony(ToolCallFormat):
    name, start, special_tokens = "harmony", "<|channel|>commentary to=functions.", True
    _call = re.compile(r"<\|channel\|>commentary to=functions\.([\w.-]+)\s*(?:<\|constrain\|>\s*json)?<\|message\|>"
                       r"(.*?)(?:<\|call\|>|$)", re.S)
    _final = re.compile(r"<\|channel\|>final<\|message\|>(.*?)(?:<\|return\|>|<\|end\|>|$)", re.S)
    _markup = re.compile(r"<\|(?:start|end|return|call|message|constrain|channel)\|>")

    def structural_tag(self, tools, choice, parallel):
        # the markers as the special tokens they are; the turn ends at <|call|> (an end-of-sequence id, not <|return|>)
        calls = [{"type": "sequence", "elements": [
            {"type": "token", "token": "<|channel|>"},
            {"type": "const_string", "value": f"commentary to=functions.{_function(t)['name']} "},
            {"type": "token", "token": "<|constrain|>"}, {"type": "const_string", "value": "json"},
            {"type": "token", "token": "<|message|>"},
            {"type": "json_schema", "json_schema": _parameters(t)},
            {"type": "token", "token": "<|call|>"}]}
            for t in tools if choice == "required" or _function(t)["name"] == choice]
        return json.dumps({"type": "structural_tag",
                           "format": calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}})

    def parse(self, text):
        calls = _json_calls(self._call.findall(text))
        final = self._final.search(text)
        if final is not None:
            content = final.group(1)
        elif "<|channel|>" in text:  # analysis or commentary only: no answer for the user
            content = ""
        else:
            content = self._markup.sub("", text)
        return content.strip() if calls else content, calls


FORMATS = {f.name: f for f in (Hermes(), DeepSeekV3(), Harmony())}


class StreamParser:
    """Content deltas of a streamed output with tool calls held back: ``feed(delta)`` returns the content to
    send now; once the call marker appears everything after it is kept, and ``finish()`` parses it."""

    def __init__(self, syntax: ToolCallFormat):
        self.syntax, self.text, self.sent = syntax, "", 0
        self.in_calls = syntax.special_tokens  # markers the text deltas do not show: everything waits for the end

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.in_calls:
            return ""
        marker = self.text.find(self.syntax.start, self.sent)
        if marker >= 0:
            self.in_calls = True
            out, self.sent = self.text[self.sent:marker], marker
            return out
        # hold back a tail that could be the start of the marker
        hold = next((k for k in range(min(len(self.syntax.start) - 1, len(self.text) - self.sent), 0, -1)
                     if self.syntax.start.startswith(self.text[-k:])), 0)
        out = self.text[self.sent:len(self.text) - hold]
        self.sent += len(out)
        return out

    def finish(self, special_text: str | None = None) -> tuple[str, list[ToolCall]]:
        """(content not sent yet, the calls).  special_text: the whole output decoded with its special tokens
        (what a ``special_tokens`` syntax parses)."""
        if self.syntax.special_tokens:
            return self.syntax.parse(special_text if special_text is not None else self.text)
        content, calls = self.syntax.parse(self.text)
        if calls:
            return content[self.sent:] if len(content) > self.sent else "", calls
        return self.text[self.sent:], []
