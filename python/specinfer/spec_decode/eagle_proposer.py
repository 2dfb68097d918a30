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
computed count: the cached blocks' draft KV was written by the request that computed them
(finished requests included: their last step's pairs are written too). The one exception is the
pair at the last cached position c - 1, which depends on token c: the request that filled the
block may have had another token there. The proposer records, per full block, the next token
its last pair was written with and the target feature there (PairRecords); when they differ,
the request copies the block into one of NUM_PRIVATE_BLOCKS private draft-KV blocks (past the
shared pool, never handed out by the core), rewrites the pair there and reads that copy from then
on (the shared block may serve a request still running). Unrecorded blocks or no free private
block leave the stale pair (drafts stay lossless; only acceptance can dip):
`num_unknown_prefix_pairs` counts those.

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

from specinfer.attention.batch_metadata import attention_metadata_for_runs, attention_metadata_for_tree_nodes
from specinfer.sample.request_rows import all_greedy, sampling_metadata
from specinfer.spec_decode.draft_kv_records import NUM_PRIVATE_BLOCKS, PairRecords
from specinfer.spec_decode.draft_sampling import gather_probs, sample_drafts
from specinfer.spec_decode.eagle import EagleDraft
from specinfer.spec_decode.eagle3 import Eagle3Draft
from specinfer.spec_decode.proposer import Proposal, ProposalInput, Proposer
from specinfer.spec_decode.token_tree import DynamicTree
from specinfer.spec_decode.tree_drafting import draft_trees, tree_lookahead, tree_proposal


class EagleProposer(Proposer):
    sees_every_step = True  # confirmed target states exist only in the step that computed them
    draft_class = EagleDraft
    method = "eagle"

    @classmethod
    def load_head(cls, path, target, *, dtype, device):
        """target: the LoadedModel (its config, embedding and lm_head)."""
        if not Path(path).is_dir():
            raise FileNotFoundError(f"speculative.model {str(path)!r} is not a directory holding an "
                                    f"{cls.method} checkpoint")
        return cls.draft_class.load(Path(path), target=target, dtype=dtype, device=device)

    def __init__(self, spec, ctx):
        # a handle (executor/head_handle.py): the draft layer and its KV pool, on every rank under TP
        self.draft = ctx.load_head(spec.method, spec.model)
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
        self.records = PairRecords(ctx.block_size)
        self.private: dict[int, tuple[int, int]] = {}  # core id -> (block index, private block id)
        self.free_private: list[int] = []
        self.num_unknown_prefix_pairs = 0  # prefix hits whose last cached pair could not be checked
        self.num_private_copies = 0  # prefix hits whose last cached pair was rewritten in a private copy

    def bind_kv_caches(self, kv_caches_per_model, backend) -> None:
        self.draft.bind(kv_caches_per_model[0], backend)
        total = kv_caches_per_model[0][0].shape[1]  # the pool's blocks (and null blocks), then our private ones
        self.free_private = list(range(total - NUM_PRIVATE_BLOCKS, total))[::-1]

    def forget(self, core_ids) -> None:
        for i in core_ids:
            self.num_seen.pop(int(i), None)
            self.records.forget(int(i))
            if int(i) in self.private:
                self.free_private.append(self.private.pop(int(i))[1])

    def _forward(self, block_rows, starts, lens, tokens, features) -> torch.Tensor:
        attn, positions = attention_metadata_for_runs(block_rows, starts, lens, self.block_size, self.device)
        return self.draft.forward_attn(torch.from_numpy(tokens).to(self.device), features,
                                       torch.from_numpy(positions).to(self.device), attn)

    @torch.inference_mode()
    def propose(self, inp: ProposalInput) -> Proposal:
        # every request with newly confirmed positions, finished ones included: their blocks may be
        # cached and reused by later requests, which then need the pairs there
        n_tok = np.fromiter((st.num_tokens for st in inp.requests), np.int64, inp.num_requests)
        c, start = inp.num_computed, inp.token_start[:-1]
        confirmed = np.minimum(inp.num_confirmed, n_tok - 1)  # pair p needs token p + 1
        finished = np.array([st.finished for st in inp.requests], dtype=bool)
        for r in np.flatnonzero(~finished):
            if inp.requests[r].core_id not in self.num_seen:
                self._first_sight(inp, r)
        block_rows = self._block_rows(inp)
        seen = np.fromiter((self.num_seen.get(st.core_id, c[r]) for r, st in enumerate(inp.requests)),
                           np.int64, inp.num_requests)
        # positions seen already (never expected past c) are skipped; a gap below c cannot be filled
        begin = np.clip(seen, c, np.maximum(confirmed, c))
        lens = np.maximum(confirmed - begin, 0)
        live = np.flatnonzero(lens > 0)
        if len(live) == 0:
            return Proposal.empty()
        c, confirmed, start, begin, lens = (a[live] for a in (c, confirmed, start, begin, lens))
        rows = np.concatenate([np.arange(s + b - cc, s + b - cc + n) for s, b, cc, n in zip(start, begin, c, lens)])
        tokens = np.concatenate([inp.requests[r].tokens_slice(b + 1, e + 1) for r, b, e in zip(live, begin, confirmed)])
        features = self.draft.target_features(inp.hidden, torch.from_numpy(rows).to(inp.hidden.final.device))
        h = self._forward(block_rows[live], begin, lens, tokens.astype(np.int64), features)
        self._record_last_pairs(inp, live, begin, lens, tokens, features)
        for r, e in zip(live, confirmed):
            if not finished[r]:
                self.num_seen[inp.requests[r].core_id] = int(e)
        drafting = (inp.max_drafts[live] > 0) & ~finished[live]
        if not drafting.any():
            return Proposal.empty()
        last = (np.cumsum(lens) - 1)[drafting]
        rows_d = live[drafting]
        return self._draft(inp, rows_d, block_rows[rows_d], confirmed[drafting],
                           h[torch.from_numpy(last).to(h.device)])

    # ---- prefix-cache hits: the pair at the last cached position --------------------------------
    def _first_sight(self, inp, r) -> None:
        """Request r is seen for the first time with c computed tokens (a prefix-cache hit or a
        resume): the pairs below c were written by whoever computed those blocks, but the last one,
        (token c, f_{c-1}), holds that writer's token c. If it differs from r's, r rewrites the pair
        in a private copy of the block (the block may be shared with a request still running)."""
        st, c, bs = inp.requests[r], int(inp.num_computed[r]), self.block_size
        if c == 0 or c % bs or c >= st.num_tokens or st.core_id in self.private:
            return
        rec = self.records.last_pair(st, inp.block_rows[r], c)
        if rec is None:
            self.num_unknown_prefix_pairs += 1  # never recorded: drafts stay lossless, acceptance may dip
            return
        next_token, feature = rec
        if next_token == st.token_at(c):
            return
        if not self.free_private:
            self.num_unknown_prefix_pairs += 1
            return
        i, private = c // bs - 1, self.free_private.pop()
        shared = int(inp.block_rows[r][i])
        self.draft.copy_block(shared, private)
        self.private[st.core_id] = (i, private)
        self.num_private_copies += 1
        row = inp.block_rows[r:r + 1].copy()
        row[0, i] = private
        self._forward(row, np.array([c - 1]), np.ones(1, np.int64), np.array([st.token_at(c)], np.int64),
                      feature[None].to(self.device))

    def _block_rows(self, inp) -> np.ndarray:
        """int32[R, W] the requests' block rows with their private block copies swapped in."""
        if not self.private:
            return inp.block_rows
        out = inp.block_rows.copy()
        for r, st in enumerate(inp.requests):
            if st.core_id in self.private:
                i, b = self.private[st.core_id]
                out[r, i] = b
        return out

    def _record_last_pairs(self, inp, live, begin, lens, tokens, features) -> None:
        bs, off = self.block_size, 0
        for r, b, n in zip(live.tolist(), begin.tolist(), lens.tolist()):
            st = inp.requests[r]
            for p in range(b + (-(b + 1)) % bs, b + n, bs):  # positions p with (p + 1) % bs == 0
                j = off + p - b
                self.records.wrote_last_pair(st, inp.block_rows[r][p // bs], p // bs, int(tokens[j]), features[j],
                                             keep=not st.finished)
            off += n

    def _draft(self, inp, rows, block_rows, next_pos, h) -> Proposal:
        if self.tree is not None:
            return self._draft_tree(inp, rows, block_rows, next_pos - 1, h)
        states = [inp.requests[r] for r in rows]
        limit = inp.max_drafts[rows]
        meta = None
        if not all_greedy(states):
            first_out = np.array([len(st.output_token_ids) for st in states], dtype=np.int64)
            meta = sampling_metadata(states, device=self.device, positions=first_out)
        want_probs = meta is not None and not meta.all_greedy
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
            h = self._forward(block_rows[active], next_pos[active] + i, np.ones(len(active), np.int64),
                              drafted[active, i], h[keep])
        prop = Proposal.from_drafts(inp.core_ids[rows], drafted, limit)
        if not want_probs:
            return prop
        return Proposal(prop.core_ids, prop.cu_num_draft, prop.draft_token_ids,
                        gather_probs(probs_out, len(rows), limit))

    def _draft_tree(self, inp, rows, block_rows, tree_starts, h_root) -> Proposal:
        """Trees under each drafting request's root; tree_starts int64[P] = the root token's pair
        position (its last confirmed pair), h_root [P, H] that pair's draft feature."""

        def feed(req, slots, depths, masks, tokens, parent_h):
            ids, counts = np.unique(req, return_counts=True)
            attn, positions = attention_metadata_for_tree_nodes(block_rows[ids], tree_starts[ids], counts, slots,
                                                                depths, masks, self.block_size, self.device)
            h = self.draft.forward_attn(torch.from_numpy(tokens).to(self.device), parent_h,
                                        torch.from_numpy(positions).to(self.device), attn)
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
    method = "eagle3"
