"""Prompt lookup first, the model's drafts otherwise (`speculative.ngram_first`).

Each step, a request whose history repeats its latest n-gram (prompt_lookup_min .. max tokens)
drafts the tokens that followed the n-gram's most recent earlier occurrence, as the n-gram
proposer would; every other request drafts from the wrapped proposer (a head or a draft model).
Repeated text (code being edited, a summary quoting its source) is where lookup accepts long runs
at no cost, and open-ended text where it finds nothing and a trained head earns its cost, so the
union takes each where it is strong (the hybrid of Arctic Inference's suffix decoding with a
head). Both are lossless proposers, so the output is unchanged: every draft is still verified.

The wrapped proposer still sees every step's confirmed tokens (it is called with a zero budget
for the lookup rows, which is how the goodput policy asks it for nothing), so a head's draft KV
and a draft model's state follow the request exactly as without lookup. Lookup drafts are
deterministic: q = one-hot (``DETERMINISTIC`` beside a head's sampled q), and under a token tree
they are a chain-shaped tree (each node the child of the one before).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from specinfer.spec_decode.proposer import DETERMINISTIC, Proposal, ProposalInput, Proposer


class NgramFirstProposer(Proposer):
    def __init__(self, inner, spec):
        self.inner = inner
        self.k = spec.num_speculative_tokens
        self.min_n, self.max_n = spec.prompt_lookup_min, spec.prompt_lookup_max
        self.core = None
        self.num_lookup_proposals = 0  # request-steps drafted by lookup
        self.num_model_proposals = 0  # request-steps handed to the wrapped proposer with a budget

    # ---- the wrapped proposer's interface, passed through ---------------------------------------
    @property
    def kv_models(self) -> list:
        return self.inner.kv_models

    @property
    def num_lookahead_tokens(self) -> int:
        return self.inner.num_lookahead_tokens

    @property
    def aux_layers(self) -> tuple:
        return self.inner.aux_layers

    @property
    def sees_every_step(self) -> bool:
        return self.inner.sees_every_step

    def bind_kv_caches(self, kv_caches_per_model, backend) -> None:
        self.inner.bind_kv_caches(kv_caches_per_model, backend)

    def bind_target_kv_caches(self, caches) -> None:
        self.inner.bind_target_kv_caches(caches)

    def bind_core(self, core) -> None:
        self.core = core
        self.inner.bind_core(core)

    def forget(self, core_ids) -> None:
        self.inner.forget(core_ids)

    # ---- proposing --------------------------------------------------------------------------------
    def propose(self, inp: ProposalInput) -> Proposal:
        rows = np.flatnonzero(inp.max_drafts > 0)
        lookup = {}  # batch row -> lookup drafts (at most its budget)
        if len(rows):
            cu, tokens = self.core.propose_ngram(inp.core_ids[rows], self.k, self.min_n, self.max_n)
            cu, tokens = np.asarray(cu, np.int64), np.asarray(tokens, np.int64)
            for j, r in enumerate(rows.tolist()):
                n = min(int(cu[j + 1] - cu[j]), int(inp.max_drafts[r]))
                if n > 0:
                    lookup[r] = tokens[cu[j]:cu[j] + n]
        budget = inp.max_drafts.copy()
        budget[list(lookup)] = 0
        self.num_lookup_proposals += len(lookup)
        self.num_model_proposals += int((budget > 0).sum())
        model = self.inner.propose(dataclasses.replace(inp, max_drafts=budget))
        return merge(inp, lookup, model)


def merge(inp: ProposalInput, lookup: dict, model: Proposal) -> Proposal:
    """One proposal in batch order: the lookup rows' chains beside the model's proposals."""
    if not lookup:
        return model
    row_of = {int(c): r for r, c in enumerate(inp.core_ids.tolist())}
    entries = {}  # batch row -> (drafts, q or None, parents or None)
    for j, cid in enumerate(model.core_ids.tolist()):
        a, b = int(model.cu_num_draft[j]), int(model.cu_num_draft[j + 1])
        q = None if model.draft_probs is None else model.draft_probs[j]
        if q is None and model.draft_parents is None and inp.requests[row_of[int(cid)]].params.temperature != 0.0:
            q = DETERMINISTIC  # (a model with deterministic chains beside sampled lookup rows)
        par = None if model.draft_parents is None else np.asarray(model.draft_parents[a:b], np.int32)
        entries[row_of[int(cid)]] = (model.draft_token_ids[a:b], q, par)
    # q per request once any request needs it (a head's sampled drafts, or a sampling request's
    # lookup drafts, which the verifier must see marked deterministic)
    sampled_q = model.draft_probs is not None or any(inp.requests[r].params.temperature != 0.0 for r in lookup)
    tree = model.draft_parents is not None
    for r, toks in lookup.items():
        chain = np.arange(-1, len(toks) - 1, dtype=np.int32) if tree else None
        entries[r] = (toks, DETERMINISTIC if sampled_q else None, chain)
    order = sorted(entries)
    drafts = [entries[r][0] for r in order]
    counts = np.array([len(d) for d in drafts], np.int32)
    cu = np.zeros(len(order) + 1, np.int32)
    np.cumsum(counts, out=cu[1:])
    return Proposal(inp.core_ids[np.array(order, np.int64)], cu,
                    np.concatenate(drafts).astype(np.int64) if drafts else np.zeros(0, np.int64),
                    [entries[r][1] for r in order] if sampled_q else None,
                    np.concatenate([entries[r][2] for r in order]) if tree else None)
