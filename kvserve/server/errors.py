"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}}.

Every error the server sends goes through APIError, so no response ever carries a stack trace
or a file path: unexpected exceptions become a fixed 500 message (the detail goes to the log).
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from kvserve.sampling_params import ParamError

# status -> OpenAI error type
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 500: "internal_server_error", 503: "service_unavailable"}

# Type tags that pydantic puts into error locations of union members ("prompt", "list[int]").
_LOC_TAG = re.compile(r"[\[\]()<>,]|^(str|int|float|bool|list|dict|none|literal|function-.*)$|"
                      r"^[A-Z]")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def sse(self) -> str:
        """The error as one server-sent event, for failures after a stream has started."""
        return f"data: {json.dumps(self.body())}\n\n"


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def check_can_serve(*, draining: bool, stopped: bool, loading: bool) -> None:
    """The 503 of a server that cannot take a request now, checked in this order (api's
    ctx for one model, ModelPool.check_serving for several)."""
    if draining:
        raise APIError(503, "the server is shutting down", code="shutting_down",
                       headers={"Retry-After": "5"})
    if stopped:
        raise APIError(503, "the engine has stopped; the server cannot serve requests",
                       code="engine_dead")
    if loading:
        raise APIError(503, "the model is still loading; retry shortly", code="loading",
                       headers={"Retry-After": "5"})


def loc_to_param(loc: tuple[int | str, ...]) -> str | None:
    """('messages', 0, 'role') -> 'messages[0].role'; union type tags are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _LOC_TAG.search(part):
            out += f".{part}" if out else part
    return out or None


# Errors looked at to choose the one reported: the request models fail fast on lists, so a
# bad body has few, and a body that still has many costs no more than these.
MAX_ERRORS_FORMATTED = 32


def from_validation_error(err: ValidationError) -> APIError:
    """pydantic's 422 as OpenAI's 400: the first error, naming the field and the input."""
    errors = err.errors(include_url=False)[:MAX_ERRORS_FORMATTED]
    # A union reports one error per member; the deepest location is the most specific one
    # (content=[{"type": "image_url"}] -> content[0].type, not "content is not a string").
    first = max(errors, key=lambda e: len(loc_to_param(tuple(e.get("loc", ()))) or ""))
    param = loc_to_param(tuple(first.get("loc", ())))
    msg = first.get("msg", "invalid value").removeprefix("Value error, ")
    got = first.get("input")
    detail = ""
    if first.get("type") != "missing" and isinstance(got, (int, float, str, bool)) \
            and not isinstance(got, dict):
        detail = f", got {json.dumps(got)[:80]}"
    return bad_request(f"{param or 'body'}: {msg}{detail}", param)


def from_value_error(err: ValueError, field_names: set[str],
                     renames: dict[str, str] | None = None) -> APIError:
    """A ValueError from SamplingParams or the engine -> 400 with param = the field a
    ParamError names (renamed to the request's own name, e.g. messages for prompt); none
    for another ValueError, or a field this request does not have."""
    message = str(err) or "invalid request"
    param = err.param if isinstance(err, ParamError) else None
    if param is not None and param not in field_names and param != "prompt":
        param = None
    if param is not None and renames:
        param = renames.get(param, param)
    return bad_request(message, param)


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)
