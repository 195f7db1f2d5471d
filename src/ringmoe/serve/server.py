"""The OpenAI-compatible HTTP front end (FastAPI): completions, chat completions, models, health, metrics.

``build_app(async_engine, tokenizer, model_name, metrics, limits=ServerLimits(), api_key=None)`` returns
the app; ``serve_app`` runs it with uvicorn on 127.0.0.1 by default.  A request is answered with
OpenAI's error shape when it is wrong: 400 naming the field, 401 without the API key, 404 for an
unknown model, 408 / 413 for a body too slow or too large, 429 when ``max_waiting`` requests already
wait, 503 when the engine has failed or the server is stopping.  Streams are server-sent events
(``data: {chunk}`` ... ``data: [DONE]``).

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
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .async_engine import AsyncEngine, EngineFailed, QueueFull
from .http_guard import ApiKeyMiddleware, guarded_protocol, read_json
from .limits import ServerLimits
from .metrics import ServerMetrics
from .protocol import (ChatCompletionRequest, CompletionRequest, RequestError, ResponseBuilder, chat_messages,
                       error_body, sampling_params)
from .request import RequestOutput
from .templates import TemplateFailed, TemplateTimeout, TemplateWorkers

__all__ = ["build_app", "serve_app"]

log = logging.getLogger("ringmoe.serve")

_GONE, _CLOSING = "client went away", "server stopping"
_SHUTDOWN_MESSAGE = "the server is shutting down: this request was not finished within the grace period"


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
           code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code), status_code=status)


def _sse(payload) -> str:
    return f"data: {json.dumps(payload) if not isinstance(payload, str) else payload}\n\n"


class _Frontend:
    """One app's request path: validation, prompt ids, submission, and the response (whole or streamed)."""

    def __init__(self, engine: AsyncEngine, tokenizer, model_name: str, metrics: ServerMetrics,
                 default_max_tokens: int, limits: ServerLimits):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.metrics, self.default_max_tokens, self.limits = metrics, default_max_tokens, limits
        self.scheduler = engine.engine.groups[0]
        self.templates: TemplateWorkers | None = None
        self.pool = ThreadPoolExecutor(limits.tokenizer_threads, thread_name_prefix="ringmoe-tokenize")
        self.closing = asyncio.Event()  # set when the grace period after SIGTERM is over

    async def start(self) -> None:
        if self.tokenizer is not None:
            if self.tokenizer.chat_template:
                self.templates = await TemplateWorkers(
                    self.tokenizer.chat_template, self.tokenizer.bos_token or "", self.tokenizer.eos_token or "",
                    self.limits.template_workers, self.limits.template_timeout_s,
                    line_limit=8 * self.limits.max_body_bytes + 2**20).start()
            await asyncio.get_running_loop().run_in_executor(self.pool, self.tokenizer.min_tokens, "")

    async def stop(self) -> None:
        if self.templates is not None:
            await self.templates.close()
        self.pool.shutdown(wait=False, cancel_futures=True)

    # -- the prompt -------------------------------------------------------------------------------
    @property
    def context(self) -> int:
        return min(self.scheduler.max_model_len, self.scheduler.capacity)

    async def _encode(self, text: str, add_special_tokens: bool, field: str) -> list[int]:
        floor = self.tokenizer.min_tokens(text)  # a text that cannot fit is refused before tokenizer time is spent
        if floor > self.context:
            raise RequestError(f"{field} has {len(text)} characters, at least {floor} tokens: more than this "
                               f"server's context of {self.context} tokens", field)
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, self.tokenizer.encode, text,
                                                                    add_special_tokens, self.context)
        except ValueError as error:
            raise RequestError(f"{field}: {error}: this server's context is {self.context} tokens", field) from None

    async def _chat_ids(self, body: ChatCompletionRequest) -> list[int]:
        if self.templates is None:
            raise RequestError("this model has no chat template: use /v1/completions", "messages")
        if len(body.messages) > self.limits.max_messages:
            raise RequestError(f"messages holds {len(body.messages)} messages; this server takes at most "
                               f"{self.limits.max_messages} (--max-messages)", "messages")
        try:
            text = await self.templates.render(chat_messages(body))
        except TemplateTimeout as error:
            raise RequestError(f"messages: {error}", "messages") from None
        except TemplateFailed as error:
            raise RequestError(f"messages: {error}", "messages") from None
        return await self._encode(text, False, "messages")

    async def _prompt_ids(self, body, chat: bool) -> list[int]:
        if chat:
            return await self._chat_ids(body)
        if isinstance(body.prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer: send the prompt as token ids", "prompt")
            return await self._encode(body.prompt, True, "prompt")
        vocab = self.engine.engine.model.config.vocab_size
        if any(not 0 <= t < vocab for t in body.prompt):
            raise RequestError(f"prompt token ids must lie in [0, {vocab})", "prompt")
        return list(body.prompt)

    def _check_fields(self, body) -> None:
        if body.model != self.model_name:
            raise RequestError(f"the model {body.model!r} does not exist; this server serves {self.model_name!r}",
                               "model", 404, "invalid_request_error", "model_not_found")
        stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
        if len(stops) > self.limits.max_stop_strings or any(len(s) > self.limits.max_stop_chars for s in stops):
            raise RequestError(f"stop takes at most {self.limits.max_stop_strings} strings of at most "
                               f"{self.limits.max_stop_chars} characters", "stop")
        vocab = self.engine.engine.model.config.vocab_size
        if any(not 0 <= t < vocab for t in body.stop_token_ids or ()):
            raise RequestError(f"stop_token_ids must lie in [0, {vocab})", "stop_token_ids")
        sampling_params(body, self.default_max_tokens)  # the fields' errors first, before tokenizing

    async def prepare(self, body, chat: bool):
        self._check_fields(body)
        ids = await self._prompt_ids(body, chat)
        if not ids:
            raise RequestError("prompt must hold at least one token", "prompt")
        # no max_tokens: as much as the context leaves, up to the server's default (vLLM's rule)
        params = sampling_params(body, max(1, min(self.default_max_tokens, self.context - len(ids))))
        try:
            self.scheduler.check_admissible(len(ids), params.max_tokens)
        except ValueError as error:
            raise RequestError(str(error), "prompt") from None
        return ids, params

    # -- the response -----------------------------------------------------------------------------
    async def run(self, request: Request, model, chat: bool):
        body = await read_json(request, model, self.limits)
        ids, params = await self.prepare(body, chat)
        try:
            request_id, outputs = self.engine.submit(ids, params)
        except QueueFull as error:
            return _error(429, str(error), kind="rate_limit_error")
        except EngineFailed as error:
            return _error(503, str(error), kind="server_error")
        self.metrics.on_admit(len(ids))
        if self.limits.log_requests:
            shown = body.prompt if not chat else chat_messages(body)
            log.info("request %s: %d prompt tokens, %s, prompt %s", request_id, len(ids), params,
                     repr(shown)[:self.limits.max_log_len])
        if self.tokenizer is not None:
            decode = lambda t: self.tokenizer.decode(t, skip_special_tokens=False)  # noqa: E731
        else:
            decode = lambda t: "".join(f"<{i}>" for i in t)  # noqa: E731
        builder = ResponseBuilder(chat, self.model_name, len(ids), decode)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self.stream(request_id, outputs, builder, include_usage),
                                     media_type="text/event-stream")
        return await self.complete(request_id, outputs, builder, request)

    async def _next(self, request_id: str, outputs: asyncio.Queue, watchers: list, timing: dict):
        """The next RequestOutput, or _GONE / _CLOSING (the request is then aborted)."""
        getter = asyncio.ensure_future(outputs.get())
        done, _ = await asyncio.wait([getter, *watchers], return_when=asyncio.FIRST_COMPLETED)
        if getter not in done:
            getter.cancel()
            self.engine.abort(request_id)
            return _CLOSING if self.closing.is_set() else _GONE
        item = getter.result()
        if isinstance(item, Exception):
            raise item
        now = time.monotonic()
        if timing["last"] is not None:
            timing["gaps"].append(now - timing["last"])
        timing["last"] = now
        if item.finished:
            self.metrics.on_finish(item, timing["gaps"])
        return item

    async def complete(self, request_id, outputs, builder: ResponseBuilder, request: Request):
        async def client_gone():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        watchers = [asyncio.ensure_future(client_gone()), asyncio.ensure_future(self.closing.wait())]
        timing, logprobs = {"gaps": [], "last": None}, []
        try:
            while True:
                out = await self._next(request_id, outputs, watchers, timing)
                if out is _GONE:
                    return Response(status_code=499)
                if out is _CLOSING:
                    return _error(503, _SHUTDOWN_MESSAGE, kind="server_error")
                logprobs += out.logprobs
                if out.finished:
                    return builder.final(out.text, out.finish_reason, len(out.output_ids), logprobs)
        except (ValueError, TypeError) as error:
            return _error(400, str(error), "prompt")
        except EngineFailed as error:
            return _error(503, str(error).splitlines()[0], kind="server_error")
        except asyncio.CancelledError:
            self.engine.abort(request_id)
            raise
        finally:
            for watcher in watchers:
                watcher.cancel()

    async def stream(self, request_id, outputs, builder: ResponseBuilder, include_usage: bool):
        timing, finished = {"gaps": [], "last": None}, False
        closing = asyncio.ensure_future(self.closing.wait())
        try:
            first = builder.first_chunk()
            if first is not None:
                yield _sse(first)
            while True:
                out: RequestOutput | str = await self._next(request_id, outputs, [closing], timing)
                if out is _CLOSING:
                    finished = True
                    yield _sse(error_body(_SHUTDOWN_MESSAGE, "server_error", None, "503"))
                    yield _sse("[DONE]")
                    return
                yield _sse(builder.chunk(out))
                if out.finished:
                    finished = True
                    if include_usage:
                        yield _sse(builder.usage_chunk(len(out.output_ids)))
                    yield _sse("[DONE]")
                    return
        except (ValueError, TypeError, EngineFailed) as error:
            finished = True
            kind = "server_error" if isinstance(error, EngineFailed) else "invalid_request_error"
            yield _sse(error_body(str(error).splitlines()[0], kind))
            yield _sse("[DONE]")
        finally:
            closing.cancel()
            if not finished:  # the client went away mid-stream: free the request's KV now
                self.engine.abort(request_id)


