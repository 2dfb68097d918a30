"""Steps launched right after the previous step's update (StepTransaction._launch_next: the
overlapped loop's default where the proposal, if any, is the core's own, as n-gram's): the core
proposes and schedules step N+1 and it is packed and launched before the Python states take step
N's tokens and before step() returns. Its sampler runs behind its forward with output positions
fixed at launch (forward thread), or in the next call as usual where launches are asynchronous by
themselves (CUDA; stood in for here by forward_thread="off").

The outputs equal the serial loop's (greedy, seeded and unseeded sampling, logprobs, EOS and stop
strings, chunked prefill, preemption, aborts between steps, penalties where the launch waits);
faults and Ctrl-C in either step in flight leave outputs exact and every KV block free."""
from __future__ import annotations

import random
from functools import partial
import zlib

import numpy as np
import pytest
import torch

from specinfer import Generator, SamplingParams

from fault_injection import Injector
from steps_in_flight import faults_leave_outputs_exact, runs_with_sampling_params, stop_strings_and_abort_match_serial

# a fixed k: whether drafts are made must not depend on measured step times (a loaded CI machine)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "policy": "fixed"}


def _prompts(n, seed=11):
    """Prompts with repeats in them (n-gram drafts find matches)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        base = torch.randint(3, 256, (int(torch.randint(3, 16, (1,), generator=g)),), generator=g).tolist()
        out.append(base * 3 if i % 2 == 0 else base * 2)
    return out


def _generator(target, speculative=NGRAM, device_like_cuda=False, plain_ahead=True, **kw):
    settings = dict(block_size=4, max_num_batched_tokens=64, num_kv_blocks=128, max_model_len=160, seed=7)
    settings.update(kw)
    if device_like_cuda:  # as where launches are asynchronous by themselves: no forward thread
        settings["forward_thread"] = "off"
    gen = Generator(str(target), speculative=speculative, **settings)
    assert (gen.engine.executor.forward_thread is None) == (device_like_cuda or not gen.engine.overlap_steps)
    if not plain_ahead:
        gen.engine.schedule_ahead = False
    return gen


def _params(n, eos=True, **kw):
    """Greedy, seeded and unseeded sampled requests of different lengths; logprobs on some."""
    return [SamplingParams(max_tokens=6 + 3 * (i % 5), temperature=0.0 if i % 3 == 0 else 0.9,
                           seed=40 + i if i % 3 == 1 else None, ignore_eos=not eos,
                           logprobs=2 if i % 4 == 0 else None, **kw) for i in range(n)]


def _summary(outs):
    return [(o.token_ids, o.text, o.finish_reason, o.stop_reason,
             None if o.logprobs is None else [sorted(d) for d in o.logprobs]) for o in outs]


def _assert_same(got, want):
    assert _summary(got) == _summary(want)
    for g, w in zip(got, want):
        for dg, dw in zip(g.logprobs or [], w.logprobs or []):
            assert all(abs(dg[t] - dw[t]) < 1e-4 for t in dw)


@pytest.mark.parametrize("case", ["ngram", "chunked", "preempting", "eos_everywhere", "plain_penalized",
                                  "like_cuda", "like_cuda_plain"])
def test_steps_launched_after_the_update_equal_the_serial_loop(target, case):
    prompts, params = _prompts(10), _params(10)
    kw, spec, like_cuda = {}, NGRAM, False
    if case == "chunked":
        kw = dict(max_num_batched_tokens=12)  # prompts in chunks, verifications beside them
    elif case == "preempting":
        kw = dict(num_kv_blocks=24, max_model_len=80)  # too few blocks for all: preemption by recompute
    elif case == "eos_everywhere":
        probe = _generator(target, overlap_steps=False).generate(prompts, _params(10, eos=False), use_tqdm=False)
        common = np.bincount(np.concatenate([o.token_ids for o in probe])).argsort()[-3:].tolist()
        params = [SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, seed=p.seed,
                                 logprobs=p.logprobs, stop_token_ids=common) for p in params]
    elif case == "plain_penalized":
        # no proposer, no plain step scheduled ahead: each step is launched after the previous
        # update, except while a request that reads its history (penalties) runs
        spec, kw = None, dict(plain_ahead=False)
        params = [SamplingParams(max_tokens=3 if i < 3 else p.max_tokens, temperature=p.temperature, seed=p.seed,
                                 repetition_penalty=1.2 if i < 3 else 1.0) for i, p in enumerate(params)]
    elif case in ("like_cuda", "like_cuda_plain"):  # sampling waits for the next call: penalties allowed
        like_cuda = True
        spec = None if case == "like_cuda_plain" else spec  # (no plain step scheduled ahead without the thread)
        params = [SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, seed=p.seed,
                                 presence_penalty=0.5 if i == 2 else 0.0, min_tokens=4 if i == 4 else 0)
                  for i, p in enumerate(params)]
    serial = _generator(target, spec, overlap_steps=False, **kw)
    early = _generator(target, spec, device_like_cuda=like_cuda, **kw)
    want = serial.generate(prompts, params, use_tqdm=False)
    got = early.generate(prompts, params, use_tqdm=False)
    _assert_same(got, want)
    eng = early.engine
    assert eng.num_launched_next >= 5, eng.num_launched_next
    if spec is not None:
        assert eng.spec_metrics()["num_draft_tokens"] > 0
    if case == "preempting":
        assert serial.engine.core.stats()["num_preemptions"] > 0
    if case == "eos_everywhere":
        assert sum(o.finish_reason == "stop" for o in got) >= 3
    assert eng.core.num_free_blocks() == eng.core.num_total_blocks()
    eng.core.check_invariants()
    assert not eng.has_unfinished_requests()


def test_no_step_is_launched_before_the_states_where_sampling_reads_the_history(target):
    """With the forward thread the sampler runs beside the states' commit: a step whose requests
    read their history is launched by the next call instead (and is still exact)."""
    prompts = _prompts(4)
    extras = (dict(repetition_penalty=1.3), dict(frequency_penalty=0.5), dict(min_tokens=12))
    for extra, got, want, eng in runs_with_sampling_params(partial(_generator, target), prompts, extras, 12):
        _assert_same(got, want)
        assert eng.num_launched_next == 0, extra
    off = _generator(target, schedule_ahead=False)
    off.generate(prompts, SamplingParams(max_tokens=8), use_tqdm=False)
    assert not off.engine.launches_next and off.engine.num_launched_next == 0
    draft_free = _generator(target, {"method": "ngram", "num_speculative_tokens": 2, "policy": "goodput"})
    draft_free.generate(prompts, SamplingParams(max_tokens=8), use_tqdm=False)
    assert draft_free.engine.num_launched_next > 0  # the goodput policy's choice is the core's input


def test_streams_aborts_and_stop_strings_with_a_step_launched_early(target):
    eng = stop_strings_and_abort_match_serial(partial(_generator, target), _prompts(6, seed=3),
                                              lambda n: _params(n, eos=False))
    assert eng.num_launched_next > 0


@pytest.mark.parametrize("where", ["forward", "sampler", "propose"])
def test_faults_with_a_step_launched_early_leave_outputs_exact(target, where):
    """Faults and Ctrl-C in the step waited on, in the step launched after its update (once
    adopted), or in the core's proposal made before that launch: cancelled, retried, exact."""
    rng = random.Random(zlib.crc32(where.encode()))
    fail_at = set(rng.sample(range(3, 30), 6))
    kinds = [RuntimeError, KeyboardInterrupt, MemoryError]

    def inject(eng):
        if where == "forward":
            inj = eng.runner.forward = Injector(eng.runner.forward, fail_at, kinds)
        elif where == "sampler":
            inj = eng.step_sampler = Injector(eng.step_sampler.__call__, fail_at, kinds)
        else:
            inj = eng.proposer.propose_in_core = Injector(eng.proposer.propose_in_core, fail_at,
                                                          [RuntimeError, MemoryError])
        return inj

    eng = faults_leave_outputs_exact(_generator(target, overlap_steps=False), _generator(target), _prompts(10, seed=5),
                                     SamplingParams(max_tokens=16, temperature=0.0), inject, min_faults=3)
    assert eng.num_launched_next >= 5
