"""A step is a transaction: exceptions and KeyboardInterrupt injected into the forward, the
sampler and the proposer at random steps of a mixed speculative workload leave the surviving
requests' outputs equal to a clean run's, every KV block free at the end, and the engine
serving. Also: a failing request's own state update fails only that request."""
from __future__ import annotations

import random
import zlib

import pytest
import torch

from specinfer import Generator, SamplingParams

from fault_injection import Injector, run_engine

GREEDY = SamplingParams(max_tokens=20, temperature=0.0)


@pytest.fixture(scope="module")
def models(target_and_draft):
    return target_and_draft


def _prompts(n, seed=7):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        base = torch.randint(3, 256, (int(torch.randint(2, 30, (1,), generator=g)),), generator=g).tolist()
        out.append(base + base[:3] + base if i % 2 else base)
    return out


def _generator(target, draft, method="draft_model", **kw):
    # the fixed policy: the goodput policy's draft counts follow measured step times, and with
    # them how many steps (and injected faults) a run has
    spec = {"method": method, "num_speculative_tokens": 3, "policy": "fixed"}
    if method == "draft_model":
        spec["model"] = str(draft)
    settings = dict(block_size=4, max_num_batched_tokens=24, num_kv_blocks=40, max_model_len=128)
    settings.update(kw)
    return Generator(str(target), speculative=spec, **settings)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "serial"])
@pytest.mark.parametrize("method", ["draft_model", "ngram"])
@pytest.mark.parametrize("where", ["forward", "sampler", "proposer"])
def test_faults_at_random_steps_leave_outputs_exact(models, method, where, overlap):
    """Both step loops: in the overlapped one the forward runs on the forward thread and the
    previous step's output work is under way when the fault lands."""
    target, draft = models
    prompts = _prompts(10)
    clean = _generator(target, draft, method)
    want, faults = run_engine(clean, prompts, GREEDY)
    assert faults == 0 and len(want) == len(prompts)

    gen = _generator(target, draft, method, overlap_steps=overlap)
    eng = gen.engine
    rng = random.Random(zlib.crc32(f"{method}/{where}".encode()))  # hash() of a str varies per process
    fail_at = set(rng.sample(range(1, 40), 8))
    kinds = [RuntimeError, KeyboardInterrupt, MemoryError]
    if where == "forward":
        inj = Injector(eng.runner.forward, fail_at, kinds)
        eng.runner.forward = inj
    elif where == "sampler":
        inj = Injector(eng.step_sampler.__call__, fail_at, kinds)
        eng.step_sampler = inj
    elif eng.proposer.drafts_in_core:  # n-gram under the fixed policy: the core proposes (propose_in_core)
        inj = Injector(eng.proposer.propose_in_core, fail_at, kinds)
        eng.proposer.propose_in_core = inj
    elif method == "draft_model":  # the draft's forwards: in the overlapped loop launched, failing in the next step
        inj = Injector(eng.proposer.runner.forward, fail_at, kinds)
        eng.proposer.runner.forward = inj
    else:
        inj = Injector(eng.proposer.propose, fail_at, kinds)
        eng.proposer.propose = inj
    got, faults = run_engine(gen, prompts, GREEDY)
    assert inj.raised >= 4 and faults == inj.raised
    assert got == want
    core = eng.core
    assert core.num_free_blocks() == core.num_total_blocks()
    core.check_invariants()
    assert eng.last_failed_request_ids or where == "proposer"
    # and it keeps serving
    inj.fail_at.clear()
    again = gen.generate(prompts[:3], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in again] == [want[f"r{i}"] for i in range(3)]


def test_generate_aborts_only_its_requests_and_the_generator_keeps_serving(models):
    target, draft = models
    prompts = _prompts(6, seed=3)
    want = [o.token_ids for o in _generator(target, draft).generate(prompts, GREEDY, use_tqdm=False)]
    gen = _generator(target, draft)
    eng = gen.engine
    eng.runner.forward = Injector(eng.runner.forward, {3}, [KeyboardInterrupt])
    with pytest.raises(KeyboardInterrupt):
        gen.generate(prompts, GREEDY, use_tqdm=False)
    assert not eng.has_unfinished_requests()  # the caller's requests were aborted
    assert eng.core.num_free_blocks() == eng.core.num_total_blocks()
    outs = gen.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == want


def test_a_request_whose_own_update_fails_is_finished_alone(models):
    """A failure in one request's state update (its detokenizer) after the core committed
    the step finishes that request with reason "error"; the others complete exactly."""
    target, draft = models
    prompts = _prompts(4, seed=11)
    want, _ = run_engine(_generator(target, draft), prompts, GREEDY)
    gen = _generator(target, draft)
    eng = gen.engine
    eng.add_request("bad", prompts[0], GREEDY)
    bad = eng._requests[eng._by_name["bad"]]
    calls = {"n": 0}
    real_push = bad.detokenizer.push

    def push(t):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected detokenizer failure")
        return real_push(t)

    bad.detokenizer.push = push
    got, faults = run_engine(gen, prompts, GREEDY)
    assert faults == 1
    assert {k: v for k, v in got.items() if k != "bad"} == want
    assert len(got["bad"]) < GREEDY.max_tokens
    assert eng.core.num_free_blocks() == eng.core.num_total_blocks()


def test_a_failed_schedule_packing_leaves_no_pending_step(models, monkeypatch):
    target, draft = models
    gen = _generator(target, draft)
    eng = gen.engine
    eng.add_request("a", _prompts(1)[0], GREEDY)
    # a failure inside core.schedule() itself: the core cancels whatever it left pending
    real = eng.core

    class Flaky:
        def __init__(self):
            self.fail = True

        def __getattr__(self, name):
            return getattr(real, name)

        def schedule(self):
            out = real.schedule()
            if self.fail:
                self.fail = False
                raise MemoryError("injected after packing")
            return out

    eng.core = Flaky()
    with pytest.raises(MemoryError):
        eng.step()
    eng.core = real
    while eng.has_unfinished_requests():
        eng.step()
    assert real.num_free_blocks() == real.num_total_blocks()


def test_chat_ctrl_c_stops_only_the_answer(models):
    """`specinfer chat` catches Ctrl-C around one turn: the turn's request is aborted, the
    conversation goes on, and the next answer is what a fresh session would give."""
    import io

    from specinfer.chat_template import ChatTemplate
    from specinfer.cli.chat import ChatSession

    target, draft = models
    params = SamplingParams(max_tokens=12, temperature=0.0)
    fresh_gen = _generator(target, draft)
    fresh = ChatSession(fresh_gen, ChatTemplate.for_model(fresh_gen.engine.loaded), params)
    fresh.turn("t5 t6 t7", io.StringIO())
    want = io.StringIO()
    fresh.turn("t9 t10", want)

    gen = _generator(target, draft)
    session = ChatSession(gen, ChatTemplate.for_model(gen.engine.loaded), params)
    session.turn("t5 t6 t7", io.StringIO())
    eng = gen.engine
    inj = Injector(eng.runner.forward, {2}, [KeyboardInterrupt])
    eng.runner.forward = inj
    with pytest.raises(KeyboardInterrupt):
        session.turn("t9 t10", io.StringIO())
    session.messages.pop()  # what chat's loop does on Ctrl-C
    assert not eng.has_unfinished_requests()
    got = io.StringIO()
    session.turn("t9 t10", got)
    assert got.getvalue() == want.getvalue()
    assert eng.core.num_free_blocks() == eng.core.num_total_blocks()
