"""Prompt-lookup (n-gram) proposer: the Rust core matches each request's latest n-gram in its
own history and proposes the tokens that followed its most recent earlier occurrence."""
from __future__ import annotations

import numpy as np

from specinfer.spec_decode.proposer import Proposal, ProposalInput, Proposer


class NgramProposer(Proposer):
    kv_models: list = []
    num_lookahead_tokens = 0
    aux_layers = ()

    def __init__(self, spec, ctx):
        self.k = spec.num_speculative_tokens
        self.min_n, self.max_n = spec.prompt_lookup_min, spec.prompt_lookup_max
        self.core = None  # set by the engine once the core exists

    def bind_kv_caches(self, kv_caches_per_model, backend) -> None:
        pass

    def bind_core(self, core) -> None:
        self.core = core

    drafts_in_core = True

    def propose(self, inp: ProposalInput) -> Proposal:
        rows = np.flatnonzero(inp.max_drafts > 0)
        ids = inp.core_ids[rows]
        cu, tokens = self.core.propose_ngram(ids, self.k, self.min_n, self.max_n)
        cu, tokens = np.asarray(cu, dtype=np.int32), np.asarray(tokens, dtype=np.int64)
        n = cu[1:] - cu[:-1]
        keep = np.minimum(n, inp.max_drafts[rows])  # the budget each request was given (the policy's choice)
        if (keep < n).any():
            tokens = tokens[np.arange(len(tokens)) - np.repeat(cu[:-1], n) < np.repeat(keep, n)]
            cu = np.zeros(len(keep) + 1, dtype=np.int32)
            np.cumsum(keep, out=cu[1:])
        return Proposal(ids, cu, tokens, None)

    def propose_in_core(self, core_ids, k: int, budgets=None) -> int:
        return self.core.propose_ngram_drafts(core_ids, min(k, self.k), self.min_n, self.max_n, budgets)

    def forget(self, core_ids) -> None:
        pass
