"""A draft model's proposals launched where the forwards run (spec_decode/launched_proposal.py;
the overlapped loop's default for a draft model's chains): its catch-up and draft steps are one job
on the forward thread (or, without one — CUDA, stood in for by forward_thread="off" — queued from
the engine's thread), the core stores placeholders of the proposal's shape, the step verifying it
is scheduled, packed and launched before the tokens exist, and the device writes them into its
inputs and its verifier's draft ids (engine/launched_drafts.py); the core gets the real tokens
before that step's update.

The outputs equal the serial loop's (which drafts on the host and waits for the tokens): greedy,
seeded and unseeded sampling (the proposal's q reaches the verifier), logprobs, proposals split by
the token budget, chunked prefill, preemption, stop strings and aborts; faults and Ctrl-C in the
draft's forwards, the target's forward and the sampler leave outputs exact and no block held."""
from __future__ import annotations

import random
import zlib
from functools import partial

import pytest
import torch

from specinfer import Generator, SamplingParams
from specinfer.spec_decode.policy import linear_cost

from fault_injection import Injector
from steps_in_flight import faults_leave_outputs_exact, stop_strings_and_abort_match_serial


@pytest.fixture(scope="module")
def models(target, tmp_path_factory):
    from tiny_models import build_tiny_model

    draft = tmp_path_factory.mktemp("launched_draft")
    build_tiny_model(draft, "llama", base=target, perturb=0.02)
    return target, draft


def _generator(models, k=3, like_cuda=False, **kw):
    target, draft = models
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k, "policy": "fixed"}
    settings = dict(block_size=4, max_num_batched_tokens=64, num_kv_blocks=128, max_model_len=160, seed=7)
    settings.update(kw)
    if like_cuda:  # as where launches are asynchronous by themselves: no forward thread
        settings["forward_thread"] = "off"
    return Generator(str(target), speculative=spec, **settings)


def _prompts(n, seed=11):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _params(n, eos=True):
    """Greedy, seeded and unseeded sampled requests of different lengths; logprobs on some."""
    return [SamplingParams(max_tokens=6 + 3 * (i % 5), temperature=0.0 if i % 3 == 0 else 0.9,
                           seed=40 + i if i % 3 == 1 else None, ignore_eos=not eos,
                           logprobs=2 if i % 4 == 0 else None) for i in range(n)]


def _summary(outs):
    return [(o.token_ids, o.text, o.finish_reason, None if o.logprobs is None else [sorted(d) for d in o.logprobs])
            for o in outs]


@pytest.mark.parametrize("case", ["default", "split", "preempting", "like_cuda", "k1", "penalized"])
def test_launched_proposals_equal_the_serial_loop(models, case):
    kw, like_cuda, k = {}, False, 3
    if case == "split":  # the budget verifies a prefix of a proposal (its last row the draft after it)
        kw = dict(max_num_batched_tokens=6)
    elif case == "preempting":
        kw = dict(num_kv_blocks=26, max_model_len=80)
    elif case == "like_cuda":
        like_cuda = True
    elif case == "k1":
        k = 1
    prompts, params = _prompts(10), _params(10)
    if case == "penalized":  # while a penalized request runs, proposals are drafted on the host (its
        params[2] = SamplingParams(max_tokens=8, repetition_penalty=1.3)  # verification reads its drafts)
    serial = _generator(models, k, overlap_steps=False, **kw)
    launched = _generator(models, k, like_cuda, **kw)
    assert serial.engine.proposing.launch_job is None and launched.engine.proposing.launch_job is not None
    want = serial.generate(prompts, params, use_tqdm=False)
    got = launched.generate(prompts, params, use_tqdm=False)
    assert _summary(got) == _summary(want)
    for g, w in zip(got, want):
        for dg, dw in zip(g.logprobs or [], w.logprobs or []):
            assert all(abs(dg[t] - dw[t]) < 1e-4 for t in dw)
    eng = launched.engine
    assert eng.proposing.num_launched >= 5, eng.proposing.num_launched
    assert eng.spec_metrics()["num_draft_tokens"] > 0
    assert eng.spec_metrics()["num_accepted_tokens"] == serial.engine.spec_metrics()["num_accepted_tokens"]
    if case == "preempting":
        assert eng.core.stats()["num_preemptions"] > 0
    assert eng.core.num_free_blocks() == eng.core.num_total_blocks()
    eng.core.check_invariants()
    assert eng.proposing.launched is None and not eng.has_unfinished_requests()


