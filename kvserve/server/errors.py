"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, and their handlers.

Every failure the app can produce goes through `error_response`, so clients (the openai package
maps status codes to exception classes) see one format: 400 for bad values (never FastAPI's 422),
401 key, 404 model, 409 sleep with requests in flight, 413 body size, 429 queue full, 500 engine
fault (``request_failed``: this request alone failed inside the engine, which serves on;
``engine_error``: the engine stopped),
503 not ready (or the engine failed to wake; it sleeps on).
"""
from __future__ import annotations

import json
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.engine.async_engine import EngineDeadError
from kvserve.engine.faults import RequestFailedError
from kvserve.errors import ConfigError, EngineBusyError, InvalidRequestError, WakeUpError

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 500: "server_error", 502: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": _encodable(message), "type": _TYPES.get(status, "invalid_request_error"),
                      "param": _encodable(param), "code": code}}


def _encodable(text: str | None) -> str | None:
    """``text`` with what UTF-8 cannot carry (a lone surrogate a client sent, echoed back in the
    message) written as its escape: the response must render, whatever the request held."""
    return text if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def to_api_error(e: BaseException) -> APIError:
    """The APIError a failure maps to; engine faults are logged here with their cause."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, InvalidRequestError):
        return APIError(400, str(e), e.field, e.code)
    if isinstance(e, ConfigError):  # an engine feature this server was not started with
        return APIError(400, str(e), e.option)
    if isinstance(e, EngineBusyError):
        return APIError(409, str(e), code="engine_busy")
    if isinstance(e, WakeUpError):  # the engine sleeps on; the request may be retried
        log.error("waking the engine failed: %s", e, exc_info=e.__cause__ or e)
        return APIError(503, str(e), code="wake_up_failed")
    if isinstance(e, RequestFailedError):
        return APIError(500, str(e), code="request_failed")  # the engine logged it with its cause
    if isinstance(e, EngineDeadError):
        log.error("request failed: %s", e, exc_info=e.__cause__ or e)
        return APIError(500, str(e), code="engine_error")
    log.error("unexpected error", exc_info=e)
    return APIError(500, f"internal error: {e!r}", code="internal_error")


def sse_error(e: BaseException) -> str:
    a = to_api_error(e)
    return f"data: {json.dumps(error_body(a.status, a.message, a.param, a.code))}\n\n"


# Union members show up in an error's loc as "str", "list[int]", "constrained-str", a model's class
# name ...: not field names (ours are snake_case identifiers), so they are left out of the message.
_UNION_TAG = re.compile(r"[\w-]*[\[-].*|str|int|float|bool|none|list|dict|[A-Z]\w*")


def _short_repr(v, limit: int = 200) -> str:
    try:
        r = repr(v)
    except ValueError:  # an int past Python's digit limit for str()
        return f"<{type(v).__name__} too large to print>"
    return r if len(r) <= limit else r[:limit] + "..."


def _path(loc: list) -> str | None:
    """A location as OpenAI's errors write it: ``messages[0].content``, ``tools[1].function.name``."""
    out = ""
    for x in loc:
        out += f"[{x}]" if isinstance(x, int) else f".{x}" if out else str(x)
    return out or None


def _loc(err: dict) -> list:
    """Where the error is, without where the value came from (body, query) and union members."""
    loc = list(err.get("loc", ()))
    if loc and loc[0] in ("body", "query", "path"):
        loc = loc[1:]
    return loc[:1] + [x for x in loc[1:] if isinstance(x, int) or not _UNION_TAG.fullmatch(str(x))]


def _validation_message(err: dict) -> tuple[str, str | None]:
    loc = _loc(err)
    param = _path(loc)
    if err.get("type") == "extra_forbidden":
        return f"Unsupported parameter: {param!r} is not supported by this server", param
    if err.get("type") == "json_invalid":
        return f"The body is not valid JSON: {err.get('msg')}", None
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, InvalidRequestError):  # from a model validator, which names the field
        field = _path(loc + [cause.field])  # within the nested model the validator checked
        return f"{field}: {cause.message}", field
    return f"{param or 'body'}: {err.get('msg')} (got {_short_repr(err.get('input'))})"[:1000], param


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(_: Request, e: APIError):
        return error_response(e.status, e.message, e.param, e.code)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, e: InvalidRequestError):
        return error_response(400, str(e), e.field, e.code)

    # Each of kvserve's own errors has its handler: Starlette re-raises what reaches the handler
    # of Exception after sending its response (a traceback in the log, the connection closed).
    @app.exception_handler(EngineDeadError)
    @app.exception_handler(RequestFailedError)
    @app.exception_handler(ConfigError)
    @app.exception_handler(EngineBusyError)
    @app.exception_handler(WakeUpError)
    async def _engine(_: Request, e: Exception):
        a = to_api_error(e)
        return error_response(a.status, a.message, a.param, a.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError):
        errs = e.errors()
        extra = [x for x in errs if x.get("type") == "extra_forbidden"]
        # Within a union, a length or range error says more than "not a string", and the member
        # that matched deepest (a missing field of an object) more than the others' refusals.
        specific = [x for x in errs if not str(x.get("type", "")).endswith("_type")]
        pick = extra or sorted(specific, key=lambda x: -len(_loc(x))) or errs or [{}]
        msg, param = _validation_message(pick[0])
        return error_response(400, msg, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def _any(_: Request, e: Exception):
        a = to_api_error(e)
        return error_response(a.status, a.message, a.param, a.code)
