"""Draft-model proposer: a smaller LM with the target's tokenizer drafts k tokens per request
(a draft with another tokenizer goes through spec_decode/cross_vocab.py: draft_model_proposer).

Its KV cache lives in the same paged blocks as the target's (same block tables and slots).
Each step it first catches up on every token the target confirmed that it has not yet seen
(prefill chunks of this step, accepted drafts, the recovered/bonus token — or a whole history
after a pause), in one batched forward whose last rows give the first draft; then k - 1
batched single-token forwards give the rest. Positions it writes past the confirmed tokens sit
in the lookahead slots the core reserved; rejected ones are simply overwritten later.

The catch-up takes at most the engine's token budget (plus one token per sampled request) per
step: in steady state that is exactly what the target confirmed, while a long history after a
pause is caught up over several steps (a request drafts once it is level). On a
request's first sight, prefix-cache blocks are reused only where this draft wrote their KV for
the same prefix (DraftKvRecords). Draft tokens are sampled from q by inverse CDF with the
request's counter-based draw ``U(seed, output position, DRAFT)``.

With a ``token_tree`` the drafts are a tree (spec_decode/tree_drafting.py): the root is the last
token of the catch-up, each depth's nodes that have children go through the draft in one batched
forward with a tree mask, written at the slots the target's tree run uses (node i at root + 1 + i).
Children are top-k choices (q = one-hot, ``draft_probs=None``) also for temperature > 0: the
verifier's one-hot variant keeps them lossless. Catch-up always restarts at the root + 1, so the
accepted path (compacted by the engine's KV copies or not) and the bonus token are recomputed.
"""
from __future__ import annotations

import numpy as np
import torch

from specinfer.attention.batch_metadata import (attention_metadata_for_decode_steps, attention_metadata_for_runs,
                                               attention_metadata_for_tree_nodes)
from specinfer.models.model_runner import ModelRunner
from specinfer.sample.request_rows import all_greedy, sampling_metadata
from specinfer.spec_decode.draft_sampling import gather_probs, sample_drafts
from specinfer.spec_decode.draft_kv_records import DraftKvRecords
from specinfer.spec_decode.proposer import Proposal, ProposalInput, Proposer
from specinfer.spec_decode.tree_drafting import draft_trees, tree_lookahead, tree_proposal


