"""The server's outer wall, one ASGI middleware in front of the routes: what a request must be
before any handler runs, and how long a client may take.

- Host: with `allowed_hosts`, a Host header naming anything else is refused (400): a page on
  another origin cannot reach a local server through DNS rebinding.
- API key: with `api_key`, every endpoint but /health (and /metrics unless `metrics_need_key`)
  needs `Authorization: Bearer <key>` (401 otherwise; compared in constant time).
- POST bodies must say `Content-Type: application/json` (415): a cross-origin "simple" request
  (text/plain, form data) from a web page cannot run a generation.
- Bodies are read here, bounded in size (413, at once when Content-Length says so) and in time
  (408 when the whole body has not arrived within `body_timeout_s`), and handed to the route.
- Writes: a response chunk the client does not take within `write_timeout_s` ends the
  connection (a client that never reads cannot hold a stream's memory forever).
- CORS headers only for `allowed_origins` (none by default).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging

log = logging.getLogger("specinfer.serve")

OPEN_PATHS = ("/health",)  # reachable without the API key
try:
    _ExceptionGroup = BaseExceptionGroup
except NameError:  # Python 3.10: no exception groups
    _ExceptionGroup = ()


class SlowClient(Exception):
    """The client did not take a response chunk within the write timeout."""


def _error(status: int, message: str, code: str, param: str | None = None, headers=()) -> tuple[dict, dict]:
    from specinfer.serve.errors import ERROR_TYPES

    body = json.dumps({"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                                 "param": param, "code": code}}).encode()
    start = {"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                         *headers]}
    return start, {"type": "http.response.body", "body": body}


def _header(scope, name: bytes) -> bytes | None:
    for k, v in scope.get("headers", ()):
        if k.lower() == name:
            return v
    return None


def host_name(host_header: bytes) -> str:
    """The host of a Host header value, without its port ("[::1]:8000" -> "[::1]")."""
    h = host_header.decode("latin-1").strip().lower()
    if h.startswith("["):
        return h[: h.index("]") + 1] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


class Guard:
    def __init__(self, app, config):
        self.app = app
        self.config = config
        self.allowed_hosts = None if config.allowed_hosts is None else {h.lower() for h in config.allowed_hosts}
        self.key = None if config.api_key is None else config.api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self._refusal(scope)
        if refusal is not None:
            return await self._send_all(send, refusal)
        if scope["method"] in ("POST", "PUT", "PATCH"):
            body_or_refusal = await self._read_body(scope, receive)
            if isinstance(body_or_refusal, tuple):
                return await self._send_all(send, body_or_refusal)
            receive = _replay(body_or_refusal, receive)
        timeout = self.config.write_timeout_s

        async def bounded_send(message):
            try:
                await asyncio.wait_for(send(message), timeout)
            except asyncio.TimeoutError:
                raise SlowClient(f"the client took no data for {timeout:g} s") from None

        try:
            await self.app(scope, receive, bounded_send)
        except SlowClient as e:  # the transport is closed by the ASGI server; the handler aborted
            log.warning("%s %s: %s; connection closed", scope["method"], scope["path"], e)
        except _ExceptionGroup as eg:  # starlette's task groups wrap it
            slow, rest = eg.split(SlowClient)
            if rest is not None:
                raise rest
            log.warning("%s %s: %s; connection closed", scope["method"], scope["path"], slow.exceptions[0])

    def _refusal(self, scope):
        if self.allowed_hosts is not None:
            host = _header(scope, b"host")
            if host is None or host_name(host) not in self.allowed_hosts:
                return _error(400, "the Host header names a host this server does not serve", "invalid_host")
        path = scope["path"]
        needs_key = self.key is not None and path not in OPEN_PATHS and not (
            path == "/metrics" and not self.config.metrics_need_key)
        if needs_key:
            auth = _header(scope, b"authorization") or b""
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                return _error(401, "a valid API key is required: Authorization: Bearer <key>", "invalid_api_key",
                              headers=[(b"www-authenticate", b"Bearer")])
        if scope["method"] in ("POST", "PUT", "PATCH"):
            ctype = (_header(scope, b"content-type") or b"").split(b";")[0].strip().lower()
            if ctype != b"application/json":
                return _error(415, "the body must be JSON, sent with Content-Type: application/json",
                              "unsupported_media_type")
            length = _header(scope, b"content-length")
            if length is not None:
                try:
                    n = int(length)
                except ValueError:
                    return _error(400, "Content-Length is not a number", "invalid_request")
                if n > self.config.max_body_bytes:
                    return self._too_large()
        return None

    def _too_large(self):
        return _error(413, f"the request body exceeds {self.config.max_body_bytes} bytes", "body_too_large")

    async def _read_body(self, scope, receive):
        """The whole body, or a refusal (413 past the size limit, 408 past the time limit)."""
        limit = self.config.max_body_bytes
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.body_timeout_s
        chunks, size = [], 0
        while True:
            left = deadline - loop.time()
            try:
                message = await asyncio.wait_for(receive(), max(left, 0.0))
            except asyncio.TimeoutError:
                return _error(408, f"the request body did not arrive within {self.config.body_timeout_s:g} s",
                              "body_timeout", headers=[(b"connection", b"close")])
            if message["type"] == "http.disconnect":
                return _error(400, "the client disconnected", "client_gone")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return self._too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    @staticmethod
    async def _send_all(send, refusal) -> None:
        start, body = refusal
        await send(start)
        await send(body)


def _replay(body: bytes, receive):
    """A receive that hands the route the body read here, then the connection's own messages
    (so a disconnect is still seen)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
