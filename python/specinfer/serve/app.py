"""The ASGI application: the routes over one engine loop that starts and stops with the app's
lifespan (uvicorn's startup and graceful shutdown)."""
from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from concurrent.futures import ThreadPoolExecutor

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from specinfer.serve.engine_loop import EngineLoop
from specinfer.serve.errors import ApiError
from specinfer.serve.guard import Guard
from specinfer.serve.metrics import ServerMetrics
from specinfer.serve.routes import ROUTES


@dataclass(frozen=True)
class ServeConfig:
    model_name: str  # what /v1/models lists and requests' "model" must name
    max_requests_in_flight: int = 512  # admitted and not ended; the next one gets 429
    stop_timeout_s: float = 30.0  # how long shutdown waits for the engine thread to end its step
    # access (serve/guard.py)
    api_key: str | None = None  # every endpoint but /health needs "Authorization: Bearer <key>"
    metrics_need_key: bool = False  # /metrics behind the key too
    allowed_hosts: tuple[str, ...] | None = None  # Host header values served (None: any)
    allowed_origins: tuple[str, ...] = ()  # CORS: origins whose pages may call the API (none)
    # bounds: every client-controlled quantity has one
    max_body_bytes: int = 4 * 2**20  # request body (413 past it)
    max_prompt_bytes: int | None = None  # prompt text, checked before tokenizing (None: 64 x max_model_len)
    max_prompts_per_request: int = 16  # a completions `prompt` list longer than this is a 400
    body_timeout_s: float = 30.0  # the whole body must arrive within this (408)
    write_timeout_s: float = 60.0  # a response chunk the client does not take within this ends it
    header_timeout_s: float = 10.0  # the request head must arrive within this (the connection closes)
    keep_alive_timeout_s: float = 5.0  # an idle keep-alive connection closes after this
    max_connections: int = 1024  # connections and tasks at once; beyond: 503
    max_stream_backlog: int = 2048  # outputs queued for one request that its client has not taken
    tokenizer_threads: int = 2  # tokenization and chat templates run here, off the event loop

    def __post_init__(self):
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError("ServeConfig.model_name must be a non-empty string")
        for name in ("max_requests_in_flight", "max_body_bytes", "max_prompts_per_request", "max_connections",
                     "max_stream_backlog", "tokenizer_threads"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ServeConfig.{name} must be an integer >= 1 (got {v!r})")
        if self.max_prompt_bytes is not None and (not isinstance(self.max_prompt_bytes, int)
                                                  or self.max_prompt_bytes < 1):
            raise ValueError(f"ServeConfig.max_prompt_bytes must be an integer >= 1 or None "
                             f"(got {self.max_prompt_bytes!r})")
        for name in ("stop_timeout_s", "body_timeout_s", "write_timeout_s", "header_timeout_s",
                     "keep_alive_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ServeConfig.{name} must be > 0 (got {getattr(self, name)!r})")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("ServeConfig.api_key must be a non-empty string or None")


class ServeState:
    """What the handlers share: the engine (read-only: tokenizer, validate), its loop, the
    metrics, the chat template."""

    def __init__(self, engine, config: ServeConfig):
        from specinfer.chat_template import ChatTemplate

        self.engine = engine
        self.config = config
        self.model_name = config.model_name
        self.max_model_len = engine.max_model_len
        self.created = int(time.time())
        self.metrics = ServerMetrics()
        self.loop = EngineLoop(engine, self.metrics, capacity=config.max_requests_in_flight,
                               max_backlog=config.max_stream_backlog)
        self.template = ChatTemplate.for_model(engine.loaded)
        self.max_prompt_bytes = config.max_prompt_bytes or 64 * engine.max_model_len
        # tokenization and chat templates: off the event loop, so /health and streams never wait on them
        self.tokenize_pool = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="specinfer-tokenize")

    async def off_loop(self, fn, *args):
        """fn(*args) on the tokenizer pool (the event loop stays free)."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, fn, *args)


def build_app(engine, config: ServeConfig) -> Starlette:
    """The OpenAI-compatible app over `engine` (an LLMEngine, e.g. `Generator(...).engine`). Serve
    it with uvicorn; the engine loop runs from the app's startup to its shutdown."""
    state = ServeState(engine, config)

    @asynccontextmanager
    async def lifespan(app):
        state.loop.start(asyncio.get_running_loop())
        try:
            yield
        finally:  # after uvicorn's graceful wait: abort what is left, end the engine thread
            await asyncio.get_running_loop().run_in_executor(None, state.loop.stop, config.stop_timeout_s)
            state.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        err = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", None,
                       "not_found" if exc.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=exc.status_code)

    middleware = []
    if config.allowed_origins:  # CORS is off unless origins are named
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                                     allow_methods=["GET", "POST"], allow_headers=["authorization", "content-type"]))
    middleware.append(Middleware(Guard, config=config))
    app = Starlette(routes=ROUTES, lifespan=lifespan, exception_handlers={HTTPException: http_error},
                    middleware=middleware)
    app.state.serve = state
    return app
