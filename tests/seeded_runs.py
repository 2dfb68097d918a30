"""Seeded speculative runs with a split-proposal counter, shared by the seeded-determinism tests
and the head draft-probability tests."""
from __future__ import annotations

import torch

from specinfer import Generator, SamplingParams

SEEDED = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=1234)


PROMPT = [5, 17, 99, 5, 17, 99, 5, 17, 40, 41, 5, 17]  # repeats: n-gram lookup proposes


def other_requests(n):
    g = torch.Generator().manual_seed(21)
    prompts = [torch.randint(3, 256, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    params = [SamplingParams(max_tokens=int(8 + 3 * i), temperature=[0.0, 1.0, 0.6][i % 3]) for i in range(n)]
    return prompts, params


class SplitCounter:
    """Wraps the engine's step sampler to count the seeded request's proposals split by the
    token budget."""

    def __init__(self, fn):
        self.fn, self.splits = fn, 0

    def __call__(self, logits, sched, states, draft_probs, masks=None, positions=None, **kw):
        em = self.fn(logits, sched, states, draft_probs, masks, positions, **kw)
        split = (em.num_draft_tokens > 0) & (em.num_rows == em.num_draft_tokens)
        self.splits += sum(int(s) for s, st in zip(split, states) if st.params.seed is not None)
        return em


def run_seeded(target, draft, method, acceptance, batch, **engine):
    spec = {"method": method, "num_speculative_tokens": 4, "acceptance_method": acceptance}
    if method == "draft_model":
        spec["model"] = str(draft)
    else:
        spec["prompt_lookup_min"], spec["prompt_lookup_max"] = 1, 3
    spec.update(engine.pop("spec", {}))
    gen = Generator(str(target), block_size=4, max_model_len=64, speculative=spec, **engine)
    counter = SplitCounter(gen.engine.step_sampler)
    gen.engine.step_sampler = counter
    prompts, params = other_requests(batch)
    # the seeded request comes last: budget cuts and preemption hit it first
    outs = gen.generate(prompts + [PROMPT], params + [SEEDED], use_tqdm=False)
    core = gen.engine.core
    assert core.num_free_blocks() == core.num_total_blocks()
    return outs[-1].token_ids, counter.splits, core.stats()["num_preemptions"], gen.spec_metrics()