class DraftModelProposer(Proposer):
    aux_layers = ()

    def __init__(self, spec, ctx, loaded=None):
        self.k = spec.num_speculative_tokens
        self.loaded = loaded if loaded is not None else ctx.load_model(spec.model)
        _check_same_vocabulary(ctx.target, self.loaded, spec.model)
        self.kv_models = [self.loaded.model]
        self.tree = spec.token_tree  # StaticTree | DynamicTree | None (chains)
        # slots past the root: the target's tree nodes, and the draft's fed nodes at root + 1 + slot
        self.num_lookahead_tokens = self.k if self.tree is None else tree_lookahead(self.tree, 1)
        self.block_size = ctx.block_size
        self.device = ctx.device
        self.max_catch_up_tokens = ctx.max_num_batched_tokens
        self.make_runner = ctx.make_runner
        self.runner: ModelRunner | None = None
        self.num_seen: dict[int, int] = {}  # core id -> tokens whose draft KV is written
        self.records = DraftKvRecords(ctx.block_size)

    def bind_kv_caches(self, kv_caches_per_model, backend) -> None:
        self.runner = self.make_runner(self.loaded.model, kv_caches_per_model[0], backend)

    def forget(self, core_ids) -> None:
        for i in core_ids:
            self.num_seen.pop(int(i), None)
            self.records.forget(int(i))

    def propose(self, inp: ProposalInput) -> Proposal:
        R = inp.num_requests
        num_computed, scheduled = inp.num_computed, inp.num_scheduled
        follow = inp.catch_up
        starts = np.zeros(R, np.int64)
        ends = np.zeros(R, np.int64)
        level = np.zeros(R, dtype=bool)  # caught up with every confirmed token
        # The target's scheduled tokens plus each sampled request's new token: in steady state
        # that is exactly what the draft must see, so only a catch-up after a pause is spread.
        budget = self.max_catch_up_tokens + int(inp.sampled.sum())
        for r, st in enumerate(inp.requests):
            if st.finished or not follow[r]:
                continue
            # confirmed tokens: through the new token when sampled, else the prefill chunk
            confirmed = st.num_tokens if inp.sampled[r] else num_computed[r] + scheduled[r]
            start = self.num_seen.get(st.core_id)
            if start is None:  # first sight: reuse only blocks whose draft KV this draft wrote
                start = self.records.reusable_tokens(st, inp.block_rows[r], int(num_computed[r]))
            end = min(confirmed, start + budget)
            budget -= end - start
            starts[r], ends[r] = start, end
            self.num_seen[st.core_id] = int(end)
            level[r] = end == confirmed
        live = np.flatnonzero(ends > starts)
        hidden = None
        if len(live):
            self.records.will_write_runs(inp.block_rows[live], starts[live], ends[live])
            tokens = np.fromiter((t for r in live for t in inp.requests[r].tokens_slice(starts[r], ends[r])),
                                 dtype=np.int64)
            attn, positions = attention_metadata_for_runs(inp.block_rows[live], starts[live],
                                                          ends[live] - starts[live], self.block_size, self.device)
            hidden, _ = self.runner.forward(torch.from_numpy(tokens).to(self.device),
                                            torch.from_numpy(positions).to(self.device), attn)
            self.records.wrote_confirmed_runs([inp.requests[r] for r in live], inp.block_rows[live], starts[live],
                                              ends[live])
        # a request drafts when it is level and its last confirmed token went through this forward
        ran = np.zeros(R, dtype=bool)
        ran[live] = True
        drafting = level & ran & (inp.max_drafts > 0)
        if not drafting.any():
            return _empty()
        last_row_of = np.cumsum(ends[live] - starts[live]) - 1  # per live request
        row_in_live = {int(r): j for j, r in enumerate(live)}
        rows = np.flatnonzero(drafting)
        last_rows = np.array([last_row_of[row_in_live[int(r)]] for r in rows], dtype=np.int64)
        logits = self.runner.logits(hidden[torch.from_numpy(last_rows).to(self.device)])
        if self.tree is not None:
            return self._draft_tree(inp, rows, ends[rows] - 1, logits)
        return self._draft(inp, rows, ends[rows], logits)

    def _draft_tree(self, inp, rows, roots, logits) -> Proposal:
        """Trees under the roots (int64[P] KV positions of each drafting request's last token)."""
        block_rows = inp.block_rows[rows]

        def feed(req, slots, depths, masks, tokens, _hidden):
            ids, counts = np.unique(req, return_counts=True)
            for p, lo, hi in zip(ids, *_slot_ranges(req, slots, len(rows))):
                if hi > lo:
                    self.records.will_write(block_rows[p], int(roots[p] + 1 + lo), int(roots[p] + 2 + hi))
            attn, positions = attention_metadata_for_tree_nodes(block_rows[ids], roots[ids], counts, slots, depths,
                                                                masks, self.block_size, self.device)
            hidden, _ = self.runner.forward(torch.from_numpy(tokens).to(self.device),
                                            torch.from_numpy(positions).to(self.device), attn)
            return self.runner.logits(hidden), None

        cap = inp.max_drafts[rows]
        # fed node slots must stay below root + lookahead (reserved) and max_model_len (cap <= len_left)
        fed_cap = np.minimum(cap, self.num_lookahead_tokens) - 1
        trees = draft_trees(self.tree, logits, None, cap, fed_cap, feed)
        return tree_proposal(np.asarray([inp.requests[r].core_id for r in rows], np.uint64), trees)

    def _draft(self, inp, rows, next_pos, logits) -> Proposal:
        """Chains of up to max_drafts per drafting request. Every draft step's rows, positions
        and attention metadata are known before the first runs (request j drafts output
        positions len(output) .. + limit[j] - 1 and feeds its drafts at KV positions next_pos[j]
        ..), so they are built at once, the forwards go back to back, and the drafted tokens stay
        device tensors until one copy at the end (no host round trip per draft position)."""
        states = [inp.requests[r] for r in rows]
        limit = inp.max_drafts[rows]
        meta = None
        if not all_greedy(states):
            # draft i decides output position len(output) + i of its request
            first_out = np.array([len(st.output_token_ids) for st in states], dtype=np.int64)
            meta = sampling_metadata(states, device=self.device, positions=first_out)
        want_probs = meta is not None and not meta.all_greedy
        steps = int(limit.max())
        actives = [np.flatnonzero(limit > i) for i in range(steps)]  # requests drafting token i
        feeds = []  # per step i < steps - 1: (which of actives[i] feed draft i, positions, metadata)
        if steps > 1 and len(actives[steps - 1]) == len(rows):  # every request drafts every step: one pass
            for attn, pos_t in attention_metadata_for_decode_steps(inp.block_rows[rows], next_pos, steps - 1,
                                                                   self.block_size, self.device):
                feeds.append((None, pos_t, attn))
        for i in range(len(feeds), steps - 1):
            nxt = actives[i + 1]
            positions = next_pos[nxt] + i
            attn, _ = attention_metadata_for_runs(inp.block_rows[rows[nxt]], positions, np.ones(len(nxt), np.int64),
                                                  self.block_size, self.device)
            keep = None if len(nxt) == len(actives[i]) else torch.from_numpy(
                np.searchsorted(actives[i], nxt)).to(self.device)
            feeds.append((keep, torch.from_numpy(positions).to(self.device), attn))
        # the draft KV these forwards write
        self.records.will_write_runs(inp.block_rows[rows], next_pos.astype(np.int64),
                                     (next_pos + limit - 1).astype(np.int64))
        tokens, probs_out = [], []
        for i in range(steps):
            tok, probs = sample_drafts(logits, meta, actives[i], i, want_probs)
            tokens.append(tok)
            probs_out.append((actives[i], probs))
            if i + 1 == steps:
                break
            keep, pos_t, attn = feeds[i]
            hidden, _ = self.runner.forward(tok if keep is None else tok[keep], pos_t, attn)
            logits = self.runner.logits(hidden)
        drafted = np.zeros((len(rows), steps), dtype=np.int64)
        flat_steps = torch.cat(tokens).cpu().numpy()  # the one copy back
        off = 0
        for i, active in enumerate(actives):
            drafted[active, i] = flat_steps[off:off + len(active)]
            off += len(active)
        counts = limit.astype(np.int32)
        cu = np.zeros(len(rows) + 1, np.int32)
        np.cumsum(counts, out=cu[1:])
        flat = np.concatenate([drafted[j, : counts[j]] for j in range(len(rows))])
        q = None
        if want_probs:
            q = gather_probs(probs_out, len(rows), counts)
        return Proposal(np.asarray([s.core_id for s in states], np.uint64), cu, flat, q)

