"""The ASGI application: the routes over one engine loop that starts and stops with the app's
lifespan (uvicorn's startup and graceful shutdown)."""
from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from specinfer.serve.engine_loop import EngineLoop
from specinfer.serve.errors import ApiError
from specinfer.serve.metrics import ServerMetrics
from specinfer.serve.routes import ROUTES


@dataclass(frozen=True)
class ServeConfig:
    model_name: str  # what /v1/models lists and requests' "model" must name
    max_requests_in_flight: int = 512  # admitted and not ended; the next one gets 429
    stop_timeout_s: float = 30.0  # how long shutdown waits for the engine thread to end its step

    def __post_init__(self):
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError("ServeConfig.model_name must be a non-empty string")
        if not isinstance(self.max_requests_in_flight, int) or self.max_requests_in_flight < 1:
            raise ValueError(f"ServeConfig.max_requests_in_flight must be an integer >= 1 "
                             f"(got {self.max_requests_in_flight!r})")
        if not self.stop_timeout_s > 0:
            raise ValueError(f"ServeConfig.stop_timeout_s must be > 0 (got {self.stop_timeout_s!r})")


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
        self.loop = EngineLoop(engine, self.metrics, capacity=config.max_requests_in_flight)
        self.template = ChatTemplate.for_model(engine.loaded)


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

    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        err = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", None,
                       "not_found" if exc.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=exc.status_code)

    app = Starlette(routes=ROUTES, lifespan=lifespan, exception_handlers={HTTPException: http_error})
    app.state.serve = state
    return app
