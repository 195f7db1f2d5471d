"""The OpenAI-compatible HTTP front end (FastAPI): completions, chat completions, models, health, metrics.

``build_app(async_engine, tokenizer, model_name, metrics, limits=ServerLimits(), api_key=None)`` returns
the app; ``serve_app`` runs it with uvicorn on 127.0.0.1 by default.  A request is answered with
OpenAI's error shape when it is wrong: 400 naming the field, 401 without the API key, 404 for an
unknown model, 408 / 413 for a body too slow or too large, 429 when ``max_waiting`` requests already
wait, 503 when the engine has failed or the server is stopping.  Streams are server-sent events
(``data: {chunk}`` ... ``data: [DONE]``).  A request one of whose choices fails while it generates (the
engine ends that request alone: NaN logits, or a grammar that together with the tokens ``min_tokens`` bans
leaves no token) is answered with the engine's reason in the error shape, as vLLM does: 500, or 400 where
the request's own constraints caused it; a stream ends with an error event and ``[DONE]``; its other
choices are aborted.  (``finish_reason`` stays one of OpenAI's values: "error" is no finish reason its clients
know, and some refuse it.)

The event loop never runs a long job: bodies above 64 KiB are parsed in a thread, chat templates render
in worker processes with a time limit (``templates``), prompts are tokenized in threads (the tokenizer
releases the GIL), and the model steps in the engine thread.  A client that goes away aborts its request
at once (streaming or not), freeing its KV blocks.  On SIGTERM the server stops accepting, lets in-flight
requests finish for ``limits.graceful_s``, then ends what is left with an error (an SSE error event and
``[DONE]`` for streams, a 503 otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine_client import EngineClient, EngineFailed, QueueFull
from .http_guard import ApiKeyMiddleware, guarded_protocol, read_json
from .limits import ServerLimits
from .metrics import ServerMetrics
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, RequestError, TokenizeRequest,
                       chat_messages, error_body, grammar_spec, sampling_params)
from .request import RequestOutput
from .responses import Prompt, ResponseBuilder
from .sampling import SamplingParams, check_bans
from .stats_log import ThroughputLog
from .structured import GrammarBackend
from .templates import TemplateFailed, TemplateTimeout, TemplateWorkers
from .tool_calls import FORMATS, ToolCallFormat

__all__ = ["build_app", "serve_app"]

log = logging.getLogger("ringmoe.serve")

_GONE, _CLOSING = "client went away", "server stopping"
_SHUTDOWN_MESSAGE = "the server is shutting down: this request was not finished within the grace period"


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
           code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code), status_code=status)


def _engine_stopped(engine) -> JSONResponse:
    return _error(503, f"the engine stopped: {engine.failed!r}", kind="server_error")


def _sse(payload) -> str:
    return f"data: {json.dumps(payload) if not isinstance(payload, str) else payload}\n\n"


@dataclass
class _Prepared:
    """A validated request: its prompts (ids and echo text), sampling parameters and tool-call syntax."""

    prompts: list[Prompt]
    params: SamplingParams
    tools: ToolCallFormat | None


class _Frontend:
    """One app's request path: validation, prompt ids, submission, and the response (whole or streamed)."""

    def __init__(self, engine: EngineClient, tokenizer, model_name: str, metrics: ServerMetrics,
                 default_max_tokens: int, limits: ServerLimits, tool_parser: str | None = None,
                 any_whitespace: bool = False):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.metrics, self.default_max_tokens, self.limits = metrics, default_max_tokens, limits
        self.templates: TemplateWorkers | None = None
        self.pool = ThreadPoolExecutor(limits.tokenizer_threads, thread_name_prefix="ringmoe-tokenize")
        # grammars compile (and serialize) in threads of their own: a slow one never holds up tokenizing
        self.grammar_pool = ThreadPoolExecutor(2, thread_name_prefix="ringmoe-grammar")
        self.closing = asyncio.Event()  # set when the grace period after SIGTERM is over
        self.tool_format = FORMATS[tool_parser] if tool_parser else None
        self.any_whitespace = any_whitespace
        self.grammars: GrammarBackend | None = None
        self._grammar_setup = asyncio.Lock()
        self.stats = ThroughputLog(limits.log_stats_s)

    async def start(self) -> None:
        await self.engine.ready()
        if self.tokenizer is not None:
            if self.tokenizer.chat_template:
                self.templates = await TemplateWorkers(
                    self.tokenizer.chat_template, self.tokenizer.bos_token or "", self.tokenizer.eos_token or "",
                    self.limits.template_workers, self.limits.template_timeout_s,
                    line_limit=8 * self.limits.max_body_bytes + 2**20).start()
            await asyncio.get_running_loop().run_in_executor(self.pool, self.tokenizer.min_tokens, "")
        self.stats.start(self.engine)

    async def stop(self) -> None:
        self.stats.stop()
        if self.templates is not None:
            await self.templates.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.grammar_pool.shutdown(wait=False, cancel_futures=True)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return "".join(f"<{i}>" for i in ids)
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    # -- the prompt -------------------------------------------------------------------------------
    @property
    def context(self) -> int:
        return self.engine.info.context

    @property
    def vocab(self) -> int:
        return self.engine.info.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.engine.info.max_model_len

    async def _encode(self, text: str, add_special_tokens: bool, field: str) -> list[int]:
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer: send the prompt as token ids", field)
        floor = self.tokenizer.min_tokens(text)  # a text that cannot fit is refused before tokenizer time is spent
        if floor > self.context:
            raise RequestError(f"{field} has {len(text)} characters, at least {floor} tokens: more than this "
                               f"server's context of {self.context} tokens", field)
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, self.tokenizer.encode, text,
                                                                    add_special_tokens, self.context)
        except ValueError as error:
            raise RequestError(f"{field}: {error}: this server's context is {self.context} tokens", field) from None

    def _tools(self, body) -> list[dict] | None:
        """The tool definitions the template sees (None when the request has none or tool_choice is "none")."""
        if not isinstance(body, ChatCompletionRequest) or body.tool_choice_name() == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in body.tools]

    async def _chat_ids(self, body: ChatCompletionRequest) -> list[int]:
        if self.templates is None:
            raise RequestError("this model has no chat template: use /v1/completions", "messages")
        if len(body.messages) > self.limits.max_messages:
            raise RequestError(f"messages holds {len(body.messages)} messages; this server takes at most "
                               f"{self.limits.max_messages} (--max-messages)", "messages")
        try:
            text = await self.templates.render(chat_messages(body), tools=self._tools(body))
        except (TemplateTimeout, TemplateFailed) as error:
            raise RequestError(f"messages: {error}", "messages") from None
        return await self._encode(text, False, "messages")

    async def _prompts(self, body, chat: bool) -> list[Prompt]:
        if chat:
            return [Prompt(await self._chat_ids(body), "")]
        prompts = []
        for index, prompt in enumerate(body.prompts()):
            field = "prompt" if len(body.prompts()) == 1 else f"prompt.{index}"
            if isinstance(prompt, str):
                ids = await self._encode(prompt, True, field)
                text = prompt
            else:
                if any(not 0 <= t < self.vocab for t in prompt):
                    raise RequestError(f"{field}: token ids must lie in [0, {self.vocab})", field)
                ids, text = list(prompt), self.decode(prompt) if body.echo else ""
            if not ids:
                raise RequestError(f"{field} must hold at least one token", field)
            prompts.append(Prompt(ids, text))
        return prompts

    def _check_fields(self, body, chat: bool) -> None:
        if body.model != self.model_name:
            raise RequestError(f"the model {body.model!r} does not exist; this server serves {self.model_name!r}",
                               "model", 404, "invalid_request_error", "model_not_found")
        limits = self.limits
        stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
        if len(stops) > limits.max_stop_strings or any(len(s) > limits.max_stop_chars for s in stops):
            raise RequestError(f"stop takes at most {limits.max_stop_strings} strings of at most "
                               f"{limits.max_stop_chars} characters", "stop")
        if len(body.stop_token_ids or ()) > limits.max_stop_token_ids:
            raise RequestError(f"stop_token_ids takes at most {limits.max_stop_token_ids} ids", "stop_token_ids")
        if any(not 0 <= t < self.vocab for t in body.stop_token_ids or ()):
            raise RequestError(f"stop_token_ids must lie in [0, {self.vocab})", "stop_token_ids")
        bias = body.logit_bias or {}
        if len(bias) > limits.max_logit_bias:
            raise RequestError(f"logit_bias takes at most {limits.max_logit_bias} entries", "logit_bias")
        if any(not k.isdigit() or int(k) >= self.vocab for k in bias):
            raise RequestError(f"logit_bias keys must be token ids in [0, {self.vocab})", "logit_bias")
        prompts = 1 if chat or isinstance(body.prompt, str) or (body.prompt and isinstance(body.prompt[0], int)) \
            else len(body.prompt)
        if prompts == 0:
            raise RequestError("prompt must hold at least one prompt", "prompt")
        if prompts * body.n > limits.max_choices:
            raise RequestError(f"{prompts} prompts x n={body.n} is more than {limits.max_choices} choices "
                               f"(--max-choices)", "n")
        if chat and body.tools and len(body.tools) > limits.max_tools:
            raise RequestError(f"tools holds more than {limits.max_tools} definitions (--max-tools)", "tools")
        params = sampling_params(body, self.default_max_tokens)  # the fields' errors first, before tokenizing
        try:
            check_bans(params, self.engine.info.eos_ids, self.vocab)
        except ValueError as error:
            raise RequestError(str(error), "stop_token_ids") from None

    async def _grammar(self, body):
        spec = grammar_spec(body, self.tool_format)
        if spec is None:
            return None
        loop = asyncio.get_running_loop()
        async with self._grammar_setup:  # the first grammar request builds the backend, in a worker thread (the
            if self.grammars is None:   # tokenizer's vocabulary read into xgrammar: ~1 s here, more for a big one)
                if self.tokenizer is None:
                    raise RequestError("structured outputs need the model's tokenizer", "response_format")
                try:
                    self.grammars = await loop.run_in_executor(self.grammar_pool, lambda: GrammarBackend(
                        self.tokenizer, self.vocab, self.engine.info.eos_ids, any_whitespace=self.any_whitespace))
                except ImportError:
                    raise RequestError("structured outputs need xgrammar (pip install xgrammar)", "response_format",
                                       400) from None
        try:
            return await asyncio.wait_for(loop.run_in_executor(self.grammar_pool, self._compile, spec),
                                          self.limits.grammar_timeout_s)
        except asyncio.TimeoutError:
            raise RequestError(f"the {spec.kind} grammar did not compile within {self.limits.grammar_timeout_s:g} s",
                               _grammar_field(body)) from None
        except ValueError as error:
            raise RequestError(str(error), _grammar_field(body)) from None

    def _compile(self, spec):
        """(In a worker thread.)  The compiled grammar; where it travels to an engine-core process also its
        serialized form, made here, not on the event loop, and bounded: ValueError past ``max_grammar_bytes``."""
        compiled = self.grammars.compile(spec)
        if getattr(self.engine, "sends_grammars", False):
            compiled = compiled.for_sending()
            size = len(compiled.serialized())
            if size > self.limits.max_grammar_bytes:
                raise ValueError(f"the compiled {spec.kind} grammar takes {size} bytes to send to the engine, more "
                                 f"than --max-grammar-bytes ({self.limits.max_grammar_bytes}): simplify it (nesting "
                                 f"multiplies its size)")
        return compiled

    async def prepare(self, body, chat: bool) -> _Prepared:
        self._check_fields(body, chat)
        prompts = await self._prompts(body, chat)
        grammar = await self._grammar(body)
        longest = max(len(p.ids) for p in prompts)
        # no max_tokens: as much as the context leaves, up to the server's default (vLLM's rule)
        params = sampling_params(body, max(1, min(self.default_max_tokens, self.context - longest)), grammar)
        for index, prompt in enumerate(prompts):
            try:
                self.engine.info.check_admissible(len(prompt.ids), params.max_tokens)
            except ValueError as error:
                raise RequestError(str(error), "prompt" if len(prompts) == 1 else f"prompt.{index}") from None
        tools = self.tool_format if chat and self._tools(body) is not None else None
        return _Prepared(prompts, params, tools)

    # -- the response -----------------------------------------------------------------------------
    async def run(self, request: Request, model, chat: bool):
        body = await read_json(request, model, self.limits)
        prepared = await self.prepare(body, chat)
        outputs: asyncio.Queue = asyncio.Queue()
        request_ids = []
        try:
            for prompt in prepared.prompts:
                request_ids.append(self.engine.submit(prompt.ids, prepared.params, outputs)[0])
        except (QueueFull, EngineFailed) as error:
            for request_id in request_ids:
                self.engine.abort(request_id)
            if isinstance(error, QueueFull):
                return _error(429, str(error), kind="rate_limit_error")
            return _error(503, str(error), kind="server_error")
        for prompt, request_id in zip(prepared.prompts, request_ids):
            self.metrics.on_admit(len(prompt.ids))
            if self.limits.log_requests:
                log.info("request %s: %d prompt tokens, %s, prompt %s", request_id, len(prompt.ids),
                         prepared.params, repr(self.decode(prompt.ids))[:self.limits.max_log_len])
        echo = not chat and body.echo
        builder = ResponseBuilder(chat, self.model_name, self.decode, prepared.prompts, body.n, echo,
                                  prepared.params.logprobs, body.prompt_logprobs is not None, prepared.tools)
        stream = _Outputs(self, request_ids, outputs, prepared.prompts, body.n)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self.stream(stream, builder, include_usage), media_type="text/event-stream")
        return await self.complete(stream, builder, request)

    async def complete(self, stream: "_Outputs", builder: ResponseBuilder, request: Request):
        async def client_gone():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        watchers = [asyncio.ensure_future(client_gone()), asyncio.ensure_future(self.closing.wait())]
        finals: dict[int, RequestOutput] = {}
        try:
            while len(finals) < stream.choices:
                item = await stream.next(watchers)
                if item is _GONE:
                    return Response(status_code=499)
                if item is _CLOSING:
                    return _error(503, _SHUTDOWN_MESSAGE, kind="server_error")
                prompt, out = item
                if out.finish_reason == "error":  # one choice failed: the request answers with its error
                    stream.abort()
                    return JSONResponse(_failure(out), status_code=_failure_status(out))
                index = builder.add(prompt, out)
                if out.finished:
                    finals[index] = out
            return builder.final(finals)
        except (ValueError, TypeError) as error:
            return _error(400, str(error), "prompt")
        except EngineFailed as error:
            return _error(503, str(error).splitlines()[0], kind="server_error")
        except asyncio.CancelledError:
            stream.abort()
            raise
        finally:
            for watcher in watchers:
                watcher.cancel()

    async def stream(self, stream: "_Outputs", builder: ResponseBuilder, include_usage: bool):
        closing = asyncio.ensure_future(self.closing.wait())
        finished = 0
        try:
            for chunk in builder.first_chunks():
                yield _sse(chunk)
            while finished < stream.choices:
                item = await stream.next([closing])
                if item is _CLOSING:
                    yield _sse(error_body(_SHUTDOWN_MESSAGE, "server_error", None, "503"))
                    break
                prompt, out = item
                if out.finish_reason == "error":  # one choice failed: an error event, then [DONE] (the rest aborted)
                    yield _sse(_failure(out))
                    break
                for chunk in builder.chunks(prompt, out):
                    yield _sse(chunk)
                finished += out.finished
            else:
                if include_usage:
                    yield _sse(builder.usage_chunk())
            yield _sse("[DONE]")
        except (ValueError, TypeError, EngineFailed) as error:
            kind = "server_error" if isinstance(error, EngineFailed) else "invalid_request_error"
            yield _sse(error_body(str(error).splitlines()[0], kind))
            yield _sse("[DONE]")
        finally:
            closing.cancel()
            if not stream.done:  # the client went away mid-stream: free the requests' KV now
                stream.abort()


