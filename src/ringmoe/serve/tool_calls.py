"""Tool calls in a model's own syntax: the grammar that forces them, and the parser that reads them back.

Two syntaxes, chosen per checkpoint (``ringmoe serve --tool-call-parser``):

- ``hermes`` (Qwen, and the ChatML template of ``train_tokenizer``)::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

- ``deepseek_v3`` (DeepSeek-V3's special tokens)::

      <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
      ```json
      {"city": "Paris"}
      ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

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

    def structural_tag(self, tools: list[dict], choice: str, parallel: bool) -> str:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError


class Hermes(ToolCallFormat):
    name, start = "hermes", "<tool_call>"
    _call = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def structural_tag(self, tools, choice, parallel):
        tags = [{"type": "tag", "begin": f'<tool_call>\n{{"name": {json.dumps(_function(t)["name"])}, "arguments": ',
                 "content": {"type": "json_schema", "json_schema": _parameters(t)}, "end": "}\n</tool_call>"}
                for t in tools if choice == "required" or _function(t)["name"] == choice]
        one = choice != "required" or not parallel
        return json.dumps({"type": "structural_tag", "format": {
            "type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
            "stop_after_first": one}})

    def parse(self, text):
        calls = []
        for body in self._call.findall(text):
            try:
                call = json.loads(body)
                name, arguments = call["name"], call.get("arguments", {})
            except (ValueError, KeyError, TypeError):
                continue  # not a call: it stays in the content
            if isinstance(name, str):
                calls.append(ToolCall(name, arguments if isinstance(arguments, str) else json.dumps(arguments)))
        if not calls:
            return text, []
        return text[:text.index(self.start)].strip(), calls


class DeepSeekV3(ToolCallFormat):
    name, start = "deepseek_v3", "<｜tool▁calls▁begin｜>"
    _call = re.compile(r"<｜tool▁call▁begin｜>function<｜tool▁sep｜>(.*?)\n```json\n(.*?)\n```<｜tool▁call▁end｜>", re.S)

    def structural_tag(self, tools, choice, parallel):
        tags = [{"type": "tag", "begin": f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{_function(t)['name']}\n```json\n",
                 "content": {"type": "json_schema", "json_schema": _parameters(t)}, "end": "\n```<｜tool▁call▁end｜>"}
                for t in tools if choice == "required" or _function(t)["name"] == choice]
        one = choice != "required" or not parallel
        return json.dumps({"type": "structural_tag", "format": {
            "type": "tag", "begin": self.start, "end": "<｜tool▁calls▁end｜>",
            "content": {"type": "tags_with_separator", "tags": tags, "separator": "", "at_least_one": True,
                        "stop_after_first": one}}})

    def parse(self, text):
        if self.start not in text:
            return text, []
        calls = []
        for name, arguments in self._call.findall(text):
            try:
                json.loads(arguments)
            except ValueError:
                continue
            calls.append(ToolCall(name.strip(), arguments))
        if not calls:
            return text, []
        return text[:text.index(self.start)].strip(), calls


FORMATS = {f.name: f for f in (Hermes(), DeepSeekV3())}


class StreamParser:
    """Content deltas of a streamed output with tool calls held back: ``feed(delta)`` returns the content to
    send now; once the call marker appears everything after it is kept, and ``finish()`` parses it."""

    def __init__(self, syntax: ToolCallFormat):
        self.syntax, self.text, self.sent, self.in_calls = syntax, "", 0, False

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

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not sent yet, the calls)."""
        content, calls = self.syntax.parse(self.text)
        if calls:
            return content[self.sent:] if len(content) > self.sent else "", calls
        return self.text[self.sent:], []