def test_the_step_verifying_a_launched_proposal_is_packed_with_placeholders(models, monkeypatch):
    """The core holds placeholders while the drafts are made: the step's packed inputs hold them
    until the fill writes the drafted tokens where the forwards run (that the core then holds the
    real tokens is the Rust state machine's `Launched` op, and the split case above)."""
    from specinfer.engine import launched_drafts

    fills = []
    fill_inputs = launched_drafts.DraftFill.fill_inputs

    def spy(self, batch):
        before = batch.input_ids[self.input_pos].tolist()
        fill_inputs(self, batch)
        tokens = self.launched.result()[0].tolist()
        fills.append((before, batch.input_ids[self.input_pos].tolist(), [tokens[i] for i in self._in_src_t.tolist()]))

    monkeypatch.setattr(launched_drafts.DraftFill, "fill_inputs", spy)
    gen = _generator(models)
    eng = gen.engine
    gen.generate(_prompts(4), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert eng.proposing.num_launched >= 5 and len(fills) >= 5
    for before, after, drafted in fills:
        assert before == [0] * len(before)  # the placeholders
        assert after == drafted


def test_stop_strings_and_aborts_with_a_launched_proposal(models):
    eng = stop_strings_and_abort_match_serial(partial(_generator, models), _prompts(6, seed=3),
                                              lambda n: _params(n, eos=False))
    assert eng.proposing.num_launched > 0 and eng.proposing.launched is None


@pytest.mark.parametrize("where", ["draft", "forward", "sampler"])
@pytest.mark.parametrize("like_cuda", [False, True], ids=["forward_thread", "like_cuda"])
def test_faults_with_a_launched_proposal_leave_outputs_exact(models, where, like_cuda):
    """Faults and Ctrl-C in the draft's forwards (raised by the next step, which waits for them),
    in the target's forward or in the sampler of the step verifying the proposal: the step is
    cancelled, the placeholders dropped, the draft's KV records undone; the retry is exact."""
    rng = random.Random(zlib.crc32(f"{where}/{like_cuda}".encode()))
    fail_at = set(rng.sample(range(2, 14), 5))  # (a run has ~15 steps)
    kinds = [RuntimeError, KeyboardInterrupt, MemoryError]

    def inject(eng):
        if where == "draft":
            inj = eng.proposer.runner.forward = Injector(eng.proposer.runner.forward, fail_at, kinds)
        elif where == "forward":
            inj = eng.runner.forward = Injector(eng.runner.forward, fail_at, kinds)
        else:
            inj = eng.step_sampler = Injector(eng.step_sampler.__call__, fail_at, kinds)
        return inj

    params = SamplingParams(max_tokens=16, temperature=0.0)  # (a retry drafts afresh: sampled tokens may differ)
    eng = faults_leave_outputs_exact(_generator(models, overlap_steps=False), _generator(models, like_cuda=like_cuda),
                                     _prompts(8, seed=5), params, inject, min_faults=3)
    assert eng.proposing.num_launched >= 5 and eng.proposing.launched is None


def test_the_steady_catch_up_equals_the_general_one(models, monkeypatch):
    """The draft's catch-up in the steady state (every following request got tokens and had seen
    all before them: this step's tokens, read from the emitted ones at once) equals the general
    per-request pass, and is what most steps take."""
    from specinfer.spec_decode.draft_model import DraftModelProposer

    steady_catch_up, general = DraftModelProposer._steady_catch_up, DraftModelProposer._catch_up
    taken = []

    def both(self, inp):
        seen = dict(self.num_seen)
        fast = steady_catch_up(self, inp)
        taken.append(fast is not None)
        if fast is None:
            return general(self, inp)
        after, self.num_seen = self.num_seen, seen
        monkeypatch.setattr(DraftModelProposer, "_steady_catch_up", lambda self, inp: None)
        slow = general(self, inp)
        monkeypatch.setattr(DraftModelProposer, "_steady_catch_up", steady_catch_up)
        assert after == self.num_seen
        for a, b in zip(fast[1:], slow[1:]):
            assert a.tolist() == b.tolist()
        run_f, run_s = fast[0], slow[0]
        assert run_f.live.tolist() == run_s.live.tolist() and run_f.starts.tolist() == run_s.starts.tolist()
        assert run_f.ends.tolist() == run_s.ends.tolist()
        assert (run_f.tokens is None and run_s.tokens is None) or run_f.tokens.tolist() == run_s.tokens.tolist()
        return fast

    monkeypatch.setattr(DraftModelProposer, "_catch_up", both)
    gen = _generator(models, max_num_batched_tokens=12)  # chunked prompts: the general pass too
    params = [SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, speculate=i != 2) for i in range(6)]
    gen.generate(_prompts(6, seed=9), params, use_tqdm=False)
    assert sum(taken) >= 5 and not all(taken)


