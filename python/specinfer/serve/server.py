"""Running the app under uvicorn, with a graceful shutdown on SIGINT / SIGTERM: stop accepting,
let in-flight requests finish for up to `graceful_timeout_s`, then abort the rest (their clients get
an error), end the engine thread and return normally (exit status 0)."""
from __future__ import annotations

import contextlib
import signal
import threading

import uvicorn

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Server(uvicorn.Server):
    """uvicorn's server, minus re-raising the caught signal after the graceful shutdown (which
    would turn a clean SIGTERM shutdown into death by signal)."""

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def make_server(app, *, host: str = "127.0.0.1", port: int = 8000, graceful_timeout_s: float = 30.0,
                log_level: str = "info", access_log: bool = False) -> Server:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=graceful_timeout_s, lifespan="on")
    return Server(config)
