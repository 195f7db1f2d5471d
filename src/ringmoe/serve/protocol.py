"""OpenAI's request shapes for /v1/completions and /v1/chat/completions (``responses`` builds the answers).

Requests are pydantic models: a field this server does not know is refused with a 400 naming it (never
silently ignored); wrong types are 400 errors naming the field.  ``sampling_params`` maps a request onto
``SamplingParams`` (OpenAI's fields plus vLLM's extras top_k, min_p, repetition_penalty, min_tokens,
ignore_eos, stop_token_ids, prompt_logprobs); ``grammar_spec`` the constraints on its output
(response_format, vLLM's structured_outputs, a forced tool call) onto a ``GrammarSpec``.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .sampling import SamplingParams
from .structured import GrammarSpec

__all__ = ["CompletionRequest", "ChatCompletionRequest", "sampling_params", "chat_messages", "error_body",
           "RequestError", "ROLES", "grammar_spec", "TokenizeRequest", "DetokenizeRequest"]


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
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: accepted, usage comes once at the end


class JsonSchema(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, json_object, or json_schema {name, schema, strict}."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs extra: exactly one of json (a schema), regex, choice, grammar (EBNF), json_object."""

    model_config = ConfigDict(extra="forbid")

    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Common(BaseModel):
    """Fields of both endpoints.  Unknown fields are refused (400 naming them), never silently ignored."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    model: str
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None  # an end-user id for the operator's logs: no effect on the output
    # vLLM's extras
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    structured_outputs: StructuredOutputs | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one string or token-id list each (a list of prompts is a batch)."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        return list(prompt)


ROLES = ("system", "developer", "user", "assistant", "tool")


class ContentPart(BaseModel):
    """One part of a message's content: OpenAI's {"type": "text", "text": ...}; other types are refused."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str


class MessageToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """A chat message: one of the template's roles, text content (a string or text parts), an optional name;
    an assistant's tool_calls, a tool result's tool_call_id."""

    model_config = ConfigDict(extra="forbid")

    role: Literal[ROLES]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def tool_choice_name(self) -> str:
        """"none", "auto", "required", or the forced function's name (no tools: "none")."""
        if not self.tools:
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return self.tool_choice or "auto"


def chat_messages(request: "ChatCompletionRequest") -> list[dict]:
    """The messages as the template sees them: {"role", "content": str[, "name", "tool_calls", "tool_call_id"]}.
    Text parts are joined with newlines (as vLLM does); image, audio and file parts are refused: this server
    reads text.  A tool call's arguments reach the template parsed (templates write them with ``tojson``)."""
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
        if content is None and not message.tool_calls:
            raise RequestError(f"messages[{i}] needs content", f"messages.{i}.content")
        if message.tool_calls and message.role != "assistant":
            raise RequestError(f"messages[{i}]: only assistant messages carry tool_calls", f"messages.{i}.tool_calls")
        entry = {"role": message.role, "content": content if content is not None else ""}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        if message.tool_calls:
            entry["tool_calls"] = [_template_call(call, i) for call in message.tool_calls]
        messages.append(entry)
    return messages


def _template_call(call: MessageToolCall, index: int) -> dict:
    try:
        arguments = json.loads(call.function.arguments)
    except (ValueError, RecursionError):  # (RecursionError: nested too deeply to parse)
        raise RequestError(f"messages[{index}].tool_calls: arguments must be JSON text",
                           f"messages.{index}.tool_calls") from None
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


