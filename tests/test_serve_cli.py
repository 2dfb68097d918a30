"""`specinfer serve` as a user runs it: a subprocess on a tiny model, its flags checked before the
model loads, and a graceful shutdown (SIGTERM: the request in flight finishes, exit status 0, no
traceback; no grace left: in-flight requests are aborted with an error event)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from serve_harness import open_stream, read_events, request

ROOT = Path(__file__).resolve().parents[1]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


class CliServer:
    """`python -m specinfer serve ...` on port 0; the bound port is read from uvicorn's log."""

    def __init__(self, *args):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specinfer", "serve", *map(str, args), "--host", "127.0.0.1", "--port", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=ROOT)
        self.lines: list[str] = []
        self.port = None
        ready = threading.Event()

        def pump():
            for line in self.proc.stdout:
                self.lines.append(line)
                m = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", line)
                if m:
                    self.port = int(m.group(1))
                    ready.set()
            ready.set()

        self.pump = threading.Thread(target=pump, daemon=True)
        self.pump.start()
        if not ready.wait(120) or self.port is None:
            self.proc.kill()
            raise AssertionError("the server did not start:\n" + "".join(self.lines))

    def finish(self, timeout=60) -> tuple[int, str]:
        code = self.proc.wait(timeout)
        self.pump.join(10)
        return code, "".join(self.lines)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    path, _ = tiny_dir("llama", seed=3)
    return path


ENGINE = ["--num-kv-blocks", "64", "--block-size", "8", "--max-model-len", "256"]
LONG = {"prompt": "t5 t6 t7 t5 t6", "max_tokens": 240, "temperature": 0, "ignore_eos": True}


def test_sigterm_lets_in_flight_requests_finish_and_exits_cleanly(tiny):
    srv = CliServer(tiny, *ENGINE, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
    status, _, body = request(srv.port, "GET", "/v1/models")
    assert status == 200 and str(tiny).encode() in body
    conn, resp = open_stream(srv.port, "/v1/completions", LONG)
    assert read_events(resp, 1)
    srv.proc.send_signal(signal.SIGTERM)
    rest = read_events(resp, 10_000)
    conn.close()
    assert rest[-1] == "[DONE]" and rest[-2]["choices"][0]["finish_reason"] == "length"
    assert rest[-2]["usage"]["completion_tokens"] == 240 and rest[-2]["usage"]["speculative"]["num_drafts"] > 0
    code, log = srv.finish()
    assert code == 0, log
    assert "Traceback" not in log and "speculation: ngram, k=3" in log
    assert "waiting up to 30 s for 1 request(s) in flight" in log  # it was in flight, and it finished:
    assert "shut down; requests finished: 1, aborted at shutdown: 0" in log


def test_shutdown_without_grace_aborts_in_flight_requests_with_an_error_event(tiny):
    """In process (the signal handler's own call): the stream ends with an error event and [DONE],
    and the engine ends with every block free."""
    from serve_harness import start_server
    from specinfer import Generator

    gen = Generator(str(tiny), num_kv_blocks=64, block_size=8, max_model_len=256)
    srv = start_server(gen.engine, graceful_timeout_s=0)
    conn, resp = open_stream(srv.port, "/v1/completions", LONG)
    assert read_events(resp, 1)
    srv.server.handle_exit(signal.SIGINT, None)  # what uvicorn's SIGINT handler does
    rest = read_events(resp, 10_000)
    conn.close()
    assert rest[-1] == "[DONE]" and rest[-2]["error"]["code"] == "shutting_down", rest[-3:]
    assert all("choices" in e and e["choices"][0]["finish_reason"] is None for e in rest[:-2])
    srv.thread.join(30)
    assert not srv.thread.is_alive()
    loop = srv.loop
    assert loop.num_finished == 0 and loop.num_aborted_at_shutdown == 1 and loop.fatal is None
    assert not gen.engine.has_unfinished_requests()
    assert gen.engine.core.num_free_blocks() == gen.engine.core.num_total_blocks()


def test_serve_help_and_flag_errors_before_loading(tiny, capsys):
    from specinfer.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("usage: specinfer serve")
    for flag in ("--host", "--port", "--speculative-config", "--method", "-k", "--max-waiting-requests",
                 "--shutdown-timeout", "--num-kv-blocks"):
        assert flag in out
    cases = [(["--port", "70000"], "--port"), (["--speculative-config", "{"], "not valid JSON"),
             (["--speculative-config", '{"method": "ngram"}', "-k", "3"], "cannot be combined with -k"),
             (["--speculative-config", '{"method": "ngram", "bogus": 1}'], "bogus"),
             (["--max-waiting-requests", "-1"], "--max-waiting-requests")]
    for extra, fragment in cases:
        assert main(["serve", str(tiny), *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("specinfer serve: error: ") and fragment in err[0], err