class _Outputs:
    """The outputs of one HTTP request's engine requests (one per prompt), as (prompt index, RequestOutput)."""

    def __init__(self, front: _Frontend, request_ids: list[str], queue: asyncio.Queue, prompts: list[Prompt],
                 n: int):
        self.front, self.request_ids, self.queue, self.choices = front, request_ids, queue, len(prompts) * n
        self.prompt_tokens = {rid: len(p.ids) for rid, p in zip(request_ids, prompts)}
        self.prompt_of = {rid: i for i, rid in enumerate(request_ids)}
        self.timing = {rid: {"gaps": [], "last": None} for rid in request_ids}
        self.finished = 0

    @property
    def done(self) -> bool:
        return self.finished >= self.choices

    def abort(self) -> None:
        for request_id in self.request_ids:
            self.front.engine.abort(request_id)

    async def next(self, watchers: list):
        """The next (prompt index, RequestOutput), or _GONE / _CLOSING (the requests are then aborted)."""
        getter = asyncio.ensure_future(self.queue.get())
        done, _ = await asyncio.wait([getter, *watchers], return_when=asyncio.FIRST_COMPLETED)
        if getter not in done:
            getter.cancel()
            self.abort()
            return _CLOSING if self.front.closing.is_set() else _GONE
        item = getter.result()
        if isinstance(item, Exception):
            self.abort()
            raise item
        timing, now = self.timing[item.group_id], time.monotonic()
        if timing["last"] is not None:
            timing["gaps"].append(now - timing["last"])
        timing["last"] = now
        if item.finished:
            self.finished += 1
            self.front.metrics.on_finish(item, timing["gaps"])
            if self.front.limits.log_requests:
                t = item.timings
                log.info("request %s#%d finished: %s, %d prompt + %d output tokens, ttft %.3f s, e2e %.3f s",
                         item.group_id, item.index, item.finish_reason, self.prompt_tokens[item.group_id],
                         len(item.output_ids), t.get("ttft_s", 0.0), t.get("e2e_s", 0.0))
        return self.prompt_of[item.group_id], item