def grammar_spec(request: _Common, tool_format=None) -> GrammarSpec | None:
    """The grammar a request's output must follow (response_format, structured_outputs, or a forced tool call);
    None when it is free.  RequestError naming the field when they conflict or make no sense."""
    specs = []
    fmt = request.response_format
    if fmt is not None and fmt.type == "json_object":
        specs.append(("response_format", GrammarSpec("json_object")))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise RequestError("response_format json_schema needs json_schema.schema", "response_format.json_schema")
        specs.append(("response_format", GrammarSpec("json_schema", json.dumps(fmt.json_schema.schema_))))
    so = request.structured_outputs
    if so is not None:
        given = [(k, v) for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                      ("grammar", so.grammar), ("json_object", so.json_object or None)) if v is not None]
        if len(given) != 1:
            raise RequestError("structured_outputs takes exactly one of json, regex, choice, grammar, json_object",
                               "structured_outputs")
        kind, value = given[0]
        source = {"json": lambda v: v if isinstance(v, str) else json.dumps(v), "regex": str, "grammar": str,
                  "choice": json.dumps, "json_object": lambda v: ""}[kind](value)
        kind = {"json": "json_schema"}.get(kind, kind)
        specs.append(("structured_outputs", GrammarSpec(kind, source)))
    if isinstance(request, ChatCompletionRequest) and request.tool_choice_name() not in ("none", "auto"):
        if tool_format is None:
            raise RequestError("this server has no tool-call parser for the model (--tool-call-parser)", "tool_choice")
        tools = [t.model_dump(exclude_none=True) for t in request.tools]
        choice = request.tool_choice_name()
        if choice != "required" and choice not in {t["function"]["name"] for t in tools}:
            raise RequestError(f"tool_choice names {choice!r}, which is not in tools", "tool_choice")
        specs.append(("tool_choice", GrammarSpec("structural_tag",
                                                 tool_format.structural_tag(tools, choice, request.parallel_tool_calls))))
    if len(specs) > 1:
        raise RequestError(f"{specs[0][0]} and {specs[1][0]} both constrain the output: give one", specs[1][0])
    return specs[0][1] if specs else None


def sampling_params(request: _Common, default_max_tokens: int, grammar=None) -> SamplingParams:
    """The engine's parameters for a request; RequestError naming the field when they do not make sense."""
    if isinstance(request, ChatCompletionRequest):
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        if request.top_logprobs and not request.logprobs:
            raise RequestError("top_logprobs needs logprobs=true", "top_logprobs")
        if max_tokens == 0:
            raise RequestError("max_tokens must be >= 1 for chat completions", "max_tokens")
    else:
        max_tokens, logprobs = request.max_tokens, request.logprobs
        if request.suffix is not None:
            raise RequestError("suffix is not supported: this model's template has no fill-in-the-middle", "suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise RequestError("best_of must equal n (this server returns every sample it draws)", "best_of")
        if max_tokens == 0 and not request.echo and request.prompt_logprobs is None:
            raise RequestError("max_tokens 0 returns nothing without echo or prompt_logprobs", "max_tokens")
    if request.prompt_logprobs is not None and request.stream:
        raise RequestError("prompt_logprobs is not supported with stream=true", "prompt_logprobs")
    prompt_logprobs = request.prompt_logprobs
    if isinstance(request, CompletionRequest) and request.echo and logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, logprobs)  # echo + logprobs: the prompt's too (OpenAI)
    bias = []
    for key, value in (request.logit_bias or {}).items():
        try:
            bias.append((int(key), value))
        except ValueError:
            raise RequestError(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
    try:
        return SamplingParams(
            temperature=_or(request.temperature, 1.0), top_p=_or(request.top_p, 1.0), top_k=request.top_k,
            min_p=request.min_p, seed=request.seed, presence_penalty=_or(request.presence_penalty, 0.0),
            frequency_penalty=_or(request.frequency_penalty, 0.0), repetition_penalty=request.repetition_penalty,
            stop=tuple([request.stop] if isinstance(request.stop, str) else request.stop or ()),
            stop_token_ids=tuple(request.stop_token_ids or ()),
            max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
            min_tokens=request.min_tokens, ignore_eos=request.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, n=request.n, logit_bias=tuple(bias), grammar=grammar,
        )
    except ValueError as error:  # SamplingParams names the field first
        raise RequestError(str(error), str(error).split()[0]) from None


def _or(value, default):
    return default if value is None else value


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt (add_special_tokens as for completions) or chat messages (the template's text)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]
