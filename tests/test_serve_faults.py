"""A failure inside an engine step fails only the requests of that step; the server goes on.

Two levels: the engine loop's policy against a scripted fake engine (which requests it fails,
that it never spins on a failing step, that it blocks when idle, that it refuses beyond capacity
and aborts what is left at shutdown), and the real server on a tiny model whose forward raises
once (this needs the engine's step transaction: a failed step is cancelled, the engine stays
usable)."""
from __future__ import annotations

import asyncio
import json
import threading

import pytest

from serve_harness import idle_and_free, open_stream, read_events, request, scrape, start_server, wait_for
from specinfer import Generator, SamplingParams
from specinfer.outputs import RequestOutput
from specinfer.serve import ServeConfig
from specinfer.serve.engine_loop import EngineLoop, Submission
from specinfer.serve.errors import ApiError
from specinfer.serve.metrics import ServerMetrics


# ------------------------------------------------------------------ the loop against a fake engine
class FakeCore:
    def __init__(self, engine):
        self.engine = engine

    def num_running(self):
        return len(self.engine.reqs)

    def num_waiting(self):
        return 0

    def num_total_blocks(self):
        return 10

    def num_free_blocks(self):
        return 10 - len(self.engine.reqs)


class FakeEngine:
    """One token per step per request; `fail_next` makes the next step raise, naming `names`
    (or, with names None, leaving no last_failed_request_ids at all)."""

    spec = None

    def __init__(self, tokens_per_request=5, named=True):
        self.reqs: dict[str, list[int]] = {}
        self.limit = tokens_per_request
        self.core = FakeCore(self)
        self.num_steps = 0
        self.num_idle_checks = 0
        self.fail_next: list | None = None  # names for the next failing step
        self.always_fail = False
        self.named = named
        self.aborted: list[str] = []

    def add_request(self, rid, prompt, params, prompt_token_ids=None):
        self.reqs[rid] = []

    def has_unfinished_requests(self):
        self.num_idle_checks += 1
        return bool(self.reqs)

    def spec_metrics(self):
        return {}

    def abort(self, rid):
        self.aborted.append(rid)
        self.reqs.pop(rid, None)

    def step(self, final_only=False):
        self.num_steps += 1
        if self.always_fail or self.fail_next is not None:
            names, self.fail_next = self.fail_next, None
            if self.named:
                self.last_failed_request_ids = list(names or [])
            raise RuntimeError("injected")
        outs = []
        for rid, toks in list(self.reqs.items()):
            toks.append(len(toks))
            done = len(toks) >= self.limit
            outs.append(RequestOutput(rid, None, [1], list(toks), "x" * len(toks), finished=done,
                                      finish_reason="length" if done else None, new_token_ids=[toks[-1]],
                                      new_text="x"))
            if done:
                del self.reqs[rid]
        return outs


def run_loop(engine, scenario, capacity=8):
    """Run `scenario(loop, submit)` on an event loop with an EngineLoop over `engine`;
    `submit(name, ...)` returns the asyncio.Queue of each request's events."""

    async def main():
        loop = EngineLoop(engine, ServerMetrics(), capacity=capacity)
        loop.start(asyncio.get_running_loop())
        try:

            def submit(*names):
                """One admission of `names` (added in one go, before the next step)."""
                qs = [asyncio.Queue() for _ in names]
                loop.submit([Submission(n, None, [1], SamplingParams(), q) for n, q in zip(names, qs)])
                return qs[0] if len(qs) == 1 else qs

            return await scenario(loop, submit)
        finally:
            await asyncio.get_running_loop().run_in_executor(None, loop.stop, 10)

    return asyncio.run(asyncio.wait_for(main(), 30))


async def drain(q):
    """Events of one request until it ends: ("finished", n tokens) or ("failed", status)."""
    while True:
        ev = await q.get()
        if ev.kind == "failed":
            return ("failed", ev.error.status)
        if ev.kind == "output" and ev.output.finished:
            return ("finished", len(ev.output.token_ids))


async def started(q):
    ev = await q.get()
    assert ev.kind == "added"


@pytest.mark.parametrize("named", [True, False])
def test_a_failed_step_fails_only_the_requests_it_names(named):
    engine = FakeEngine(tokens_per_request=30, named=named)

    async def scenario(loop, submit):
        engine.fail_next = ["a"]  # the first step, which runs both
        a, b = submit("a", "b")
        results = await asyncio.gather(drain(a), drain(b))
        after = await drain(submit("c"))  # the server goes on
        return results, after

    (ra, rb), rc = run_loop(engine, scenario)
    assert ra == ("failed", 500)
    # an engine that names the failed requests spares the others; one that does not fails all in flight
    assert rb == (("finished", 30) if named else ("failed", 500))
    assert rc == ("finished", 30)
    assert "a" in engine.aborted and ("b" in engine.aborted) != named


def test_a_step_that_keeps_failing_fails_everyone_instead_of_spinning():
    engine = FakeEngine(tokens_per_request=30)

    async def scenario(loop, submit):
        engine.always_fail = True  # and names no request
        engine.fail_next = []
        return await drain(submit("a"))

    assert run_loop(engine, scenario) == ("failed", 500)
    assert engine.num_steps <= 5


