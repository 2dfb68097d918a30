"""One HTTP request's run through the engine loop: its engine requests (one per choice), the
queue their events arrive on, and the abort that follows its client when it leaves."""
from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request

from specinfer.outputs import RequestOutput
from specinfer.sampling_params import SamplingParams
from specinfer.serve.engine_loop import EngineLoop, Event, Submission


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


class Generation:
    def __init__(self, loop: EngineLoop, prefix: str, prompts: list, prompt_ids: list[list[int]],
                 params: SamplingParams):
        """One choice per (prompt, sample): choice index = prompt index * n + sample index (OpenAI's
        order); sample j runs with params.sample_params(j) (seed + j when seeded)."""
        self.loop = loop
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.sink: asyncio.Queue[Event] = asyncio.Queue()
        self.n = params.n
        choices = [(p, ids, params if params.n == 1 else params.sample_params(j))
                   for p, ids in zip(prompts, prompt_ids) for j in range(params.n)]
        n = len(choices)
        self.request_ids = [self.id if n == 1 else f"{self.id}-{i}" for i in range(n)]
        k = params.n
        self.subs = [Submission(rid, p, ids, sp, self.sink, i, self.request_ids[i - i % k] if i % k else None)
                     for i, (rid, (p, ids, sp)) in enumerate(zip(self.request_ids, choices))]
        self.finals: list[RequestOutput | None] = [None] * n
        self._open = set(range(n))  # choices not yet finished or failed
        self._early: list[Event] = []  # outputs that arrived while start() waited for admissions

    async def start(self, request: Request) -> None:
        """Submit and wait until the engine admitted every choice (its refusal becomes the
        ApiError raised here, before any response byte is sent)."""
        self.loop.submit(self.subs)
        pending = set(range(len(self.subs)))
        try:
            while pending:
                ev = await _or_disconnect(self.sink.get(), request)
                if ev.kind == "failed":
                    self._open.discard(ev.index)
                    raise ev.error
                if ev.kind == "added":
                    pending.discard(ev.index)
                else:  # an output can only follow its own "added"; keep it for events()
                    self._early.append(ev)
        except BaseException:
            self.abort()
            raise

    async def events(self) -> AsyncIterator[Event]:
        """Output and failure events until every choice ended."""
        while self._open:
            ev = self._early.pop(0) if self._early else await self.sink.get()
            if ev.kind == "added":
                continue
            if ev.kind == "failed" or ev.output.finished:
                self._open.discard(ev.index)
                if ev.kind == "output":
                    self.finals[ev.index] = ev.output
            yield ev

    async def collect(self, request: Request) -> list[RequestOutput]:
        """Every choice's final output; the first failure is raised; a disconnect aborts."""
        try:
            async for ev in _events_or_disconnect(self.events(), request):
                if ev.kind == "failed":
                    raise ev.error
            return list(self.finals)
        finally:
            self.abort()

    def abort(self) -> None:
        """Abort the choices still running (a no-op once all ended)."""
        if self._open:
            self.loop.abort([self.request_ids[i] for i in sorted(self._open)])
            self._open.clear()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _or_disconnect(awaitable, request: Request):
    """The result of `awaitable`, or ClientGone if the client disconnects first."""
    task = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise ClientGone()
    finally:
        for t in (task, watch):
            if not t.done():
                t.cancel()


async def _events_or_disconnect(events: AsyncIterator[Event], request: Request) -> AsyncIterator[Event]:
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        while True:
            nxt = asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait({nxt, watch}, return_when=asyncio.FIRST_COMPLETED)
            if nxt not in done:
                nxt.cancel()
                raise ClientGone()
            try:
                ev = nxt.result()
            except StopAsyncIteration:
                return
            yield ev
    finally:
        watch.cancel()


__all__ = ["ClientGone", "Generation"]