def _slot_ranges(req, slots, n):
    """(lo int64[distinct req], hi) smallest and largest slot fed per request (req grouped, ascending)."""
    lo = np.full(n, np.iinfo(np.int64).max, np.int64)
    hi = np.full(n, -1, np.int64)
    np.minimum.at(lo, req, slots)
    np.maximum.at(hi, req, slots)
    ids = np.unique(req)
    return lo[ids], hi[ids]


def _empty() -> Proposal:
    return Proposal(np.zeros(0, np.uint64), np.zeros(1, np.int32), np.zeros(0, np.int64), None)


def draft_model_proposer(spec, ctx) -> Proposer:
    """method "draft_model": the draft shares the target's KV layout and drafts in its paged KV
    when the vocabularies are the same (DraftModelProposer); with another tokenizer it drafts text
    in an engine of its own (spec_decode/cross_vocab.py)."""
    loaded = ctx.load_model(spec.model)
    if _same_vocabulary(ctx.target, loaded):
        return DraftModelProposer(spec, ctx, loaded)
    from specinfer.spec_decode.cross_vocab import CrossVocabDraftProposer

    del loaded  # the draft's own engine loads it
    return CrossVocabDraftProposer(spec, ctx, spec.model)


def _same_vocabulary(target, draft) -> bool:
    t_tok, d_tok = target.tokenizer, draft.tokenizer
    same = t_tok.get_vocab_size(with_added_tokens=True) == d_tok.get_vocab_size(with_added_tokens=True)
    if same:
        same = t_tok.get_vocab(with_added_tokens=True) == d_tok.get_vocab(with_added_tokens=True)
    return same and target.config.vocab_size == draft.config.vocab_size


def _check_same_vocabulary(target, draft, name) -> None:
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    t_tok, d_tok = target.tokenizer, draft.tokenizer
    same = t_tok.get_vocab(with_added_tokens=True) == d_tok.get_vocab(with_added_tokens=True)
    if not same or tv != dv:
        raise ValueError(
            f"speculative.model {name!r}: the draft's vocabulary differs from the target's "
            f"(embedding rows {dv} vs {tv}; tokenizers {'match' if same else 'differ'}); "
            "a draft model must share the target's tokenizer")
