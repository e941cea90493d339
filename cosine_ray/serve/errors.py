"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``, never a traceback.

Status codes: 400 invalid request (FastAPI's 422, malformed JSON and non-object bodies
remapped), 401 bad key, 404 unknown path or model, 405 wrong method, 408 body not received in
time or request past its timeout, 413 body too large, 429 + Retry-After a key over its limits,
503 + Retry-After engine unavailable, 500 (logged, no internals) for anything unexpected.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_BODY_TIMEOUT_S = 30.0
"""Longest wait for a request's whole body: a slower sender gets 408 and gives its slot back."""
DEFAULT_MAX_HEADER_BYTES = 64 << 10
"""Request headers larger than this (names + values, all headers) get 431. uvicorn's
httptools parser accepts megabytes of headers, so the app enforces its own bound."""

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
               413: "invalid_request_error", 429: "rate_limit_error", 431: "invalid_request_error",
               500: "server_error",
               503: "service_unavailable_error"}
ERROR_CODES = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed", 408: "timeout",
               413: "request_too_large", 429: "rate_limit_exceeded", 431: "headers_too_large",
               500: "internal_error",
               503: "engine_unavailable"}
OVERLOADED_CODE = "server_overloaded"
"""``code`` of the 503 sent when a replica already holds ``max_pending_requests`` generations."""


class OpenAIError(Exception):
    """An error the client should see as is; subclasses fix the status code."""

    status_code = 400

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def payload(self) -> dict[str, Any]:
        return error_payload(self.status_code, self.message, param=self.param, code=self.code)


class InvalidRequest(OpenAIError):
    status_code = 400


class NotFound(OpenAIError):
    status_code = 404


class RequestTimeout(OpenAIError):
    """The request ran past the server's ``request_timeout_s``; its engine work was cancelled."""

    status_code = 408


class RateLimited(OpenAIError):
    """The client's API key is over one of its limits or its fair share: 429 + Retry-After."""

    status_code = 429

    def __init__(self, message: str, *, retry_after: float = 1.0) -> None:
        super().__init__(message, code="rate_limit_exceeded",
                         headers={"Retry-After": str(max(1, math.ceil(retry_after)))})


class EngineUnavailable(OpenAIError):
    """The engine cannot take the request now (overloaded, a stage recovering): 503 + Retry-After."""

    status_code = 503

    def __init__(self, message: str = "the engine is unavailable; retry later", *,
                 retry_after: float = 1.0, code: str | None = "engine_unavailable") -> None:
        self.retry_after = retry_after
        super().__init__(message, code=code,
                         headers={"Retry-After": str(max(1, math.ceil(retry_after)))})


def error_payload(status_code: int, message: str, *, param: str | None = None,
                  code: str | None = None, type: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type or ERROR_TYPES.get(status_code, "server_error"),
                      "param": param, "code": code if code is not None else ERROR_CODES.get(status_code)}}


def error_response(status_code: int, message: str, *, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_payload(status_code, message, param=param, code=code),
                        status_code=status_code, headers=headers)


