"""What stands between a socket and the routes: connection timeouts, the body limit, JSON off the loop, API keys.

- ``guarded_protocol(header_timeout_s)``: uvicorn's h11 protocol, except that a connection must deliver
  its request headers within the limit, counted from the connection (and from the end of the previous
  response on keep-alive): a slowloris client that trickles a byte a second is closed, not kept forever.
- ``read_json(request, model, limits)``: the body read with a size cap (413 from Content-Length or while
  reading) and a time cap (408), JSON parsing and validation of large bodies in a worker thread, pydantic
  errors as ``RequestError`` naming the field.
- ``ApiKeyMiddleware``: ``Authorization: Bearer <key>`` on every /v1 route (401 in OpenAI's shape), compared
  in constant time; /health and /metrics stay open.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re

from pydantic import BaseModel, ValidationError
from uvicorn.protocols.http.h11_impl import H11Protocol

from .limits import ServerLimits
from .protocol import RequestError, error_body

__all__ = ["guarded_protocol", "read_json", "ApiKeyMiddleware", "validation_error"]

_UNION_MEMBER = re.compile(r"^(str|int|float|bool|none|dict|list|[A-Za-z_]+\[.*\])$")
# bodies above this are parsed and validated in a thread (json.loads of a 16 MB body takes ~30 ms)
_INLINE_BYTES = 64 * 1024


class _GuardedH11(H11Protocol):
    header_timeout_s = 10.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer = None
        self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _cancel_header_timer(self) -> None:
        if getattr(self, "_header_timer", None) is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        waiting_for_headers = self.cycle is None or self.cycle.response_complete
        if waiting_for_headers and not self.transport.is_closing():
            self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete:  # a request's headers arrived
            self._cancel_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_timer()  # the next request on this connection gets the same limit

    def connection_lost(self, exc) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)


def guarded_protocol(header_timeout_s: float) -> type:
    """uvicorn's ``http`` protocol class with a header deadline of ``header_timeout_s`` seconds."""
    return type("GuardedH11Protocol", (_GuardedH11,), {"header_timeout_s": header_timeout_s})


def validation_error(error: ValidationError) -> RequestError:
    """The first pydantic error as OpenAI's 400, naming the field (``messages.0.content``)."""
    first = error.errors()[0] if error.errors() else {}
    # pydantic names the member of a union it tried ("str", "list[ContentPart]"): not part of the field's path
    location = [str(x) for x in first.get("loc", ()) if x != "body" and not _UNION_MEMBER.match(str(x))]
    param = ".".join(location) or None
    return RequestError(f"{param or 'body'}: {first.get('msg', 'invalid value')}", param)


async def _read_body(request, limits: ServerLimits) -> bytes:
    declared = request.headers.get("content-length")
    too_large = RequestError(f"the request body exceeds {limits.max_body_bytes} bytes (--max-body-bytes)", None, 413)
    if declared is not None:
        if not declared.strip().isdigit():
            raise RequestError("Content-Length is not a number")
        if int(declared) > limits.max_body_bytes:
            raise too_large
    chunks, size = [], 0

    async def gather():
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limits.max_body_bytes:
                raise too_large
            chunks.append(chunk)

    try:
        await asyncio.wait_for(gather(), limits.body_timeout_s)
    except asyncio.TimeoutError:
        raise RequestError(f"the request body did not arrive within {limits.body_timeout_s:g} s", None, 408) from None
    return b"".join(chunks)


def _parse(body: bytes, model: type[BaseModel]) -> BaseModel:
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as error:
        raise RequestError(f"the body is not valid JSON: {error}") from None
    except RecursionError:  # (the parser recurses per level: ~1,000 nested arrays or objects exhaust it)
        raise RequestError("the body nests JSON arrays or objects too deeply") from None
    if not isinstance(data, dict):
        raise RequestError("the body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise validation_error(error) from None


async def read_json(request, model: type[BaseModel], limits: ServerLimits) -> BaseModel:
    """The request body as ``model``; RequestError (400 / 408 / 413) otherwise.  The loop never parses a big body."""
    body = await _read_body(request, limits)
    if len(body) <= _INLINE_BYTES:
        return _parse(body, model)
    return await asyncio.get_running_loop().run_in_executor(None, _parse, body, model)


class ApiKeyMiddleware:
    """Pure ASGI: /v1 routes need ``Authorization: Bearer <api_key>``; other paths pass."""

    def __init__(self, app, api_key: str):
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                body = json.dumps(error_body("Incorrect API key provided: send Authorization: Bearer <key>",
                                             "invalid_request_error", None, "invalid_api_key")).encode()
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode()),
                                        (b"www-authenticate", b"Bearer")]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
