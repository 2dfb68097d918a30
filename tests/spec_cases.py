"""Shared cases for proposer exactness tests: prompts, engine settings that force chunked
prefill, mixed prefill/verification steps and preemption, and the check itself."""
from __future__ import annotations

import torch

from specinfer import Generator, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)

# (block_size, token budget, KV blocks, batch size): a tiny budget with 4-token blocks and a
# pool small enough to preempt; a large budget with 16-token blocks; a single request.
SETTINGS = [(4, 24, 36, 32), (16, 2048, 16, 8), (4, 16, 36, 1)]


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(99)
    out = []
    for i in range(n):
        base = torch.randint(3, 256, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
        out.append(base + base[: 1 + i % 7] + base if i % 2 else base)  # repeats give n-gram matches
    return out


def reference(target, n: int = 32):
    gen = Generator(str(target), max_model_len=256)
    ps = prompts(n)
    return ps, [o.token_ids for o in gen.generate(ps, GREEDY, use_tqdm=False)]


def check_greedy_exact(target, spec: dict, ref, settings=SETTINGS) -> dict:
    """Greedy speculative output == target alone in every setting; no leaked blocks. Returns
    totals (drafts, accepted, mixed steps, preemptions) for the caller's assertions."""
    ps, want = ref
    # policy fixed unless the spec names one: callers assert on the totals, and the goodput
    # policy's drafts depend on measured step times (a loaded CI run once gave a random MLP head
    # only drafts that failed: 0 of 205 accepted); its exactness has tests of its own
    spec = {"policy": "fixed", **spec} if spec is not None else None
    tot = dict(num_draft_tokens=0, num_accepted_tokens=0, mixed=0, preempted=0, window_freed=0)
    for block_size, budget, blocks, batch in settings:
        gen = Generator(str(target), block_size=block_size, max_num_batched_tokens=budget, num_kv_blocks=blocks,
                        max_model_len=128, speculative=spec)
        outs = gen.generate(ps[:batch], GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == want[:batch], (spec, block_size, budget, batch)
        core = gen.engine.core
        assert core.num_free_blocks() == core.num_total_blocks()
        core.check_invariants()
        m = gen.spec_metrics()
        tot["num_draft_tokens"] += m["num_draft_tokens"]
        tot["num_accepted_tokens"] += m["num_accepted_tokens"]
        tot["mixed"] += gen.engine.num_mixed_steps
        tot["preempted"] += core.stats()["num_preemptions"]
        tot["window_freed"] += core.stats()["num_window_freed_blocks"]
    assert tot["mixed"] > 0, "no step mixed prefill chunks with verification runs"
    # a model whose every layer slides gives back the blocks out of its window (SchedulerCore's
    # sliding_window): the pool may then never run out (test_sliding_window_kv.py preempts it)
    assert tot["preempted"] > 0 or tot["window_freed"] > 0, "no request was preempted"
    assert tot["num_draft_tokens"] > 0
    return tot


def check_prefix_hits(target, spec: dict, ref) -> None:
    """The same prompts twice through one engine: the second pass hits the prefix cache and
    still gives the target's output."""
    ps, want = ref
    gen = Generator(str(target), block_size=4, max_model_len=128, speculative=spec)
    for _ in range(2):
        assert [o.token_ids for o in gen.generate(ps[:8], GREEDY, use_tqdm=False)] == want[:8]
    assert gen.engine.core.stats()["prefix_cache_hits"] > 0
    return gen
