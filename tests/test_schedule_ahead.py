"""Steps scheduled ahead (schedule_ahead=True, the default of the overlapped loop without a
proposer): step N+1 is scheduled and launched before step N's tokens exist, its input ids taken
from them on the forward thread. The outputs equal the serial loop's (greedy, seeded, logprobs,
EOS and stop strings mid-batch, chunked prefill, preemption, prefix caching, aborts between
steps); steps are scheduled ahead where they can be and not where sampling reads the history;
faults and Ctrl-C in either of the two steps in flight cancel both, leave outputs exact and every
KV block free."""
from __future__ import annotations

import random
from functools import partial
import zlib

import numpy as np
import pytest
import torch

from specinfer import Generator, SamplingParams

from fault_injection import Injector
from steps_in_flight import drive_with_abort, faults_leave_outputs_exact, runs_with_sampling_params, with_stop_strings


class AheadSpy:
    """The engine's core, counting the steps scheduled ahead (and refused)."""

    def __init__(self, core):
        self._core, self.ahead, self.refused = core, 0, 0

    def __getattr__(self, name):
        return getattr(self._core, name)

    def schedule_ahead(self):
        out = self._core.schedule_ahead()
        self.ahead += out is not None
        self.refused += out is None
        if out is not None:
            ids = np.asarray(out.input_ids)
            assert (ids[np.asarray(out.ahead_input_pos)] == -1).all() and (ids >= -1).all()
        return out

    def cancel_ahead(self):
        """The engine's refusal after the core scheduled (sampling that reads the history)."""
        cancelled = self._core.cancel_ahead()
        self.ahead -= cancelled
        self.refused += cancelled
        return cancelled


def _prompts(n, seed=11):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        base = torch.randint(3, 256, (int(torch.randint(3, 24, (1,), generator=g)),), generator=g).tolist()
        out.append(base * 2 if i % 3 == 0 else base)
    return out


def _generator(target, **kw):
    settings = dict(block_size=4, max_num_batched_tokens=32, num_kv_blocks=96, max_model_len=160)
    settings.update(kw)
    gen = Generator(str(target), **settings)
    gen.engine.core = AheadSpy(gen.engine.core)
    return gen


def _params(n, eos=True, **kw):
    """Greedy and seeded requests of different lengths; logprobs on some; EOS ends some early."""
    return [SamplingParams(max_tokens=6 + 3 * (i % 5), temperature=0.0 if i % 2 else 0.9, seed=40 + i,
                           ignore_eos=not eos, logprobs=2 if i % 4 == 0 else None, **kw) for i in range(n)]


def _summary(outs):
    return [(o.token_ids, o.text, o.finish_reason, o.stop_reason,
             None if o.logprobs is None else [sorted(d) for d in o.logprobs]) for o in outs]


def _assert_same(got, want):
    """Same tokens, text, finishes and logprob entries; logprob values within float noise (a batch
    composed otherwise, e.g. after other preemptions, rounds the model's last bits otherwise)."""
    assert _summary(got) == _summary(want)
    for g, w in zip(got, want):
        for dg, dw in zip(g.logprobs or [], w.logprobs or []):
            assert all(abs(dg[t] - dw[t]) < 1e-4 for t in dw)