def build_app(engine: AsyncEngine, tokenizer, model_name: str, metrics: ServerMetrics,
              default_max_tokens: int = 256, limits: ServerLimits | None = None,
              api_key: str | None = None) -> FastAPI:
    limits = limits or ServerLimits()
    front = _Frontend(engine, tokenizer, model_name, metrics, default_max_tokens, limits)

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

    @app.exception_handler(RequestError)
    async def request_error(request, exc: RequestError):
        return _error(exc.status, str(exc), exc.param, exc.kind, exc.code)

    @app.get("/health")
    async def health():
        if not engine.alive:
            return _error(503, f"the engine stopped: {engine.failed!r}", kind="server_error")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        metrics.refresh(engine.engine)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/stats")
    async def stats():
        """Per rank since the start: requests of its ep group, peak KV blocks, expert rows, ring seconds."""
        return {"ranks": [dict(row) for row in engine.engine.rank_report],
                "block_size": engine.engine.runner.block_size}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "ringmoe",
                                            "max_model_len": front.scheduler.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await front.run(request, CompletionRequest, False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await front.run(request, ChatCompletionRequest, True)

    return app


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


def serve_app(app: FastAPI, host: str, port: int, limits: ServerLimits | None = None, on_started=None) -> int:
    """Run the app with uvicorn until SIGTERM/SIGINT (in-flight requests drain first); its exit code."""
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
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return getattr(app.state, "exit_code", 0)
