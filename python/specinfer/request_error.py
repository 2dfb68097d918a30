"""A failure inside a step that belongs to some of its requests, not to the step.

Raised where a per-request value breaks a step's computation (a sampling parameter that passed
validation but fails in the dtype the step computes in, say). The engine cancels the step, ends
only the named requests with finish_reason "error" and re-raises; every other request goes on as
if the step never ran (`LLMEngine.last_failed_request_ids` names the culprits only, so a server
fails only their HTTP requests)."""
from __future__ import annotations


class RequestError(RuntimeError):
    def __init__(self, core_ids, message: str):
        super().__init__(message)
        self.core_ids = [int(c) for c in core_ids]  # the requests at fault (Rust core ids)
