"""Suffix decoding (SuffixDecoding, Oliaro et al., NeurIPS 2025; vLLM's method "suffix"): no model,
speculation trees from suffix tries over token histories, built and searched in the Rust core
(scheduler/src/suffix.rs), which owns the histories: a trie per request over its prompt and output,
and a global trie over the outputs of the last `suffix_decoding_max_cached_requests` ended
requests (agent loops, repeated edits and RL rollouts repeat earlier answers).

Each step the core matches the longest suffix of the request's context (at most the tries' depth
- 1 tokens) that has a continuation, and grows a tree best-first by continuation frequency, at
most min(budget, factor x match length) nodes, each at least `min_token_prob` likely; the trie
whose tree expects more accepted tokens wins. The budget is the policy's (goodput by default: it
turns speculation off where trees are not accepted). Trees are verified by the token-tree path,
chains (a tree that is a path) by the chain path; drafts are deterministic (q one-hot), so the
output keeps the target's law.
"""
from __future__ import annotations

import numpy as np

from specinfer.spec_decode.proposer import Proposal, ProposalInput, Proposer


class SuffixProposer(Proposer):
    kv_models: list = []
    num_lookahead_tokens = 0
    aux_layers = ()

    def __init__(self, spec, ctx):
        self.k = spec.num_speculative_tokens
        self.max_depth = spec.suffix_decoding_max_tree_depth
        self.factor = float(spec.suffix_decoding_max_spec_factor)
        self.min_prob = float(spec.suffix_decoding_min_token_prob)
        self.max_cached = spec.suffix_decoding_max_cached_requests
        self.core = None
        self.num_global_proposals = 0  # request-steps whose tree came from the global trie
        self.num_proposals = 0  # request-steps with a non-empty tree

    def bind_kv_caches(self, kv_caches_per_model, backend) -> None:
        pass

    def bind_core(self, core) -> None:
        self.core = core
        core.enable_suffix(self.max_depth, self.max_cached)

    def propose(self, inp: ProposalInput) -> Proposal:
        rows = np.flatnonzero(inp.max_drafts > 0)
        ids = inp.core_ids[rows]
        cu, tokens, parents, _, _, from_global = self.core.propose_suffix(
            ids, inp.max_drafts[rows].astype(np.int64), self.factor, self.min_prob)
        counts = np.diff(cu)
        self.num_proposals += int((counts > 0).sum())
        self.num_global_proposals += int((from_global & (counts > 0)).sum())
        return Proposal(ids, np.asarray(cu, dtype=np.int32), np.asarray(tokens, dtype=np.int64), None,
                        np.asarray(parents, dtype=np.int32))

    def forget(self, core_ids) -> None:
        pass  # the core drops a request's trie when the request ends
