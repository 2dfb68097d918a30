"""Test harness for the HTTP server: an in-process server on 127.0.0.1 (uvicorn in a thread, any
free port), raw HTTP helpers (for what the openai client hides: [DONE], disconnects, bad JSON) and
a Prometheus text parser."""
from __future__ import annotations

import http.client
import json
import re
import threading
import time
from dataclasses import dataclass

from specinfer.serve import ServeConfig, build_app, make_server


@dataclass
class RunningServer:
    app: object
    server: object
    thread: threading.Thread
    port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def engine(self):
        return self.app.state.serve.engine

    @property
    def loop(self):
        return self.app.state.serve.loop

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="unused", max_retries=0, timeout=60, **kw)

    def stop(self, timeout: float = 30) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the server thread did not stop"


def start_server(engine, config: ServeConfig | None = None, graceful_timeout_s: float = 5.0) -> RunningServer:
    app = build_app(engine, config or ServeConfig("tiny"))
    server = make_server(app, host="127.0.0.1", port=0, graceful_timeout_s=graceful_timeout_s, log_level="warning")
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    return RunningServer(app, server, thread, port)


def request(port: int, method: str, path: str, body: bytes | dict | None = None, timeout: float = 60):
    """(status, headers, body bytes) of one request over a fresh connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
    resp = conn.getresponse()
    out = resp.status, dict(resp.getheaders()), resp.read()
    conn.close()
    return out


def open_stream(port: int, path: str, body: dict, timeout: float = 60):
    """A streaming POST left open: (connection, response); read lines with response.readline()."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", path, body=json.dumps({**body, "stream": True}).encode(),
                 headers={"Content-Type": "application/json"})
    return conn, conn.getresponse()


def read_events(resp, n: int) -> list:
    """The next `n` SSE payloads (dicts, or "[DONE]") of an open stream."""
    events = []
    while len(events) < n:
        line = resp.readline()
        if not line:
            break
        line = line.strip()
        if line.startswith(b"data: "):
            data = line[len(b"data: "):].decode()
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def scrape(port: int) -> dict[str, float]:
    """GET /metrics as {"name{labels}": value} (labels as written by prometheus_client)."""
    status, headers, body = request(port, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    out = {}
    for line in body.decode().splitlines():
        m = _SAMPLE.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def wait_for(predicate, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def idle_and_free(port: int) -> bool:
    m = scrape(port)
    return (m["specinfer_num_requests_running"] == 0 and m["specinfer_num_requests_waiting"] == 0
            and m["specinfer_kv_blocks_used"] == 0)
