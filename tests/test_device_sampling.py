"""Plain steps sampled as device work and scheduled ahead without a forward thread (CUDA's flow:
engine/device_sampling.py; here forward_thread="off" runs the same code on the CPU). The emitted
tokens stay a tensor, the step scheduled ahead gathers its input ids from it, and the host reads
them through one copy. Outputs equal the serial loop's (greedy, seeded, unseeded, chunked
prefill, preemption, EOS mid-batch, stop strings, aborts); steps whose sampling needs the host
(logprobs, penalties, min_tokens ahead) are neither device-sampled nor scheduled ahead; faults
in either of two steps in flight leave outputs exact and every KV block free."""
from __future__ import annotations

import random
from functools import partial
import zlib

import numpy as np
import pytest
import torch

from specinfer import Generator, SamplingParams
from specinfer.engine.device_sampling import SampledOnDevice, sample_on_device, samples_on_device

from fault_injection import Injector
from steps_in_flight import drive_with_abort, faults_leave_outputs_exact, runs_with_sampling_params, with_stop_strings


def _prompts(n, seed=13):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _generator(target, **kw):
    settings = dict(block_size=4, max_num_batched_tokens=32, num_kv_blocks=96, max_model_len=160, seed=3,
                    forward_thread="off")
    settings.update(kw)
    return Generator(str(target), **settings)


def _params(n, **kw):
    """Greedy, seeded and unseeded sampled requests of different lengths."""
    return [SamplingParams(max_tokens=5 + 3 * (i % 5), temperature=0.0 if i % 3 == 0 else 0.9,
                           seed=40 + i if i % 3 == 1 else None, **kw) for i in range(n)]


def _summary(outs):
    return [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in outs]


@pytest.mark.parametrize("case", ["plain", "chunked", "preempting", "eos_everywhere"])
def test_device_sampled_steps_scheduled_ahead_equal_the_serial_loop(target, case):
    prompts, params = _prompts(10), _params(10)
    kw = {}
    if case == "chunked":
        kw = dict(max_num_batched_tokens=8)
    elif case == "preempting":
        kw = dict(num_kv_blocks=20, max_model_len=80)
    elif case == "eos_everywhere":
        probe = _generator(target, overlap_steps=False).generate(prompts, _params(10, ignore_eos=True),
                                                                 use_tqdm=False)
        common = np.bincount(np.concatenate([o.token_ids for o in probe])).argsort()[-3:].tolist()
        params = [SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, seed=p.seed,
                                 stop_token_ids=common) for p in params]
    serial, ahead = _generator(target, overlap_steps=False, **kw), _generator(target, **kw)
    eng = ahead.engine
    assert eng.executor.forward_thread is None and eng.device_sampling and eng.schedule_ahead
    assert _summary(ahead.generate(prompts, params, use_tqdm=False)) == \
        _summary(serial.generate(prompts, params, use_tqdm=False))
    assert eng.num_scheduled_ahead >= 8, eng.num_scheduled_ahead
    if case == "preempting":
        assert serial.engine.core.stats()["num_preemptions"] > 0
    assert eng.core.num_free_blocks() == eng.core.num_total_blocks()
    eng.core.check_invariants()
    assert not eng.has_unfinished_requests()


def test_stop_strings_and_aborts_with_device_sampled_steps(target):
    prompts = _prompts(6, seed=4)
    probe = _generator(target, overlap_steps=False).generate(prompts, _params(6, ignore_eos=True), use_tqdm=False)
    params = with_stop_strings(probe, _params(6), [40 + i for i in range(6)])

    serial, ahead = _generator(target, overlap_steps=False), _generator(target)
    want, got = (drive_with_abort(serial, prompts, params, at_step=3),
                 drive_with_abort(ahead, prompts, params, at_step=3))
    assert "r1" not in got and got == {k: v for k, v in want.items() if k != "r1"}
    assert ahead.engine.num_scheduled_ahead > 0
    assert ahead.engine.core.num_free_blocks() == ahead.engine.core.num_total_blocks()


def test_steps_that_need_the_host_are_not_device_sampled(target):
    extras = (dict(logprobs=2), dict(repetition_penalty=1.3), dict(min_tokens=8))
    for extra, got, want, eng in runs_with_sampling_params(partial(_generator, target), _prompts(4), extras, 8):
        assert _summary(got) == _summary(want)
        if "logprobs" in extra:
            assert [o.logprobs for o in got] is not None and all(o.logprobs for o in got)
        assert eng.num_scheduled_ahead == 0, extra


def test_sampled_on_device_equals_the_step_sampler(target):
    """The device path's Emitted equals StepSampler's on the same logits: greedy, seeded and
    unseeded rows, a prefill chunk without logits among them, explicit output positions."""
    gen = _generator(target)
    eng = gen.engine
    prompts, params = _prompts(6, seed=9), _params(6)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"q{i}", p, sp)
    sched = eng.core.schedule()
    states = [eng._requests[i] for i in sched.req_ids.tolist()]
    L = int(np.diff(sched.cu_num_logits).sum())
    logits = torch.randn(L, eng.vocab_size, generator=torch.Generator().manual_seed(1))
    assert samples_on_device(sched, states)
    want = eng.step_sampler(logits.clone(), sched, states, {})
    got = sample_on_device(eng.step_sampler, logits.clone(), sched, states)
    if L:
        assert isinstance(got, SampledOnDevice)
        got = got.emitted()
    for f in ("token_ids", "cu_num_emitted", "num_draft_tokens", "num_accepted", "num_rows"):
        assert np.array_equal(getattr(got, f), getattr(want, f)), f
    shifted = np.arange(len(states)) + 5  # the draws of other output positions
    a = sample_on_device(eng.step_sampler, logits.clone(), sched, states, positions=shifted)
    b = eng.step_sampler(logits.clone(), sched, states, {}, positions=shifted)
    if L:
        assert np.array_equal(a.emitted().token_ids, b.token_ids)
    eng.core.cancel_step()


def test_faults_with_two_device_sampled_steps_in_flight(target):
    rng = random.Random(zlib.crc32(b"device"))
    fail_at = set(rng.sample(range(3, 18), 7))

    def inject(eng):
        return Injector(eng.runner.forward, fail_at, [RuntimeError, KeyboardInterrupt, MemoryError]).install(
            eng.runner, "forward")

    eng = faults_leave_outputs_exact(_generator(target, overlap_steps=False), _generator(target), _prompts(10, seed=5),
                                     SamplingParams(max_tokens=14, temperature=0.0), inject, min_faults=4)
    assert eng.num_scheduled_ahead >= 5
