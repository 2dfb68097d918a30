"""The n-gram step's proposal made inside the Rust core (StepProposing's core path:
propose_ngram_drafts, no ProposalInput) equals the general path (propose_ngram, the budgets in
Python, set_draft_tokens) draft for draft: the same tokens, the same speculation counts, greedy
and seeded sampling, through chunked prefill, split proposals, preemption and short budgets."""
import numpy as np
import pytest
import torch

from specinfer import Generator, SamplingParams
from specinfer.spec_decode.ngram import NgramProposer
from specinfer.spec_decode.policy import linear_cost


def _prompts(n):
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(n):
        base = torch.randint(3, 256, (int(torch.randint(4, 30, (1,), generator=g)),), generator=g).tolist()
        out.append(base + base[: 2 + i % 5] + base)  # repeats give n-gram matches
    return out


def _params(n):
    # greedy and seeded sampling; short max_tokens clip some budgets below k
    return [SamplingParams(max_tokens=3 + 5 * (i % 4), temperature=0.0 if i % 2 else 0.8,
                           seed=None if i % 2 else 100 + i, ignore_eos=True) for i in range(n)]


class CountingCore:
    """Counts the core's proposal calls of each path."""

    def __init__(self, proposer):
        self.calls = {"in_core": 0, "general": 0}
        self.budgets = []  # each core call's budgets (None: k for every request)
        fast, general = proposer.propose_in_core, proposer.propose

        def in_core(ids, k, budgets=None):
            self.calls["in_core"] += 1
            self.budgets.append(budgets)
            return fast(ids, k, budgets)

        def propose(inp):
            self.calls["general"] += 1
            return general(inp)

        proposer.propose_in_core, proposer.propose = in_core, propose


def _run(target, in_core: bool, block_size, budget, blocks, batch):
    gen = Generator(str(target), block_size=block_size, max_num_batched_tokens=budget, num_kv_blocks=blocks,
                    max_model_len=128, speculative={"method": "ngram", "num_speculative_tokens": 4,
                                                    "prompt_lookup_max": 3, "prompt_lookup_min": 1,
                                                    "policy": "fixed"})
    proposer = gen.engine.proposer
    assert isinstance(proposer, NgramProposer)
    if not in_core:
        proposer.drafts_in_core = False  # the instance takes the general path
    counter = CountingCore(proposer)
    outs = gen.generate(_prompts(batch), _params(batch), use_tqdm=False)
    m = gen.engine.spec_metrics()
    counts = (m["num_drafts"], m["num_draft_tokens"], m["num_accepted_tokens"], m["accepted_per_position"])
    return [o.token_ids for o in outs], counts, counter.calls, gen.engine.core.stats()["num_preemptions"]


@pytest.mark.parametrize("block_size,budget,blocks,batch", [(4, 24, 36, 24), (16, 2048, 32, 8), (4, 9, 64, 6)])
def test_core_proposal_equals_the_general_path(target, block_size, budget, blocks, batch):
    tokens, counts, calls, preempted = _run(target, True, block_size, budget, blocks, batch)
    tokens_ref, counts_ref, calls_ref, preempted_ref = _run(target, False, block_size, budget, blocks, batch)
    assert calls["in_core"] > 0 and calls["general"] == 0  # the core path ran, alone
    assert calls_ref["in_core"] == 0 and calls_ref["general"] > 0
    assert counts[1] > 0  # drafts were verified
    assert tokens == tokens_ref
    assert counts == counts_ref
    assert preempted == preempted_ref
    if blocks == 36:
        assert preempted > 0  # the small pool preempts


def test_core_path_steps_aside_for_constrained_or_non_speculating_requests(target):
    """A request with speculate=False in the batch: the general path proposes (the core path
    drafts for every request it is given)."""
    gen = Generator(str(target), max_model_len=128,
                    speculative={"method": "ngram", "num_speculative_tokens": 4, "policy": "fixed"})
    counter = CountingCore(gen.engine.proposer)
    prompts = _prompts(4)
    params = [SamplingParams(max_tokens=12, temperature=0.0, speculate=i != 1) for i in range(4)]
    outs = gen.generate(prompts, params, use_tqdm=False)
    assert counter.calls["general"] > 0 and counter.calls["in_core"] == 0
    assert outs[1].num_draft_tokens == 0 and outs[0].num_draft_tokens > 0