def test_the_flags_made_beside_the_forward_equal_those_after_the_commit(models, monkeypatch):
    """A launched proposal's request flags and block rows are made beside the forward and
    corrected by the step's tokens (StepProposing.prepare_proposal): equal to those computed once
    the states took the tokens, also where requests end (EOS, max_tokens) and prompts are chunked."""
    from specinfer.engine import propose_step

    checked = []
    requests_now = propose_step.StepProposing._requests_now

    def both(self, sched, states, emitted):
        prepared = self._prepared is not None and self._prepared[0] is states
        flags, rows = requests_now(self, sched, states, emitted)
        want = propose_step.request_flags(states, self.speculation_paused(), self.max_model_len)
        assert flags.tolist() == want.tolist()
        assert rows.tolist() == propose_step.request_block_rows(sched).tolist()
        checked.append(prepared)
        return flags, rows

    monkeypatch.setattr(propose_step.StepProposing, "_requests_now", both)
    gen = _generator(models, max_num_batched_tokens=12)
    gen.generate(_prompts(8, seed=4), _params(8), use_tqdm=False)
    assert sum(checked) >= 5


def test_the_default_policy_chooses_beside_the_forward_and_greedy_output_is_exact(models):
    """Under the goodput policy (the default) a launched proposal's budgets are chosen beside the
    forward (StepProposing.plan), as n-gram's are: greedy outputs equal the serial loop's."""
    target, draft = models
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    settings = dict(block_size=4, max_num_batched_tokens=64, num_kv_blocks=128, max_model_len=160)
    serial = Generator(str(target), speculative=spec, overlap_steps=False, **settings)
    launched = Generator(str(target), speculative=spec, **settings)
    assert launched.engine.policy is not None and launched.engine.proposing.plans_beside_forward
    assert not serial.engine.proposing.plans_beside_forward
    for gen in (serial, launched):  # step costs fixed (not measured: a loaded machine must not decide)
        cost = gen.engine.policy.cost
        cost.min_steps, cost.step_seconds = 0, lambda base: linear_cost(0.05, 1e-4, 1e-4, base)  # drafts cheap
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompts = _prompts(8, seed=2)
    want = [o.token_ids for o in serial.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in launched.generate(prompts, params, use_tqdm=False)] == want
    assert launched.engine.proposing.num_launched >= 5, launched.engine.proposing.num_launched
