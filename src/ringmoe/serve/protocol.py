"""OpenAI's request and response shapes for /v1/completions and /v1/chat/completions.

Requests are pydantic models (unknown fields are ignored, as OpenAI-compatible servers do; wrong
types are 400 errors naming the field).  ``sampling_params`` maps a request onto ``SamplingParams``
(OpenAI's fields plus the vLLM extras top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
stop_token_ids).  The builders below produce the response and streaming-chunk dicts.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .request import RequestOutput
from .sampling import SamplingParams

__all__ = ["CompletionRequest", "ChatCompletionRequest", "sampling_params", "chat_messages", "error_body",
           "RequestError", "ROLES"]


class RequestError(ValueError):
    """A client error: HTTP ``status``, OpenAI error ``type`` and the offending ``param``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.kind, self.code = param, status, kind, code


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    user: str | None = None
    # vLLM's extras
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None


class CompletionRequest(_Common):
    prompt: str | list[int]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


ROLES = ("system", "developer", "user", "assistant", "tool")


class ContentPart(BaseModel):
    """One part of a message's content: OpenAI's {"type": "text", "text": ...}; other types are refused."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """A chat message: one of the template's roles, text content (a string or text parts), an optional name."""

    model_config = ConfigDict(extra="forbid")

    role: Literal[ROLES]
    content: str | list[ContentPart]
    name: str | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


def chat_messages(request: "ChatCompletionRequest") -> list[dict]:
    """The messages as the template sees them: {"role", "content": str[, "name"]}.  Text parts are joined
    with newlines (as vLLM does); image, audio and file parts are refused: this server reads text."""
    messages = []
    for i, message in enumerate(request.messages):
        content = message.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text":
                    raise RequestError(f"messages[{i}].content[{j}]: content parts of type {part.type!r} are not "
                                       f"supported (this model reads text)", f"messages.{i}.content.{j}.type")
                if part.text is None:
                    raise RequestError(f"messages[{i}].content[{j}]: a text part needs 'text'",
                                       f"messages.{i}.content.{j}.text")
                texts.append(part.text)
            content = "\n".join(texts)
        entry = {"role": message.role, "content": content}
        if message.name is not None:
            entry["name"] = message.name
        messages.append(entry)
    return messages


def sampling_params(request: _Common, default_max_tokens: int) -> SamplingParams:
    """The engine's parameters for a request; RequestError naming the field when they do not make sense."""
    if request.n != 1:
        raise RequestError(f"n={request.n} is not supported: this server returns one choice per request", "n")
    if isinstance(request, ChatCompletionRequest):
        max_tokens = request.max_completion_tokens or request.max_tokens
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        if request.top_logprobs and not request.logprobs:
            raise RequestError("top_logprobs needs logprobs=true", "top_logprobs")
    else:
        max_tokens, logprobs = request.max_tokens, request.logprobs
        if request.echo:
            raise RequestError("echo=true is not supported", "echo")
    try:
        return SamplingParams(
            temperature=request.temperature, top_p=request.top_p, top_k=request.top_k, min_p=request.min_p,
            seed=request.seed, presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty, repetition_penalty=request.repetition_penalty,
            stop=tuple([request.stop] if isinstance(request.stop, str) else request.stop or ()),
            stop_token_ids=tuple(request.stop_token_ids or ()), max_tokens=max_tokens or default_max_tokens,
            min_tokens=request.min_tokens, ignore_eos=request.ignore_eos, logprobs=logprobs,
        )
    except ValueError as error:  # SamplingParams names the field first
        raise RequestError(str(error), str(error).split()[0]) from None


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class ResponseBuilder:
    """Response bodies and stream chunks of one request."""

    def __init__(self, chat: bool, model: str, prompt_tokens: int, decode):
        self.chat, self.model, self.prompt_tokens, self.decode = chat, model, prompt_tokens, decode
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _head(self, chunk: bool) -> dict:
        kind = self.object + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _logprobs(self, choices) -> dict | None:
        if not choices:
            return None
        if self.chat:
            content = []
            for c in choices:
                token = self.decode([c.token])
                content.append({"token": token, "logprob": c.logprob, "bytes": list(token.encode()),
                                "top_logprobs": [{"token": self.decode([t]), "logprob": lp,
                                                  "bytes": list(self.decode([t]).encode())} for t, lp in c.top]})
            return {"content": content}
        return {"tokens": [self.decode([c.token]) for c in choices], "token_logprobs": [c.logprob for c in choices],
                "top_logprobs": [self._top(c.top) for c in choices]}

    def _top(self, top: list[tuple[int, float]]) -> dict:
        """{token text: logprob}; a token whose text another one already has (partial UTF-8 bytes decode
        alike) is keyed by its id as "<id>" so no alternative is lost."""
        out = {}
        for token, logprob in top:
            text = self.decode([token])
            out[text if text not in out else f"<{token}>"] = logprob
        return out

    def final(self, text: str, finish_reason: str, completion_tokens: int, logprobs: list) -> dict:
        choice = {"index": 0, "finish_reason": finish_reason, "logprobs": self._logprobs(logprobs)}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**self._head(False), "choices": [choice], "usage": _usage(self.prompt_tokens, completion_tokens)}

    def first_chunk(self) -> dict | None:
        """Chat streams open with the assistant role."""
        if not self.chat:
            return None
        return {**self._head(True), "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}]}

    def chunk(self, out: RequestOutput) -> dict:
        logprobs = self._logprobs(out.logprobs)
        if self.chat:
            choice = {"index": 0, "delta": {"content": out.text_delta} if out.text_delta or not out.finished else {},
                      "logprobs": logprobs, "finish_reason": out.finish_reason}
        else:
            choice = {"index": 0, "text": out.text_delta, "logprobs": logprobs, "finish_reason": out.finish_reason}
        return {**self._head(True), "choices": [choice]}

    def usage_chunk(self, completion_tokens: int) -> dict:
        return {**self._head(True), "choices": [], "usage": _usage(self.prompt_tokens, completion_tokens)}
