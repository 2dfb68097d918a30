"""The server's one error type and the OpenAI-style body it becomes:
`{"error": {"message", "type", "param", "code"}}` with the HTTP status it is sent with."""
from __future__ import annotations

import re
from dataclasses import dataclass

# HTTP status -> the OpenAI error "type" clients switch on
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error",
               500: "server_error", 503: "service_unavailable_error"}


@dataclass
class ApiError(Exception):
    status: int
    message: str
    param: str | None = None  # the request field at fault, when one is
    code: str | None = None

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def __str__(self) -> str:
        return self.message


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
