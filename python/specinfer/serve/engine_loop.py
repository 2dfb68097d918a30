"""The one loop that owns the engine: a dedicated thread that admits requests, steps, and hands
each step's outputs to the asyncio side.

The engine is single-threaded by design, so nothing else ever calls into it: HTTP handlers put
submissions and aborts into an inbox (under a condition variable) and receive `Event`s on their
own asyncio.Queue through `loop.call_soon_threadsafe`. With nothing to do the thread blocks on the
condition; it never busy-waits.

Admission is bounded: at most `capacity` requests are in flight (admitted and not yet ended), and
a submission beyond that is refused at once with 429, so a burst turns into refusals with a
status, not an unbounded queue.

A step that raises fails only the requests it names in `engine.last_failed_request_ids` (the
engine cancels the failed step and stays usable); an engine without that attribute, or one that
keeps failing, has every in-flight request failed. The others go on.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from specinfer.request_error import RequestError
from specinfer.outputs import RequestOutput
from specinfer.sampling_params import SamplingParams
from specinfer.serve.errors import ApiError, from_value_error, internal_error
from specinfer.serve.metrics import EngineSnapshot, ServerMetrics

log = logging.getLogger("specinfer.serve")

# after this many failed steps in a row, every in-flight request is failed (the engine may be
# naming no request, or the wrong ones): the loop must not spin on a failing step
MAX_CONSECUTIVE_FAILURES = 3


@dataclass(frozen=True)
class Event:
    """What the loop tells a handler about one of its requests."""
    index: int  # which choice of the HTTP request
    kind: str  # "added" (admitted into the engine), "output" (a step's delta), "failed"
    output: RequestOutput | None = None
    error: ApiError | None = None


@dataclass(frozen=True)
class Submission:
    request_id: str
    prompt: str | list[int] | None  # what the engine records as the prompt
    prompt_token_ids: list[int]  # validated by the handler (engine.validate)
    params: SamplingParams
    sink: asyncio.Queue  # of Event, read on the event loop
    index: int = 0
    share_prompt_with: str | None = None  # sample j > 0 of n: the request id of sample 0 (its prompt KV)


@dataclass
class _Tracked:
    sub: Submission
    arrival: float
    first_token_at: float | None = None


class EngineLoop:
    def __init__(self, engine, metrics: ServerMetrics, *, capacity: int, max_backlog: int = 2048):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 (got {capacity})")
        self.engine = engine
        self.metrics = metrics
        self.capacity = capacity
        self.max_backlog = max_backlog  # outputs waiting for one slow client before its request is ended
        self._cond = threading.Condition()
        self._inbox: deque[tuple[Submission, float]] = deque()
        self._aborts: list[str] = []
        self._in_flight = 0  # admitted and not ended; guarded by _cond
        self._draining = False  # shutting down: no new admissions
        self._abort_all: ApiError | None = None  # set: fail everything in flight with this
        self._stopping = False
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._outbox: list[tuple[asyncio.Queue, Event]] = []  # engine thread only: events to hand over
        self._consecutive_failures = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.fatal: BaseException | None = None  # set if the loop itself crashed
        self.num_finished = 0
        self.num_aborted_at_shutdown = 0

    # ------------------------------------------------------------------ event-loop side
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._publish_snapshot()
        self._thread = threading.Thread(target=self._run, name="specinfer-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def accepting(self) -> bool:
        return self.alive and not self._draining

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def submit(self, subs: list[Submission]) -> None:
        """Admit all of `subs` or none: 429 at capacity, 503 when stopping."""
        with self._cond:
            if not self.accepting:
                self.metrics.requests_rejected.labels(reason="shutting_down").inc(len(subs))
                raise ApiError(503, "the server is shutting down" if self._stopping or self._draining else
                               "the engine loop is not running", None, "unavailable")
            if len(subs) > self.capacity:  # would wait forever: say so, not "retry later"
                self.metrics.requests_rejected.labels(reason="invalid").inc(len(subs))
                raise ApiError(400, f"the request asks for {len(subs)} completions; this server runs at most "
                               f"{self.capacity} at once", "prompt", "too_many_prompts")
            if self._in_flight + len(subs) > self.capacity:
                self.metrics.requests_rejected.labels(reason="queue_full").inc(len(subs))
                raise ApiError(429, f"the server is at capacity ({self.capacity} requests in flight); retry later",
                               None, "queue_full")
            self._in_flight += len(subs)
            now = time.perf_counter()
            self._inbox.extend((s, now) for s in subs)
            self._cond.notify()

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests whose client went away (unknown or ended ids are ignored)."""
        if not request_ids:
            return
        with self._cond:
            self._aborts.extend(request_ids)
            self._cond.notify()

    def drain(self) -> None:
        """Shutdown begins: refuse new requests (503); those in flight go on."""
        with self._cond:
            self._draining = True

    def abort_all(self) -> None:
        """End every request in flight now: its handler gets a 503 (a stream: an error event)."""
        with self._cond:
            self._abort_all = ApiError(503, "the server shut down before the request finished", None,
                                       "shutting_down")
            self._cond.notify()

    def stop(self, timeout: float | None = None) -> None:
        """Abort what is still in flight (their handlers get 503), then end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cond:
                    while not (self._inbox or self._aborts or self._stopping or self._abort_all
                               or engine.has_unfinished_requests()):
                        self._cond.wait()
                    new, self._inbox = list(self._inbox), deque()
                    aborts, self._aborts = self._aborts, []
                    abort_all, self._abort_all = self._abort_all, None
                    stopping = self._stopping
                for sub, arrival in new:
                    self._add(sub, arrival)
                for rid in aborts:
                    self._abort(rid)
                if abort_all is not None or stopping:
                    self.num_aborted_at_shutdown += len(self._tracked)
                    self._fail_all(abort_all or ApiError(503, "the server shut down before the request finished",
                                                         None, "shutting_down"), reason="abort")
                if stopping:
                    return
                self._flush()  # admissions are answered before the step, which may be long
                if engine.has_unfinished_requests():
                    self._step()
                self._publish_snapshot()
                self._flush()
        except BaseException as e:  # a bug in the loop: fail everyone, /health turns 503
            self.fatal = e
            log.exception("the engine loop crashed")
            with self._cond:
                self._stopping = True
                pending = list(self._inbox)
                self._inbox.clear()
            err = internal_error("the engine loop crashed", "engine_loop_crashed", e)
            for sub, arrival in pending:
                self._tracked[sub.request_id] = _Tracked(sub, arrival)
            self._fail_all(err, reason="error")
        finally:
            self._publish_snapshot()
            self._flush()

    def _add(self, sub: Submission, arrival: float) -> None:
        try:
            share = {"share_prompt_with": sub.share_prompt_with} if sub.share_prompt_with else {}
            self.engine.add_request(sub.request_id, sub.prompt, sub.params, prompt_token_ids=sub.prompt_token_ids,
                                    **share)
        except ValueError as e:
            self._release(1)  # counted as rejected by the handler that gets the 400
            self._post(sub, Event(sub.index, "failed", error=from_value_error(e, {}, "prompt")))
            return
        except Exception as e:
            self._release(1)
            log.exception("add_request failed")
            self._post(sub, Event(sub.index, "failed", error=internal_error("add_request failed", "internal_error",
                                                                          e)))
            return
        self._tracked[sub.request_id] = _Tracked(sub, arrival)
        self.metrics.prompt_tokens.inc(len(sub.prompt_token_ids))
        self._post(sub, Event(sub.index, "added"))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            named = getattr(self.engine, "last_failed_request_ids", None)
            if isinstance(e, RequestError) and named is not None:  # the requests' own values, not the step
                err = ApiError(400, " ".join(str(e).split()), None, "invalid_value")
                log.warning("requests %s failed in a step: %s", named, e)
                for rid in list(named):
                    self._fail(rid, err)
                return
            self._consecutive_failures += 1
            self.metrics.step_failures.inc()
            if named is None or self._consecutive_failures >= MAX_CONSECUTIVE_FAILURES:
                named = list(self._tracked)
            err = internal_error("the engine step running this request failed", "engine_step_failed", e)
            for rid in list(named):
                self._fail(rid, err)
            return
        self._consecutive_failures = 0
        now = time.perf_counter()
        for out in outputs:
            self._deliver(out, now)

    def _deliver(self, out: RequestOutput, now: float) -> None:
        t = self._tracked.get(out.request_id)
        if t is None:
            return
        if not out.finished and t.sub.sink.qsize() > self.max_backlog:  # a client that does not read
            self._fail(out.request_id, ApiError(503, f"the client took none of the last {self.max_backlog} "
                                                "outputs; the request was ended", None, "slow_client"))
            return
        if out.new_token_ids:
            self.metrics.generation_tokens.inc(len(out.new_token_ids))
            if t.first_token_at is None:
                t.first_token_at = now
                self.metrics.ttft.observe(now - t.arrival)
        if out.finished:
            del self._tracked[out.request_id]
            n = len(out.token_ids)
            tpot = (now - t.first_token_at) / (n - 1) if n > 1 and t.first_token_at is not None else None
            self.metrics.observe_finished(out.finish_reason or "stop", now - t.arrival, tpot)
            self.num_finished += 1
            self._release(1)
        self._post(t.sub, Event(t.sub.index, "output", output=out))

    def _abort(self, request_id: str) -> None:
        """The client is gone: abort and forget (nobody is listening)."""
        t = self._tracked.pop(request_id, None)
        if t is None:
            return
        try:
            self.engine.abort(request_id)
        except Exception:
            log.exception("abort of %s failed", request_id)
        self.metrics.requests_finished.labels(finish_reason="abort").inc()
        self._release(1)

    def _fail(self, request_id: str, err: ApiError, reason: str = "error") -> None:
        t = self._tracked.pop(request_id, None)
        if t is None:
            return
        try:
            self.engine.abort(request_id)
        except Exception:  # an engine wedged by the failure must not stop us failing the rest
            log.exception("abort of %s failed", request_id)
        self.metrics.requests_finished.labels(finish_reason=reason).inc()
        self._release(1)
        self._post(t.sub, Event(t.sub.index, "failed", error=err))

    def _fail_all(self, err: ApiError, reason: str) -> None:
        for rid in list(self._tracked):
            self._fail(rid, err, reason)

    def _release(self, n: int) -> None:
        with self._cond:
            self._in_flight -= n

    def _post(self, sub: Submission, event: Event) -> None:
        self._outbox.append((sub.sink, event))

    def _flush(self) -> None:
        """Hand the pending events to the event loop: one wake-up per batch, not per event."""
        if not self._outbox:
            return
        batch, self._outbox = self._outbox, []
        try:
            self._loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # the event loop is closed: the server is gone, nobody to tell
            pass

    def _publish_snapshot(self) -> None:
        engine, core = self.engine, self.engine.core
        spec = getattr(engine, "spec", None) is not None
        m = engine.spec_metrics() if spec else {}
        drafts = int(m.get("num_drafts", 0))
        self.metrics.snapshot = EngineSnapshot(
            num_running=core.num_running(), num_waiting=core.num_waiting() + len(self._inbox),
            kv_blocks_total=core.num_total_blocks(), kv_blocks_free=core.num_free_blocks(),
            num_drafts=drafts, num_draft_tokens=int(m.get("num_draft_tokens", 0)),
            num_accepted_tokens=int(m.get("num_accepted_tokens", 0)),
            num_emitted_tokens=round(m.get("mean_acceptance_length", 0.0) * drafts), speculative=spec)


def _put_all(batch: list[tuple[asyncio.Queue, Event]]) -> None:
    for sink, event in batch:
        sink.put_nowait(event)