def format_loc(loc: Sequence[Any]) -> str:
    """("messages", 0, "role") -> "messages[0].role"."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def describe_validation_error(errors: Sequence[dict[str, Any]]) -> tuple[str, str | None, str]:
    """(message, param, code) for the first error of a FastAPI/pydantic validation failure."""
    if not errors:
        return "invalid request", None, "invalid_value"
    err = errors[0]
    kind = err.get("type", "")
    loc = list(err.get("loc", ()))
    if loc and loc[0] == "body":
        loc = loc[1:]
    if kind == "json_invalid":
        detail = (err.get("ctx") or {}).get("error") or err.get("msg", "")
        return f"request body is not valid JSON: {detail}", None, "invalid_json"
    if kind == "string_unicode":  # a lone UTF-16 surrogate where pydantic itself reads a str (a key)
        where = format_loc(loc) if loc else "a key of the request body"
        return f"{where} is not valid Unicode (lone UTF-16 surrogate)", format_loc(loc) or None, "invalid_value"
    if not loc:
        if kind == "missing":
            return "request body is required: a JSON object", None, "invalid_body"
        return "request body must be a JSON object", None, "invalid_body"
    param = format_loc(loc)
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    code = "missing_required_parameter" if kind == "missing" else "invalid_value"
    return f"{param}: {msg}", param, code


# ---- handlers ---------------------------------------------------------------------------------

async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    message, param, code = describe_validation_error(exc.errors())
    return error_response(400, message, param=param, code=code)


async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.payload(), status_code=exc.status_code, headers=exc.headers)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    status = exc.status_code
    headers = dict(exc.headers or {})
    detail, code = str(exc.detail), None
    if status == 404 and detail == "Not Found":
        message = f"unknown path {request.url.path}"
    elif status == 405:
        allowed = headers.get("Allow") or headers.get("allow")
        message = f"method {request.method} is not allowed for {request.url.path}" + (
            f"; use {allowed}" if allowed else "")
    elif status == 400 and detail == "There was an error parsing the body":
        message, code = "request body could not be parsed (invalid JSON or encoding)", "invalid_json"
    else:
        message = detail
    return error_response(status, message, code=code, headers=headers or None)


def install_error_handlers(app: FastAPI) -> None:
    """Handlers for validation, OpenAIError and HTTP errors; add ``BodyLimitMiddleware`` and
    ``CatchAllMiddleware`` (outermost) yourself, around whatever else you add."""
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)


# ---- ASGI middlewares -------------------------------------------------------------------------

class BodyLimitMiddleware:
    """413 when Content-Length or the bytes actually received exceed ``max_body_bytes``; 408
    when the whole body has not arrived within ``body_timeout_s`` (a slow sender would hold its
    connection and a Serve slot for as long as it likes).

    The body is read up front (at most the limit) and replayed to the app; later ``receive``
    calls go to the server, so disconnect detection still works."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> None:
        if max_body_bytes < 1:
            raise ValueError("max_body_bytes must be >= 1")
        if not body_timeout_s > 0:
            raise ValueError("body_timeout_s must be > 0")
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    def _too_large(self) -> JSONResponse:
        return error_response(413, f"request body is larger than {self.max_body_bytes} bytes")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                return await error_response(400, "invalid Content-Length header")(scope, receive, send)
            if declared > self.max_body_bytes:
                return await self._too_large()(scope, receive, send)
        chunks: list[bytes] = []
        try:
            async with asyncio.timeout(self.body_timeout_s):
                if not await self._read(receive, chunks):
                    return  # the client left
        except TimeoutError:
            response = error_response(408, f"the request body did not arrive within {self.body_timeout_s:g} s",
                                      code="body_timeout", headers={"Connection": "close"})
            return await response(scope, receive, send)
        except _TooLarge:
            return await self._too_large()(scope, receive, send)
        body = b"".join(chunks)
        is_replayed = False

        async def replay() -> Message:
            nonlocal is_replayed
            if not is_replayed:
                is_replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


    async def _read(self, receive: Receive, chunks: list[bytes]) -> bool:
        """The body's chunks into ``chunks``; False if the client left first."""
        total = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return False
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_body_bytes:
                raise _TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return True


class _TooLarge(Exception):
    pass


class HeaderLimitMiddleware:
    """431 when the request's headers (names + values) exceed ``max_header_bytes``."""

    def __init__(self, app: ASGIApp, *, max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES) -> None:
        self.app = app
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            size = sum(len(k) + len(v) for k, v in scope.get("headers") or ())
            if size > self.max_header_bytes:
                response = error_response(431, f"request headers are {size} bytes; the limit is "
                                               f"{self.max_header_bytes}")
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


class CatchAllMiddleware:
    """Any exception that escapes the app becomes a logged 500 in the OpenAI shape."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        is_started = False

        async def watched_send(message: Message) -> None:
            nonlocal is_started
            if message["type"] == "http.response.start":
                is_started = True
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except (ClientDisconnect, ConnectionError):
            log.debug("client went away during %s %s", scope.get("method"), scope.get("path"))
        except Exception:
            log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if is_started:
                raise  # headers are out: let the server drop the connection
            await error_response(500, "internal server error")(scope, receive, send)