def _failure(out: RequestOutput) -> dict:
    """The error body of a choice that ended with finish_reason "error" (as vLLM answers a request whose generation
    failed, with the engine's reason, not a finish_reason OpenAI's clients do not know)."""
    kind = out.error_type or "server_error"
    return error_body(out.error or "generation failed", kind, None, str(_failure_status(out)))


def _failure_status(out: RequestOutput) -> int:
    """400 where the request's own constraints left no token to choose, else 500."""
    return 400 if out.error_type == "invalid_request_error" else 500


def _grammar_field(body) -> str:
    if body.structured_outputs is not None:
        return "structured_outputs"
    if body.response_format is not None:
        return "response_format"
    return "tool_choice"


def build_app(engine: EngineClient, tokenizer, model_name: str, metrics: ServerMetrics,
              default_max_tokens: int = 256, limits: ServerLimits | None = None,
              api_key: str | None = None, tool_parser: str | None = None, any_whitespace: bool = False,
              allowed_origins: tuple[str, ...] = (), throughput: ThroughputLog | None = None) -> FastAPI:
    """The app.  tool_parser: the tool-call syntax of the model ("hermes", "deepseek_v3"; None: tools are
    refused).  any_whitespace: JSON grammars may put whitespace between tokens.  allowed_origins: CORS
    origins ("*" for any; none by default).  throughput: the periodic log line (fed by the engine's on_step)."""
    limits = limits or ServerLimits()
    front = _Frontend(engine, tokenizer, model_name, metrics, default_max_tokens, limits, tool_parser, any_whitespace)
    if throughput is not None:
        front.stats = throughput

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await front.start()
        if getattr(app.state, "on_started", None) is not None:
            app.state.on_started()
        try:
            yield
        finally:
            await front.stop()

    app = FastAPI(title="ringmoe", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.frontend = front
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    if allowed_origins:  # outermost, so a preflight (OPTIONS, no key) is answered before the key check
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"])
    _error_handlers(app)
    _routes(app, front)
    return app


def _error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape: the app's own, unknown paths (404), wrong methods (405), bad bodies."""

    @app.exception_handler(RequestError)
    async def request_error(request, exc: RequestError):
        return _error(exc.status, str(exc), exc.param, exc.kind, exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        messages = {404: f"{request.method} {request.url.path}: no such route",
                    405: f"{request.method} is not allowed on {request.url.path}"}
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return _error(exc.status_code, messages.get(exc.status_code, str(exc.detail)), kind=kind,
                      code=str(exc.status_code))

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
        return _error(400, f"{param or 'body'}: {first.get('msg', 'invalid value')}", param)


def _routes(app: FastAPI, front: _Frontend) -> None:
    _status_routes(app, front)
    _model_routes(app, front)
    _generation_routes(app, front)


def _status_routes(app: FastAPI, front: _Frontend) -> None:
    """Health, Prometheus metrics, per-rank figures and the version."""
    engine, metrics = front.engine, front.metrics

    @app.get("/health")
    async def health():
        if not engine.alive:
            return _engine_stopped(engine)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        if engine.alive:
            metrics.refresh(await engine.status())
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/stats")
    async def stats():
        """Per rank since the start: requests of its ep group, peak KV blocks, expert rows, ring seconds."""
        if not engine.alive:
            return _engine_stopped(engine)
        return {"ranks": (await engine.status()).ranks, "block_size": engine.info.block_size}

    @app.get("/version")
    async def version():
        try:
            return {"version": importlib.metadata.version("ringmoe")}
        except importlib.metadata.PackageNotFoundError:  # run from a source tree
            return {"version": "unknown"}


def _model_routes(app: FastAPI, front: _Frontend) -> None:
    """The served model's card, as OpenAI's /v1/models lists it."""

    def card() -> dict:
        return {"id": front.model_name, "object": "model", "created": 0, "owned_by": "ringmoe",
                "root": front.model_name, "max_model_len": front.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != front.model_name:
            raise RequestError(f"the model {model_id!r} does not exist; this server serves {front.model_name!r}",
                               "model", 404, code="model_not_found")
        return card()


def _generation_routes(app: FastAPI, front: _Frontend) -> None:
    """Completions, chat completions, and vLLM's /tokenize and /detokenize."""

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await front.run(request, CompletionRequest, False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await front.run(request, ChatCompletionRequest, True)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await read_json(request, TokenizeRequest, front.limits)
        if body.model is not None and body.model != front.model_name:
            raise RequestError(f"the model {body.model!r} does not exist", "model", 404, code="model_not_found")
        if body.messages is not None:
            chat = ChatCompletionRequest(model=front.model_name, messages=body.messages)
            ids = await front._chat_ids(chat)
        else:
            ids = await front._encode(body.prompt, body.add_special_tokens, "prompt")
        return {"count": len(ids), "max_model_len": front.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await read_json(request, DetokenizeRequest, front.limits)
        if body.model is not None and body.model != front.model_name:
            raise RequestError(f"the model {body.model!r} does not exist", "model", 404, code="model_not_found")
        if any(not 0 <= t < front.vocab for t in body.tokens):
            raise RequestError(f"tokens must lie in [0, {front.vocab})", "tokens")
        return {"prompt": front.decode(body.tokens)}


def _raise_open_files_limit() -> None:
    """Every connection is a file descriptor: take the hard limit, so a crowd of idle sockets cannot
    exhaust the soft one (often 1024) before the connection limit answers 503."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or hard > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))
    except (ImportError, ValueError, OSError):
        pass


def serve_app(app: FastAPI, host: str, port: int, limits: ServerLimits | None = None, on_started=None,
              sock=None) -> int:
    """Run the app with uvicorn until SIGTERM/SIGINT (in-flight requests drain first); its exit code.  sock: a
    listening socket to serve on (several front-end processes share one) instead of binding host:port."""
    import signal

    import uvicorn

    limits = limits or ServerLimits()
    front: _Frontend = app.state.frontend

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            # the grace period: then every open request ends with an error (streams: an event and [DONE])
            deadline = asyncio.get_running_loop().call_later(limits.graceful_s, front.closing.set)
            try:
                await super().shutdown(sockets)
            finally:
                deadline.cancel()

    if limits.log_requests:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # uvicorn drains on SIGTERM, then re-raises the signal to the handler it found: make that one
    # a no-op so a drained server exits 0 instead of dying by the default action
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            http=guarded_protocol(limits.header_timeout_s), timeout_keep_alive=limits.keep_alive_s,
                            limit_concurrency=limits.limit_concurrency,
                            timeout_graceful_shutdown=limits.graceful_s + 5)
    server = Server(config)
    app.state.server, app.state.on_started = server, on_started
    _raise_open_files_limit()
    try:
        server.run(sockets=[sock] if sock is not None else None)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return getattr(app.state, "exit_code", 0)