@pytest.mark.parametrize("case", ["plain", "chunked", "preempting", "prefix_cached", "eos_everywhere"])
def test_steps_scheduled_ahead_equal_the_serial_loop(target, case):
    prompts, params = _prompts(10), _params(10)
    kw = {}
    if case == "chunked":
        kw = dict(max_num_batched_tokens=8)  # prompts in chunks, decodes beside them
    elif case == "preempting":
        kw = dict(num_kv_blocks=20, max_model_len=80)  # too few blocks for all: preemption by recompute
    elif case == "prefix_cached":
        prompts = [prompts[0] + p for p in prompts]  # one shared prefix
    elif case == "eos_everywhere":
        # the tiny model's most likely tokens as EOS: requests end at random steps, leaving dead runs
        probe = _generator(target, overlap_steps=False).generate(prompts, _params(10, eos=False), use_tqdm=False)
        common = np.bincount(np.concatenate([o.token_ids for o in probe])).argsort()[-3:].tolist()
        params = [SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, seed=p.seed,
                                 logprobs=p.logprobs, stop_token_ids=common) for p in params]
    serial = _generator(target, overlap_steps=False, **kw)
    ahead = _generator(target, **kw)
    want = serial.generate(prompts, params, use_tqdm=False)
    got = ahead.generate(prompts, params, use_tqdm=False)
    _assert_same(got, want)
    spy = ahead.engine.core
    assert spy.ahead >= 10, f"steps scheduled ahead: {spy.ahead} (refused {spy.refused})"
    if case == "preempting":
        assert serial.engine.core.stats()["num_preemptions"] > 0
    if case == "eos_everywhere":
        assert sum(o.finish_reason == "stop" for o in got) >= 3
        assert sum(len(o.token_ids) < p.max_tokens for o, p in zip(got, params)) >= 3
    assert spy.num_free_blocks() == spy.num_total_blocks()
    spy.check_invariants()
    assert not ahead.engine.has_unfinished_requests()


def test_streams_aborts_and_stop_strings_between_steps_in_flight(target):
    """A server's pattern: requests streamed, one aborted while a step scheduled ahead holds it,
    stop strings ending others; the rest equal the serial loop's."""
    prompts = _prompts(6, seed=3)
    probe = _generator(target, overlap_steps=False).generate(prompts, _params(6, eos=False), use_tqdm=False)
    base = _params(6, eos=False)
    params = with_stop_strings(probe, base, [p.seed for p in base])

    serial, ahead = _generator(target, overlap_steps=False), _generator(target)
    want, got = drive_with_abort(serial, prompts, params), drive_with_abort(ahead, prompts, params)
    assert "r1" not in got and got == {k: v for k, v in want.items() if k != "r1"}
    assert sum(v[2] == "stop" for v in got.values()) >= 2
    assert ahead.engine.core.ahead > 0
    assert ahead.engine.core.num_free_blocks() == ahead.engine.core.num_total_blocks()


def test_no_step_is_scheduled_ahead_where_sampling_reads_the_history(target):
    prompts = _prompts(4)
    extras = (dict(repetition_penalty=1.3), dict(presence_penalty=0.5), dict(min_tokens=8))
    for extra, got, want, eng in runs_with_sampling_params(partial(_generator, target), prompts, extras, 8):
        _assert_same(got, want)
        assert eng.core.ahead == 0, extra
    off = _generator(target, schedule_ahead=False)
    off.generate(prompts, SamplingParams(max_tokens=8), use_tqdm=False)
    assert not off.engine.schedule_ahead and off.engine.core.ahead == 0


@pytest.mark.parametrize("where", ["forward", "sampler"])
def test_faults_with_two_steps_in_flight_leave_outputs_exact(target, where):
    """Faults and Ctrl-C land in the step being waited on (its successor already launched behind
    it) or in that successor once adopted: both are cancelled, retried and come out exact."""
    rng = random.Random(zlib.crc32(where.encode()))
    fail_at = set(rng.sample(range(3, 40), 8))
    kinds = [RuntimeError, KeyboardInterrupt, MemoryError]

    def inject(eng):
        if where == "forward":
            return Injector(eng.runner.forward, fail_at, kinds).install(eng.runner, "forward")
        return Injector(eng.step_sampler.__call__, fail_at, kinds).install(eng, "step_sampler")

    eng = faults_leave_outputs_exact(_generator(target, overlap_steps=False), _generator(target), _prompts(10, seed=5),
                                     SamplingParams(max_tokens=16, temperature=0.0), inject, min_faults=4)
    assert eng.core.ahead >= 5
