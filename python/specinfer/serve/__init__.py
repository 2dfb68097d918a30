"""`specinfer serve`: an OpenAI-compatible HTTP server over the engine (the `serve` extra:
`pip install specinfer[serve]`).

    from specinfer import Generator
    from specinfer.serve import ServeConfig, build_app, make_server

    engine = Generator("smollm2-135m", speculative={"method": "ngram", "num_speculative_tokens": 4}).engine
    make_server(build_app(engine, ServeConfig("smollm2-135m")), port=8000).run()

Files, one noun each: `app` (the ASGI app and its lifespan), `routes` (the endpoints),
`protocol` (request bodies), `responses` (response bodies and chunks), `generation` (one HTTP
request's run), `streaming` (SSE bodies), `sse` (the wire format), `engine_loop` (the thread that
owns the engine), `metrics` (Prometheus), `errors` (OpenAI error bodies), `server` (uvicorn with a
graceful shutdown).
"""
from __future__ import annotations

from specinfer.serve.app import ServeConfig, build_app
from specinfer.serve.server import make_server

__all__ = ["ServeConfig", "build_app", "make_server"]