def test_the_loop_blocks_when_idle():
    engine = FakeEngine(tokens_per_request=3)

    async def scenario(loop, submit):
        assert await drain(submit("a")) == ("finished", 3)
        checks, steps = engine.num_idle_checks, engine.num_steps
        await asyncio.sleep(0.3)
        return engine.num_idle_checks - checks, engine.num_steps - steps

    idle_checks, idle_steps = run_loop(engine, scenario)
    assert idle_steps == 0 and idle_checks <= 2  # a busy-waiting loop would check thousands of times


def test_capacity_refuses_with_429_and_stop_aborts_the_rest_with_503():
    engine = FakeEngine(tokens_per_request=10**9)

    async def scenario(loop, submit):
        queues = [submit(f"r{i}") for i in range(3)]
        with pytest.raises(ApiError) as e:
            submit("one-too-many")
        assert e.value.status == 429 and e.value.code == "queue_full"
        for q in queues:
            await started(q)
        loop.drain()  # shutdown began: no admissions, the three go on
        with pytest.raises(ApiError) as e:
            submit("while-draining")
        assert e.value.status == 503 and loop.in_flight == 3
        await asyncio.get_running_loop().run_in_executor(None, loop.stop, 10)
        with pytest.raises(ApiError) as e:
            submit("after-stop")
        assert e.value.status == 503
        return [await drain(q) for q in queues]

    assert run_loop(engine, scenario, capacity=3) == [("failed", 503)] * 3
    assert sorted(engine.aborted) == ["r0", "r1", "r2"]


# ------------------------------------------------------------------ the real engine
class FailingForward:
    """Wraps the model runner's forward: after arm(), the next call raises."""

    def __init__(self, runner):
        self.forward = runner.forward
        self.armed = threading.Event()
        self.num_raised = 0
        runner.forward = self

    def arm(self):
        self.armed.set()

    def __call__(self, *args, **kwargs):
        if self.armed.is_set():
            self.armed.clear()
            self.num_raised += 1
            raise RuntimeError("injected forward failure")
        return self.forward(*args, **kwargs)


@pytest.fixture
def faulty(tiny_dir):
    path, _ = tiny_dir("llama", seed=3)
    # max_num_seqs=1: a second request waits, outside the step that runs the first
    gen = Generator(str(path), num_kv_blocks=64, block_size=8, max_num_seqs=1, max_model_len=256)
    injector = FailingForward(gen.engine.runner)
    srv = start_server(gen.engine, ServeConfig("tiny"))
    yield srv, injector, str(path)
    srv.stop()


def test_a_failed_forward_fails_its_request_and_the_server_goes_on(faulty):
    srv, injector, path = faulty
    body = {"prompt": "t5 t6 t7 t5 t6", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    expected = Generator(path, num_kv_blocks=64, block_size=8).generate(
        ["t5 t6 t7 t5 t6"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)[0].text

    injector.arm()
    status, _, raw = request(srv.port, "POST", "/v1/completions", body)
    assert status == 500 and json.loads(raw)["error"]["code"] == "engine_step_failed" and injector.num_raised == 1

    # mid-stream: an error event, then [DONE]
    conn, resp = open_stream(srv.port, "/v1/completions", {**body, "max_tokens": 200})
    first = read_events(resp, 1)
    assert first and "choices" in first[0]
    injector.arm()
    rest = read_events(resp, 1000)
    conn.close()
    assert rest[-1] == "[DONE]" and rest[-2]["error"]["code"] == "engine_step_failed"
    assert injector.num_raised == 2

    # the engine is usable: the next request gets the clean answer, and nothing leaked
    status, _, raw = request(srv.port, "POST", "/v1/completions", body)
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == expected
    wait_for(lambda: idle_and_free(srv.port), what="all blocks free")
    m = scrape(srv.port)
    assert m["specinfer_step_failures_total"] == 2
    assert m['specinfer_requests_finished_total{finish_reason="error"}'] == 2
    status, _, _ = request(srv.port, "GET", "/health")
    assert status == 200


def test_a_failed_step_spares_the_request_it_did_not_run(faulty):
    import concurrent.futures as cf

    srv, injector, path = faulty
    body_b = {"prompt": "t9 t8 t9 t8", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    expected_b = Generator(path, num_kv_blocks=64, block_size=8).generate(
        ["t9 t8 t9 t8"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)[0].text
    conn, resp = open_stream(srv.port, "/v1/completions", {"prompt": "t5 t6 t7", "max_tokens": 240, "temperature": 0,
                                                            "ignore_eos": True})
    assert read_events(resp, 1)  # A runs
    with cf.ThreadPoolExecutor(1) as pool:
        b = pool.submit(request, srv.port, "POST", "/v1/completions", body_b)
        wait_for(lambda: scrape(srv.port)["specinfer_num_requests_waiting"] == 1, what="B waiting behind A")
        injector.arm()  # the next step runs A only
        rest = read_events(resp, 10_000)
        conn.close()
        status, _, raw = b.result(60)
    assert rest[-1] == "[DONE]" and rest[-2]["error"]["code"] == "engine_step_failed"
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == expected_b  # B: as if nothing happened
    wait_for(lambda: idle_and_free(srv.port), what="all blocks free")
    assert scrape(srv.port)['specinfer_requests_finished_total{finish_reason="error"}'] == 1
