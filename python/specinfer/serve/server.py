"""Running the app under uvicorn, with a graceful shutdown on SIGINT / SIGTERM:

1. stop accepting connections, and answer new requests on open ones with 503;
2. let the requests in flight finish, for up to `graceful_timeout_s`;
3. abort those still running: a stream ends with an error event and `[DONE]`, a plain request
   gets a 503 (so every client hears why, rather than seeing its connection cut);
4. uvicorn's own shutdown (connections close, the lifespan ends the engine thread);
5. return normally (exit status 0), without re-raising the signal as uvicorn would.
A second SIGINT skips the wait (uvicorn's force exit).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time

import uvicorn

from specinfer.serve.connection import protocol_with_header_timeout

log = logging.getLogger("uvicorn.error")  # uvicorn's own log, so the lines interleave in order

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# after step 3, how long uvicorn may wait for the last bytes to reach slow clients
CLOSE_TIMEOUT_S = 5.0


class Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine_loop, graceful_timeout_s: float):
        super().__init__(config)
        self.engine_loop = engine_loop
        self.graceful_timeout_s = graceful_timeout_s

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

    async def shutdown(self, sockets=None) -> None:
        for server in self.servers:  # stop accepting; uvicorn's shutdown below does it again, harmlessly
            server.close()
        self.engine_loop.drain()
        if self.engine_loop.in_flight:
            log.info("Graceful shutdown: waiting up to %g s for %d request(s) in flight",
                     self.graceful_timeout_s, self.engine_loop.in_flight)
        deadline = time.monotonic() + self.graceful_timeout_s
        while self.engine_loop.in_flight and time.monotonic() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)
        if self.engine_loop.in_flight:
            log.info("Graceful shutdown: aborting %d request(s) still in flight", self.engine_loop.in_flight)
            self.engine_loop.abort_all()
            deadline = time.monotonic() + 1.0
            while self.engine_loop.in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)  # the handlers write their last events
        await super().shutdown(sockets)


def make_server(app, *, host: str = "127.0.0.1", port: int = 8000, graceful_timeout_s: float = 30.0,
                log_level: str = "info", access_log: bool = False) -> Server:
    """A uvicorn server for an app from `build_app`."""
    serve = app.state.serve.config
    _raise_open_files_limit()
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=CLOSE_TIMEOUT_S, lifespan="on",
                            http=protocol_with_header_timeout(serve.header_timeout_s),
                            timeout_keep_alive=serve.keep_alive_timeout_s,
                            limit_concurrency=serve.max_connections,
                            h11_max_incomplete_event_size=64 * 1024)  # a request head past 64 KiB: 400
    return Server(config, app.state.serve.loop, graceful_timeout_s)


def _raise_open_files_limit() -> None:
    """The soft limit on open files up to the hard one: connections beyond --max-connections are
    answered 503, not lost to EMFILE in accept() (which uvicorn logs once per attempt)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or hard > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else max(soft, 65536),
                                                        hard))
    except (ImportError, ValueError, OSError):
        pass
