"""Response bodies and stream chunks of one HTTP request, in OpenAI's shapes (and vLLM's extras).

A request holds P prompts (a /v1/completions batch; chat has one) and n samples of each: choice
``index = prompt * n + sample``, in that order (OpenAI's and vLLM's rule).  ``echo`` puts the prompt's
text (and, with ``logprobs``, its tokens, first logprob None) before each choice's output;
``text_offset`` is each token's character offset in the choice's text.  ``prompt_logprobs`` (vLLM)
lists, per prompt position, None then {token id: {"logprob", "rank", "decoded_token"}}.  Chat choices
whose output holds tool calls (parsed by the request's ``ToolCallFormat``) answer ``tool_calls`` with
``finish_reason: "tool_calls"``; streamed, the call arrives as OpenAI sends it (id, type and name
first, then the arguments).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from .request import RequestOutput
from .sampling import TokenChoice
from .tool_calls import StreamParser, ToolCallFormat

__all__ = ["ResponseBuilder", "Prompt"]


@dataclass
class Prompt:
    ids: list[int]
    text: str  # what echo returns


@dataclass
class _Choice:
    """What one choice has gathered so far."""

    logprobs: list[TokenChoice] = field(default_factory=list)
    prompt_logprobs: list | None = None
    parser: StreamParser | None = None
    started: bool = False


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class ResponseBuilder:
    """chat: /v1/chat/completions (else /v1/completions).  decode: ids -> text.  prompts: the request's
    prompts.  n: samples per prompt.  echo / logprobs / prompt_logprobs: what the request asked for
    (logprobs None: none).  tools: the tool-call syntax when the output may hold calls, else None."""

    def __init__(self, chat: bool, model: str, decode, prompts: list[Prompt], n: int = 1, echo: bool = False,
                 logprobs: int | None = None, prompt_logprobs: bool = False, tools: ToolCallFormat | None = None):
        self.chat, self.model, self.decode, self.prompts, self.n = chat, model, decode, prompts, n
        self.echo, self.logprobs, self.want_prompt_logprobs, self.tools = echo, logprobs, prompt_logprobs, tools
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.choices = [_Choice(parser=StreamParser(tools) if tools else None) for _ in range(len(prompts) * n)]
        self.completion_tokens = 0

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p.ids) for p in self.prompts)

    def index(self, prompt: int, out: RequestOutput) -> int:
        return prompt * self.n + out.index

    def _head(self, chunk: bool) -> dict:
        kind = self.object + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def add(self, prompt: int, out: RequestOutput) -> int:
        """Take one output of prompt ``prompt``; the choice index it belongs to."""
        choice = self.choices[self.index(prompt, out)]
        choice.logprobs += out.logprobs
        if out.prompt_logprobs is not None:
            choice.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            self.completion_tokens += len(out.output_ids)
        return self.index(prompt, out)

    # -- logprobs ---------------------------------------------------------------------------------
    def _token(self, token: int) -> str:
        return self.decode([token])

    def _top(self, top: list[tuple[int, float]]) -> dict:
        """{token text: logprob}; a token whose text another one already has (partial UTF-8 bytes decode
        alike) is keyed by its id as "<id>" so no alternative is lost."""
        out = {}
        for token, logprob in top:
            text = self._token(token)
            out[text if text not in out else f"<{token}>"] = logprob
        return out

    def _chat_logprobs(self, choices: list[TokenChoice]) -> dict | None:
        if self.logprobs is None:
            return None
        content = []
        for c in choices:
            token = self._token(c.token)
            content.append({"token": token, "logprob": c.logprob, "bytes": list(token.encode()),
                            "top_logprobs": [{"token": self._token(t), "logprob": lp,
                                              "bytes": list(self._token(t).encode())} for t, lp in c.top]})
        return {"content": content}

    def _completion_logprobs(self, choices: list, offset: int = 0) -> dict | None:
        """OpenAI's completions logprobs of ``choices`` (TokenChoice, or None for a prompt's first token)."""
        if self.logprobs is None:
            return None
        tokens, offsets = [], []
        for c in choices:
            offsets.append(offset)
            tokens.append(self._token(c.token))
            offset += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": [c.logprob if c.logprob is not None else None for c in choices],
                "top_logprobs": [self._top(c.top) if c.logprob is not None else None for c in choices],
                "text_offset": offsets}

    def _echo_choices(self, prompt: int, choice: _Choice) -> list[TokenChoice]:
        """The prompt's tokens as logprob entries: the first has logprob None (nothing precedes it)."""
        ids, recorded = self.prompts[prompt].ids, choice.prompt_logprobs or []
        entries = [TokenChoice(ids[0], None, [])]
        entries += [c if c is not None else TokenChoice(t, None, []) for t, c in zip(ids[1:], recorded[1:])]
        return entries

    def _vllm_prompt_logprobs(self, choice: _Choice) -> list | None:
        if not self.want_prompt_logprobs or choice.prompt_logprobs is None:
            return None
        out = []
        for c in choice.prompt_logprobs:
            if c is None:
                out.append(None)
                continue
            entry = {str(c.token): {"logprob": c.logprob, "rank": c.rank, "decoded_token": self._token(c.token)}}
            for rank, (token, logprob) in enumerate(c.top, 1):
                entry.setdefault(str(token), {"logprob": logprob, "rank": rank, "decoded_token": self._token(token)})
            out.append(entry)
        return out

    # -- whole responses --------------------------------------------------------------------------
    def final(self, finals: dict[int, RequestOutput]) -> dict:
        """The response body once every choice has finished (``finals``: choice index -> last output)."""
        choices = []
        for index in range(len(self.choices)):
            out, choice, prompt = finals[index], self.choices[index], index // self.n
            body = {"index": index, "finish_reason": out.finish_reason}
            if self.chat:
                body["message"] = self._message(out, body)
                body["logprobs"] = self._chat_logprobs(choice.logprobs)
            else:
                head = self.prompts[prompt].text if self.echo else ""
                body["text"] = head + out.text
                entries = (self._echo_choices(prompt, choice) if self.echo else []) + choice.logprobs
                body["logprobs"] = self._completion_logprobs(entries)
                if self.want_prompt_logprobs:
                    body["prompt_logprobs"] = self._vllm_prompt_logprobs(choice)
            choices.append(body)
        return {**self._head(False), "choices": choices, "usage": _usage(self.prompt_tokens, self.completion_tokens)}

    def _message(self, out: RequestOutput, body: dict) -> dict:
        message = {"role": "assistant", "content": out.text}
        if self.tools is not None:
            content, calls = self.tools.parse(self.decode(out.output_ids) if self.tools.special_tokens else out.text)
            message["content"] = content
            if calls:
                message = {"role": "assistant", "content": content or None,
                           "tool_calls": [c.to_openai() for c in calls]}
                if body["finish_reason"] == "stop":
                    body["finish_reason"] = "tool_calls"
        return message

    # -- streams ------------------------------------------------------------------------------------
    def first_chunks(self) -> list[dict]:
        """Chat streams open with the assistant role of every choice; echoed completions with the prompt."""
        if self.chat:
            return [{**self._head(True), "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                      "logprobs": None, "finish_reason": None}]}
                    for i in range(len(self.choices))]
        if self.echo:
            return [{**self._head(True), "choices": [{"index": i, "text": self.prompts[i // self.n].text,
                                                      "logprobs": None, "finish_reason": None}]}
                    for i in range(len(self.choices))]
        return []

    def chunks(self, prompt: int, out: RequestOutput) -> list[dict]:
        """The stream chunks of one output (usually one; a finished tool call adds its own)."""
        index = self.add(prompt, out)
        if not self.chat:
            choice = {"index": index, "text": out.text_delta, "logprobs": self._completion_logprobs(out.logprobs),
                      "finish_reason": out.finish_reason}
            return [{**self._head(True), "choices": [choice]}]
        parser = self.choices[index].parser
        text = parser.feed(out.text_delta) if parser is not None else out.text_delta
        chunks, reason = [], out.finish_reason
        if out.finished and parser is not None:
            rest, calls = parser.finish(self.decode(out.output_ids) if self.tools.special_tokens else None)
            text += rest
            for position, call in enumerate(calls):
                head = {"index": position, "id": call.id, "type": "function",
                        "function": {"name": call.name, "arguments": ""}}
                chunks.append({"tool_calls": [head]})
                chunks.append({"tool_calls": [{"index": position, "function": {"arguments": call.arguments}}]})
            if calls and reason == "stop":
                reason = "tool_calls"
        delta = {"content": text} if text else {}
        logprobs = self._chat_logprobs(out.logprobs)
        bodies = [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}]
        bodies += [{"index": index, "delta": d, "logprobs": None, "finish_reason": None} for d in chunks]
        bodies[-1]["finish_reason"] = reason
        return [{**self._head(True), "choices": [b]} for b in bodies if b["delta"] or b["finish_reason"] or b["logprobs"]]

    def usage_chunk(self) -> dict:
        return {**self._head(True), "choices": [], "usage": _usage(self.prompt_tokens, self.completion_tokens)}
