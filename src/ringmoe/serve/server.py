"""The OpenAI-compatible HTTP front end (FastAPI): completions, chat completions, models, health, metrics.

``build_app(async_engine, tokenizer, model_name)`` returns the app; ``serve_app`` runs it with uvicorn
on 127.0.0.1 by default.  Every request is validated on the event loop (JSON, types, sampling
parameters, prompt length) and answered with OpenAI's error shape when it is wrong: 400 naming the
field, 404 for an unknown model, 429 when ``max_waiting`` requests already wait, 503 when the engine
has failed.  Streams are server-sent events (``data: {chunk}`` ... ``data: [DONE]``).  A client that
disconnects aborts its request (its KV blocks are freed); every accepted request ends with a
response or an error.
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .async_engine import AsyncEngine, EngineFailed, QueueFull
from .metrics import ServerMetrics
from .protocol import (ChatCompletionRequest, CompletionRequest, RequestError, ResponseBuilder, error_body,
                       sampling_params)
from .request import RequestOutput

__all__ = ["build_app", "serve_app"]


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
           code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code), status_code=status)


def build_app(engine: AsyncEngine, tokenizer, model_name: str, metrics: ServerMetrics,
              default_max_tokens: int = 256) -> FastAPI:
    app = FastAPI(title="ringmoe", docs_url=None, redoc_url=None)
    scheduler = engine.engine.groups[0]

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        location = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return _error(400, f"the body is not valid JSON: {first.get('msg')}")
        param = ".".join(location) or None
        return _error(400, f"{param or 'body'}: {first.get('msg', 'invalid value')}", param)

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
                                            "max_model_len": scheduler.max_model_len}]}

    def prepare(body, chat: bool) -> tuple[list[int], object]:
        if body.model != model_name:
            raise RequestError(f"the model {body.model!r} does not exist; this server serves {model_name!r}",
                               "model", 404, "invalid_request_error", "model_not_found")
        sampling_params(body, default_max_tokens)  # the fields' errors first, before tokenizing
        if chat:
            if tokenizer is None or not tokenizer.chat_template:
                raise RequestError("this model has no chat template: use /v1/completions", "messages")
            messages = [m.model_dump(exclude_none=True) for m in body.messages]
            try:
                ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
            except Exception as error:  # a template can raise on messages it does not accept
                raise RequestError(f"messages: {error}", "messages") from None
        elif isinstance(body.prompt, str):
            if tokenizer is None:
                raise RequestError("this model has no tokenizer: send the prompt as token ids", "prompt")
            ids = tokenizer.encode(body.prompt)
        else:
            ids = list(body.prompt)
            vocab = engine.engine.model.config.vocab_size
            if any(not 0 <= t < vocab for t in ids):
                raise RequestError(f"prompt token ids must lie in [0, {vocab})", "prompt")
        if not ids:
            raise RequestError("prompt must hold at least one token", "prompt")
        # no max_tokens: as much as the context leaves, up to the server's default (vLLM's rule)
        room = min(scheduler.max_model_len, scheduler.capacity) - len(ids)
        params = sampling_params(body, max(1, min(default_max_tokens, room)))
        try:
            scheduler.check_admissible(len(ids), params.max_tokens)
        except ValueError as error:
            raise RequestError(str(error), "prompt") from None
        return ids, params

    async def run(body, chat: bool, request: Request):
        ids, params = prepare(body, chat)
        try:
            request_id, outputs = engine.submit(ids, params)
        except QueueFull as error:
            return _error(429, str(error), kind="rate_limit_error")
        except EngineFailed as error:
            return _error(503, str(error), kind="server_error")
        metrics.on_admit(len(ids))
        decode = (lambda t: tokenizer.decode(t, skip_special_tokens=False)) if tokenizer is not None else \
            (lambda t: "".join(f"<{i}>" for i in t))
        builder = ResponseBuilder(chat, model_name, len(ids), decode)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(stream(request_id, outputs, builder, include_usage, request),
                                     media_type="text/event-stream")
        return await complete(request_id, outputs, builder, request)

    async def next_output(request_id, outputs, request, gaps, last):
        """The next RequestOutput; None if the client went away (the request is then aborted)."""
        while True:
            try:
                item = await asyncio.wait_for(outputs.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    engine.abort(request_id)
                    return None
                continue
            if isinstance(item, Exception):
                raise item
            now = time.monotonic()
            if last[0] is not None:
                gaps.append(now - last[0])
            last[0] = now
            if item.finished:
                metrics.on_finish(item, gaps)
            return item

    async def complete(request_id, outputs, builder, request):
        gaps, last, logprobs = [], [None], []
        try:
            while True:
                out = await next_output(request_id, outputs, request, gaps, last)
                if out is None:
                    return Response(status_code=499)
                logprobs += out.logprobs
                if out.finished:
                    return builder.final(out.text, out.finish_reason, len(out.output_ids), logprobs)
        except (ValueError, TypeError) as error:
            return _error(400, str(error), "prompt")
        except EngineFailed as error:
            return _error(503, str(error).splitlines()[0], kind="server_error")
        except asyncio.CancelledError:
            engine.abort(request_id)
            raise

    async def stream(request_id, outputs, builder: ResponseBuilder, include_usage: bool, request):
        gaps, last, finished = [], [None], False
        try:
            first = builder.first_chunk()
            if first is not None:
                yield f"data: {json.dumps(first)}\n\n"
            while True:
                out: RequestOutput | None = await next_output(request_id, outputs, request, gaps, last)
                if out is None:
                    return
                yield f"data: {json.dumps(builder.chunk(out))}\n\n"
                if out.finished:
                    finished = True
                    if include_usage:
                        yield f"data: {json.dumps(builder.usage_chunk(len(out.output_ids)))}\n\n"
                    yield "data: [DONE]\n\n"
                    return
        except (ValueError, TypeError, EngineFailed) as error:
            finished = True
            kind = "server_error" if isinstance(error, EngineFailed) else "invalid_request_error"
            yield f"data: {json.dumps(error_body(str(error).splitlines()[0], kind))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away mid-stream: free the request's KV now
                engine.abort(request_id)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await run(body, False, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await run(body, True, request)

    return app


def serve_app(app: FastAPI, host: str, port: int, graceful_s: float = 30.0, on_started=None) -> int:
    """Run the app with uvicorn until SIGTERM/SIGINT (in-flight requests drain first); its exit code."""
    import signal

    import uvicorn

    # uvicorn drains on SIGTERM, then re-raises the signal to the handler it found: make that one
    # a no-op so a drained server exits 0 instead of dying by the default action
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=graceful_s,
                            access_log=False)
    server = uvicorn.Server(config)
    app.state.server = server
    if on_started is not None:
        app.router.on_startup.append(on_started)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return getattr(app.state, "exit_code", 0)
