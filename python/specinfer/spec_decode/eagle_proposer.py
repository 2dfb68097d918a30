"""EAGLE / EAGLE-3 proposer: feature-level autoregression over (token i+1, target feature i) pairs with its
own paged draft KV over the target's block tables (budgeted with the target's: `kv_models`).

Per request it keeps `num_seen`: draft KV is written for pair positions [0, num_seen). Every step
(drafting or not: `sees_every_step`), each running request's newly confirmed target positions
c .. num_confirmed - 1 go through the draft layer as pairs (x_{i+1}, f_i): prefill chunks (whose
next prompt token is known), plain decodes and the accepted part of verification runs alike. The
last pair's output gives the first draft; each further draft feeds (draft, previous output) at the
next position, writing KV into the lookahead slots the core reserved. Those speculative pair
positions are rewritten by the next step's catch-up with the true pairs.

A request first seen with a prefix-cache hit (or resumed after preemption) starts at its
computed count: the cached blocks' draft KV was written by the request that computed them. The
one exception is the pair at the last cached position c - 1, which depends on token c: the
request that filled the block may have had another token there (drafts then stay lossless; only
acceptance can dip). EAGLE cannot rewrite it (it would need the target state f_{c-1}, which the
target does not recompute for cached positions); a core option recomputing the last cached block
(vLLM's remedy) would make it exact.

Chains: greedy requests draft the argmax of the head (q = one-hot); a request with temperature > 0
samples each draft from the head's distribution under its sampling parameters (q, handed to the
rejection sampler), with its counter-based uniform ``U(seed, output position, DRAFT)``
(spec_decode/draft_sampling.py, as the draft model does). EAGLE-3 drafts over its own vocabulary:
q is zero outside it.

Trees (``token_tree``; spec_decode/tree_drafting.py): static ranked children or EAGLE-2 dynamic
trees, drafted depth by depth. Node i of a tree under root token position R is the pair (its
token, its parent's draft feature) at pair position R - 1 + depth, written at KV slot position
R + i (the target's tree layout shifted by one, as pair position p holds token p + 1), seeing the
confirmed pairs, its ancestors and itself. Children are top-k choices (``draft_probs=None``,
verified with the one-hot variant) for every temperature. The next catch-up rewrites pairs from
the root on with the target's features, so the tree's KV (whatever the KV copies did to it) is
never read again.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specinfer.attention import ForwardContext
from specinfer.engine.batch import attention_metadata_for_runs, attention_metadata_for_tree_nodes
from specinfer.engine.step_sampler import sampling_metadata
from specinfer.spec_decode.draft_sampling import gather_probs, sample_drafts
from specinfer.spec_decode.eagle import EagleDraft
from specinfer.spec_decode.eagle3 import Eagle3Draft
from specinfer.spec_decode.proposer import Proposal, ProposalInput
from specinfer.spec_decode.token_tree import DynamicTree
from specinfer.spec_decode.tree_drafting import draft_trees, tree_lookahead, tree_proposal


class EagleProposer:
    sees_every_step = True  # confirmed target states exist only in the step that computed them
    draft_class = EagleDraft

    def __init__(self, spec, ctx):
        path = Path(spec.model)
        if not path.is_dir():
            raise FileNotFoundError(f"speculative.model {spec.model!r} is not a directory holding an "
                                    f"{spec.method} checkpoint")
        self.draft = self.draft_class.load(path, target=ctx.target, dtype=ctx.target.model.norm.dtype,
                                           device=ctx.device)
        self.aux_layers = self.draft.aux_layers  # target layers whose inputs the forward must hand over
        self.kv_models = [self.draft]
        self.tree = spec.token_tree  # StaticTree | DynamicTree | None (chains)
        if self.tree is not None:
            _check_tree_fits_vocabulary(self.tree, int(self.draft.draft_vocab_size), spec.method)
        # slots past the root: the target's tree nodes, and the fed nodes' pairs at root + slot
        self.num_lookahead_tokens = (spec.num_speculative_tokens if self.tree is None
                                     else tree_lookahead(self.tree, 0))
        self.block_size = ctx.block_size
        self.device = ctx.device
        self.num_seen: dict[int, int] = {}  # core id -> pair positions whose draft KV is written

    def bind_kv_caches(self, kv_caches_per_model, backend) -> None:
        self.kv_caches, self.backend = kv_caches_per_model[0], backend

    def forget(self, core_ids) -> None:
        for i in core_ids:
            self.num_seen.pop(int(i), None)

    def _forward(self, block_rows, starts, lens, tokens, features) -> torch.Tensor:
        attn, positions = attention_metadata_for_runs(block_rows, starts, lens, self.block_size, self.device)
        ctx = ForwardContext(self.backend, self.backend.prepare(attn), self.kv_caches)
        return self.draft.forward(torch.from_numpy(tokens).to(self.device), features,
                                  torch.from_numpy(positions).to(self.device), ctx)

    @torch.inference_mode()
    def propose(self, inp: ProposalInput) -> Proposal:
        live = np.flatnonzero([not st.finished for st in inp.requests])
        if len(live) == 0:
            return Proposal.empty()
        c, confirmed, start = inp.num_computed[live], inp.num_confirmed[live], inp.token_start[live]
        seen = np.fromiter((self.num_seen.get(inp.requests[r].core_id, c[j]) for j, r in enumerate(live)),
                           np.int64, len(live))
        # positions seen already (never expected past c) are skipped; a gap below c cannot be filled
        begin = np.clip(seen, c, confirmed)
        lens = confirmed - begin
        has = lens > 0
        live, c, confirmed, start, begin, lens = (a[has] for a in (live, c, confirmed, start, begin, lens))
        if len(live) == 0:
            return Proposal.empty()
        rows = np.concatenate([np.arange(s + b - cc, s + b - cc + n) for s, b, cc, n in zip(start, begin, c, lens)])
        tokens = np.concatenate([inp.requests[r].tokens_slice(b + 1, e + 1) for r, b, e in zip(live, begin, confirmed)])
        features = self.draft.target_features(inp.hidden, torch.from_numpy(rows).to(inp.hidden.final.device))
        h = self._forward(inp.block_rows[live], begin, lens, tokens.astype(np.int64), features)
        for r, e in zip(live, confirmed):
            self.num_seen[inp.requests[r].core_id] = int(e)
        drafting = inp.max_drafts[live] > 0
        if not drafting.any():
            return Proposal.empty()
        last = (np.cumsum(lens) - 1)[drafting]
        return self._draft(inp, live[drafting], confirmed[drafting], h[torch.from_numpy(last).to(h.device)])

    def _draft(self, inp, rows, next_pos, h) -> Proposal:
        if self.tree is not None:
            return self._draft_tree(inp, rows, next_pos - 1, h)
        states = [inp.requests[r] for r in rows]
        limit = inp.max_drafts[rows]
        first_out = np.array([len(st.output_token_ids) for st in states], dtype=np.int64)
        meta = sampling_metadata(states, device=self.device, positions=first_out)
        want_probs = not meta.all_greedy
        steps = int(limit.max())
        drafted = np.zeros((len(rows), steps), dtype=np.int64)
        probs_out = []
        active = np.arange(len(rows))
        for i in range(steps):
            if want_probs:
                tok, probs = sample_drafts(self.draft.full_logits(h), meta, active, i, True)
                probs_out.append((active, probs))
            else:
                tok = self.draft.draft_tokens(h)
            drafted[active, i] = tok.cpu().numpy()
            active_next = active[limit[active] > i + 1]
            if len(active_next) == 0:
                break
            keep = torch.from_numpy(np.searchsorted(active, active_next)).to(h.device)
            active = active_next
            h = self._forward(inp.block_rows[rows[active]], next_pos[active] + i, np.ones(len(active), np.int64),
                              drafted[active, i], h[keep])
        prop = Proposal.from_drafts(inp.core_ids[rows], drafted, limit)
        if not want_probs:
            return prop
        return Proposal(prop.core_ids, prop.cu_num_draft, prop.draft_token_ids,
                        gather_probs(probs_out, len(rows), limit))

    def _draft_tree(self, inp, rows, tree_starts, h_root) -> Proposal:
        """Trees under each drafting request's root; tree_starts int64[P] = the root token's pair
        position (its last confirmed pair), h_root [P, H] that pair's draft feature."""
        block_rows = inp.block_rows[rows]

        def feed(req, slots, depths, masks, tokens, parent_h):
            ids, counts = np.unique(req, return_counts=True)
            attn, positions = attention_metadata_for_tree_nodes(block_rows[ids], tree_starts[ids], counts, slots,
                                                                depths, masks, self.block_size, self.device)
            ctx = ForwardContext(self.backend, self.backend.prepare(attn), self.kv_caches)
            h = self.draft.forward(torch.from_numpy(tokens).to(self.device), parent_h,
                                   torch.from_numpy(positions).to(self.device), ctx)
            return self.draft.full_logits(h), h

        cap = inp.max_drafts[rows]
        # fed slot s is pair position root + s: below root + lookahead (reserved) and max_model_len
        fed_cap = np.minimum(cap, self.num_lookahead_tokens)
        trees = draft_trees(self.tree, self.draft.full_logits(h_root), h_root, cap, fed_cap, feed)
        return tree_proposal(inp.core_ids[rows], trees)


def _check_tree_fits_vocabulary(tree, vocab: int, method: str) -> None:
    need = tree.top_k if isinstance(tree, DynamicTree) else tree.max_rank + 1
    if need > vocab:
        raise ValueError(f"speculative.token_tree asks for {need} children per node, but the {method} head's "
                         f"draft vocabulary has {vocab} tokens")


class Eagle3Proposer(EagleProposer):
    """EAGLE-3: features from three target layers through fc; own norm, lm_head and vocabulary."""

    draft_class = Eagle3Draft