def test_ngram_general_path_honours_each_budget(target):
    """The general path clips each request's lookup to the budget it was given (a policy's
    choice below k), as the core clips to max_tokens."""
    from specinfer.spec_decode.proposer import ProposalInput, TargetHidden

    gen = Generator(str(target), max_model_len=128,
                    speculative={"method": "ngram", "num_speculative_tokens": 4, "policy": "fixed"})
    eng = gen.engine
    prompt = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7]  # "5 6 7" recurs: the lookup proposes 8 9 10 11
    eng.add_request("a", prompt, SamplingParams(max_tokens=16, temperature=0.0))
    eng.add_request("b", prompt, SamplingParams(max_tokens=16, temperature=0.0))
    states = [st for st in eng._requests.values()]
    n = len(states)
    zeros, ones = np.zeros(n, np.int64), np.ones(n, np.int64)
    inp = ProposalInput(states, zeros, ones, zeros, zeros, ones, np.ones(n, bool), np.array([2, 4]),
                        np.ones(n, bool), np.zeros((n, 1), np.int32), TargetHidden(torch.zeros(n, 1)))
    prop = eng.proposer.propose(inp)
    assert prop.cu_num_draft.tolist() == [0, 2, 6]
    assert prop.draft_token_ids.tolist() == [8, 9, 8, 9, 10, 11]


def test_core_path_keeps_the_platforms_cap(target):
    """A platform that warmed only some speculation lengths (Gaudi buckets) caps k: the core's
    n-gram drafts stay within it, and the output is the target's."""
    from specinfer.platform import HpuEmulatedPlatform

    prompts, params = _prompts(6), SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in Generator(str(target), max_model_len=128).generate(prompts, params, use_tqdm=False)]
    platform = HpuEmulatedPlatform(spec_lengths=(1, 2))
    gen = Generator(str(target), device=platform, max_model_len=128,
                    speculative={"method": "ngram", "num_speculative_tokens": 4, "policy": "fixed"})
    counter = CountingCore(gen.engine.proposer)
    outs = gen.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    m = gen.engine.spec_metrics()
    assert counter.calls["in_core"] > 0 and m["num_drafts"] > 0
    assert m["num_draft_tokens"] <= 2 * m["num_drafts"]
    assert m["accepted_per_position"][2:] == [0.0, 0.0]


def test_the_default_policy_chooses_beside_the_forward_and_the_core_drafts_within_it(target):
    """Under the goodput policy (no policy flag) the n-gram step takes the core path: the policy's
    choice is made beside the forward (StepProposing.plan, from estimates one verification old) and
    handed to the core as budgets; every chosen budget is honoured, greedy output equals the target
    alone, and the verification reaches the policy (with the output work)."""
    batch = 8
    prompts = _prompts(batch)
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * batch
    want = [o.token_ids for o in Generator(str(target), block_size=4).generate(prompts, params, use_tqdm=False)]
    gen = Generator(str(target), block_size=4, max_model_len=128,
                    speculative={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    eng = gen.engine
    pol = eng.policy
    assert pol is not None and eng.proposing.plans_beside_forward
    # step costs fixed (10 ms + 0.1 ms a token, target and draft alike: drafts are cheap): the choice
    # depends on the acceptance only, never on this machine's load
    pol.cost.min_steps, pol.cost.step_seconds = 0, lambda base: linear_cost(0.01, 0.0001, 0.0001, base)
    counter = CountingCore(eng.proposer)
    chosen, observed = [], []
    choose, observe = pol.num_drafts, pol.observe_verification
    pol.num_drafts = lambda *a: chosen.append(choose(*a)) or chosen[-1]
    pol.observe_verification = lambda *a: observed.append(a) or observe(*a)
    set_drafts = []
    core = eng.core

    class Spy:  # the drafts the core set per step: none beyond the request's budget
        def __getattr__(self, name):
            return getattr(core, name)

        def propose_ngram_drafts(self, ids, k, min_n, max_n, budgets=None):
            n = core.propose_ngram_drafts(ids, k, min_n, max_n, budgets)
            set_drafts.append((n, None if budgets is None else np.asarray(budgets).copy()))
            return n

    eng.proposer.core = Spy()  # (the proposer drafts through its own reference to the core)
    outs = gen.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    assert counter.calls["general"] == 0 and counter.calls["in_core"] > 5
    assert chosen and observed and pol.cost.num_steps > 0
    assert any(b is not None for b in counter.budgets)
    assert set_drafts and all(b is not None and n <= int(b.sum()) for n, b in set_drafts)  # within the budgets
    assert any(n > 0 for n, _ in set_drafts) and gen.engine.spec_metrics()["num_draft_tokens"] > 0
