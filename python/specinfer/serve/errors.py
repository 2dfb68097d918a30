"""The server's one error type and the OpenAI-style body it becomes:
`{"error": {"message", "type", "param", "code"}}` with the HTTP status it is sent with."""
from __future__ import annotations

import logging
import re
import uuid
from dataclasses import dataclass

log = logging.getLogger("specinfer.serve")

# HTTP status -> the OpenAI error "type" clients switch on
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               408: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
               429: "rate_limit_error", 500: "server_error", 503: "service_unavailable_error"}
RETRY_AFTER_S = 1  # the Retry-After of 429 and 503 answers


@dataclass
class ApiError(Exception):
    status: int
    message: str
    param: str | None = None  # the request field at fault, when one is
    code: str | None = None

    @property
    def headers(self) -> dict:
        return {"Retry-After": str(RETRY_AFTER_S)} if self.status in (429, 503) else {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def __str__(self) -> str:
        return self.message


def internal_error(what: str, code: str, error: BaseException) -> ApiError:
    """A 500 whose body carries an id, not the exception's text; the text goes to the server log
    under that id."""
    error_id = uuid.uuid4().hex[:16]
    log.error("%s [error id %s]: %s: %s", what, error_id, type(error).__name__, error, exc_info=error)
    return ApiError(500, f"{what} (error id {error_id}; the server log has the details)", None, code)


def invalid(message: str, param: str | None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param, code)


_SAMPLING_FIELD = re.compile(r"SamplingParams\.(\w+)")


def from_value_error(e: ValueError, renames: dict[str, str], prompt_param: str) -> ApiError:
    """A ValueError from SamplingParams or engine.validate as a 400 naming the request field.

    SamplingParams says `SamplingParams.<field> ...`; engine.validate speaks of the prompt. Field
    names that differ between the engine and the API (chat's `top_logprobs`) go through `renames`.
    """
    text = " ".join(str(e).split())
    m = _SAMPLING_FIELD.search(text)
    if m:
        field = m.group(1)
        param = renames.get(field, field)
        text = text.replace(m.group(0), param, 1)
    elif "prompt" in text.lower() or "token id" in text.lower():
        param = prompt_param
    else:
        param = None
    return invalid(text, param)
