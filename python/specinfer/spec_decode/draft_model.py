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

from functools import partial

import numpy as np
import torch

from specinfer.attention.batch_metadata import (as_device, attention_metadata_for_decode_steps,
                                               attention_metadata_for_runs, attention_metadata_for_tree_nodes)
from specinfer.models.model_runner import ModelRunner
from specinfer.sample.request_rows import all_greedy, sampling_metadata
from specinfer.spec_decode.draft_sampling import gather_probs, sample_drafts
from specinfer.spec_decode.draft_kv_records import DraftKvRecords
from specinfer.spec_decode.launched_proposal import LaunchedProposal, concat_ranges
from specinfer.spec_decode.proposer import Proposal, ProposalInput, Proposer
from specinfer.spec_decode.tree_drafting import draft_trees, tree_lookahead, tree_proposal


class DraftModelProposer(Proposer):
    aux_layers = ()
    reads_target_hidden = False

    def __init__(self, spec, ctx, loaded=None):
        self.k = spec.num_speculative_tokens
        self.loaded = loaded if loaded is not None else ctx.load_model(spec.model)
        _check_same_vocabulary(ctx.target, self.loaded, spec.model)
        self.kv_models = [self.loaded.model]
        self.tree = spec.token_tree  # StaticTree | DynamicTree | None (chains)
        self.launches_proposals = self.tree is None  # (a tree's drafting loop reads its choices on the host)
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
        if self.tree is not None:
            catch_up, rows, last_rows = self._catch_up(inp)
            live = catch_up.live
            self.records.will_write_runs(inp.block_rows[live], catch_up.starts[live], catch_up.ends[live])
            hidden = self._catch_up_forward(catch_up) if catch_up.tokens is not None else None
            self._wrote(catch_up)
            if not len(rows):
                return _empty()
            logits = self.runner.logits(hidden[as_device(last_rows, self.device)])
            return self._draft_tree(inp, rows, catch_up.ends[rows] - 1, logits)
        plan = self._chain_plan(inp)
        if plan is None:
            return _empty()
        try:
            tokens, q = self._run_chains(plan)  # here: the catch-up, then the draft steps back to back
        except BaseException:
            self._undo(plan)  # (its forwards may have written part of their blocks)
            raise
        self._records_after(plan)
        if not len(plan.core_ids):
            return _empty()
        return Proposal(plan.core_ids, plan.cu, tokens.cpu().numpy(), q)  # the one copy back

    def launch_proposal(self, inp: ProposalInput, launch) -> LaunchedProposal | None:
        """propose(), with its forwards launched where the target's run (`launch(fn, forward_tokens)`
        -> PendingForward: on the executor's forward thread, or queued on CUDA's stream) and the
        drafted tokens left there: -> the proposal's shape now, its tokens once the forwards ran
        (the engine schedules and launches the step that verifies them meanwhile). None for token
        trees (their drafting loop reads each depth's choices on the host)."""
        if self.tree is not None:
            return None
        plan = self._chain_plan(inp)
        if plan is None:
            return LaunchedProposal.empty()
        try:
            pending = launch(partial(self._run_chains, plan), plan.forward_tokens)
        except BaseException:
            self._undo(plan)
            raise
        # the draft KV records follow once the forwards ran (nothing reads them before: the next
        # proposal comes after the engine settled this one)
        return LaunchedProposal(plan.core_ids, plan.cu, pending, partial(self._undo, plan),
                                partial(self._records_after, plan))

    def _records_after(self, plan) -> None:
        """The draft KV records once the proposal's forwards ran: the blocks they wrote hold no
        valid prefix any more, but for those the catch-up completed with confirmed tokens."""
        self.records.will_write_runs(*plan.writes)
        self._wrote(plan.catch_up)

    def _undo(self, plan) -> None:
        """A launched proposal whose forwards may not all have run: the blocks they write hold no
        valid prefix, and its requests' catch-up starts over."""
        self.records.will_write_runs(*plan.writes)
        self.forget([st.core_id for st in plan.catch_up.states])

    def _catch_up(self, inp: ProposalInput) -> tuple["_CatchUp", np.ndarray, np.ndarray]:
        """The catch-up forward's runs (host bookkeeping: what each request has seen, the draft KV
        records) -> (the runs, the drafting requests' rows int64[P], their last rows in the
        catch-up's hidden states int64[P])."""
        steady = self._steady_catch_up(inp)
        if steady is not None:
            return steady
        R = inp.num_requests
        num_computed, scheduled = inp.num_computed.tolist(), inp.num_scheduled.tolist()
        follow, sampled = inp.catch_up.tolist(), inp.sampled.tolist()
        starts, ends = [0] * R, [0] * R
        level = [False] * R  # caught up with every confirmed token
        tokens: list[int] = []
        num_seen = self.num_seen
        # The target's scheduled tokens plus each sampled request's new token: in steady state
        # that is exactly what the draft must see, so only a catch-up after a pause is spread.
        budget = self.max_catch_up_tokens + sum(sampled)
        for r, st in enumerate(inp.requests):
            if st.finished or not follow[r]:
                continue
            # confirmed tokens: through the new token when sampled, else the prefill chunk
            confirmed = st.num_tokens if sampled[r] else num_computed[r] + scheduled[r]
            start = num_seen.get(st.core_id)
            if start is None:  # first sight: reuse only blocks whose draft KV this draft wrote
                start = self.records.reusable_tokens(st, inp.block_rows[r], num_computed[r])
            end = min(confirmed, start + budget)
            if end > start:
                budget -= end - start
                tokens += st.tokens_slice(start, end)
            starts[r], ends[r] = start, end
            num_seen[st.core_id] = end
            level[r] = end == confirmed
        return self._catch_up_runs(inp, np.array(starts, np.int64), np.array(ends, np.int64),
                                   np.array(tokens, dtype=np.int64), np.array(level))

    def _steady_catch_up(self, inp: ProposalInput):
        """_catch_up where every request that follows got tokens this step and had seen every
        token before them (the steady state): its catch-up is exactly this step's tokens, read from
        the emitted ones, array at a time. None where some request is otherwise (a prefill chunk,
        a first sight, a catch-up after a pause)."""
        if inp.emitted is None:
            return None
        follow = inp.catch_up
        if (follow & ~inp.sampled).any():
            return None
        flat, cu = inp.emitted
        n_new = np.diff(cu).astype(np.int64)
        num_seen = self.num_seen
        f = np.flatnonzero(follow)
        states = [inp.requests[r] for r in f.tolist()]
        seen = np.array([num_seen.get(st.core_id, -1) for st in states], np.int64)
        confirmed = np.array([st.num_tokens for st in states], np.int64)
        n = n_new[f]
        if (seen < 0).any() or (seen + n != confirmed).any() or int(n.sum()) > self.max_catch_up_tokens + len(f):
            return None
        for st, end in zip(states, confirmed.tolist()):
            num_seen[st.core_id] = end
        R = inp.num_requests
        starts, ends = np.zeros(R, np.int64), np.zeros(R, np.int64)
        starts[f], ends[f] = seen, confirmed
        tokens = flat if len(f) == R else flat[concat_ranges(cu[:-1][f], n)]
        level = np.zeros(R, dtype=bool)
        level[f] = True
        return self._catch_up_runs(inp, starts, ends, tokens, level)

    def _catch_up_runs(self, inp, starts, ends, tokens, level):
        live = np.flatnonzero(ends > starts)
        run = _CatchUp(live, starts, ends)
        if len(live):
            run.tokens = as_device(np.ascontiguousarray(tokens, dtype=np.int64), self.device)
            run.block_rows = inp.block_rows[live]
            run.states = [inp.requests[r] for r in live.tolist()]
            run.records = (run.states, run.block_rows, starts[live], ends[live])
        # a request drafts when it is level and its last confirmed token went through this forward
        ran = np.zeros(len(starts), dtype=bool)
        ran[live] = True
        rows = np.flatnonzero(level & ran & (inp.max_drafts > 0))
        last_row_of = np.cumsum(ends[live] - starts[live]) - 1  # per live request
        last_rows = last_row_of[np.searchsorted(live, rows)] if len(rows) else np.zeros(0, np.int64)
        return run, rows, last_rows.astype(np.int64)

    def _catch_up_forward(self, run: "_CatchUp") -> torch.Tensor:
        """The catch-up's forward (its metadata built here: where a proposal is launched, that is
        where the forwards run)."""
        live = run.live
        attn, positions = attention_metadata_for_runs(run.block_rows, run.starts[live], run.ends[live] - run.starts[live],
                                                      self.block_size, self.device)
        return self.runner.forward(run.tokens, as_device(positions, self.device), attn)[0]

    def _wrote(self, run: "_CatchUp") -> None:
        """The draft KV records of the blocks the catch-up completed."""
        if run.records is not None:
            self.records.wrote_confirmed_runs(*run.records)
            run.records = None

    def _chain_plan(self, inp: ProposalInput) -> "_ChainPlan | None":
        """The host's part of the chains (request j drafts output positions len(output) .. +
        limit[j] - 1 and feeds its drafts at KV positions next_pos[j] ..): the catch-up's inputs,
        which requests draft which steps, the draft KV records, the proposal's shape; the draft
        steps' inputs are built by the job itself (_feeds). None: nothing to run (no request
        catches up or drafts)."""
        catch_up, rows, last_rows = self._catch_up(inp)
        if catch_up.tokens is None:
            return None
        next_pos = catch_up.ends[rows]  # (a drafting request caught up: rows are live)
        states = [inp.requests[r] for r in rows]
        limit = inp.max_drafts[rows]
        meta = None
        if not all_greedy(states):
            # draft i decides output position len(output) + i of its request
            first_out = np.array([len(st.output_token_ids) for st in states], dtype=np.int64)
            meta = sampling_metadata(states, device=self.device, positions=first_out)
        plan = _ChainPlan(catch_up, as_device(last_rows, self.device), meta,
                          meta is not None and not meta.all_greedy)
        steps = int(limit.max(initial=0))
        plan.actives = [np.flatnonzero(limit > i) for i in range(steps)]  # requests drafting token i
        plan.draft_rows = (inp.block_rows[rows], next_pos)  # what _feeds builds the draft steps' inputs from
        # the draft KV these forwards write: the catch-up's runs, and a drafting request's run on
        # through its fed drafts (one pass over the records)
        live = catch_up.live
        ends = catch_up.ends.copy()
        ends[rows] += limit - 1
        plan.writes = (inp.block_rows[live], catch_up.starts[live], ends[live])
        plan.counts = limit.astype(np.int32)
        plan.cu = np.zeros(len(rows) + 1, np.int32)
        np.cumsum(plan.counts, out=plan.cu[1:])
        plan.core_ids = np.asarray([s.core_id for s in states], np.uint64)
        plan.forward_tokens = [len(catch_up.tokens)] + [len(a) for a in plan.actives[1:]]
        return plan

    def _feeds(self, plan: "_ChainPlan") -> tuple[list, torch.Tensor]:
        """The draft steps' inputs, built where the forwards run (they are the device's part of the
        proposal: on the forward thread, off the engine's critical path): per draft step but the
        last, (which of actives[i] feed it, positions, attention metadata); and where the drafted
        tokens, coming out step after step, go in request order (request j's draft i is at off[i] +
        its rank among the requests drafting step i)."""
        block_rows, next_pos = plan.draft_rows
        steps, actives, feeds = len(plan.actives), plan.actives, []
        if steps > 1 and len(actives[steps - 1]) == len(actives[0]):  # every request drafts every step: one pass
            for attn, pos_t in attention_metadata_for_decode_steps(block_rows, next_pos, steps - 1, self.block_size,
                                                                   self.device):
                feeds.append((None, pos_t, attn))
        for i in range(len(feeds), steps - 1):
            nxt = actives[i + 1]
            positions = next_pos[nxt] + i
            attn, _ = attention_metadata_for_runs(block_rows[nxt], positions, np.ones(len(nxt), np.int64),
                                                  self.block_size, self.device)
            keep = None if len(nxt) == len(actives[i]) else as_device(np.searchsorted(actives[i], nxt), self.device)
            feeds.append((keep, as_device(positions, self.device), attn))
        drafting = np.arange(steps)[None, :] < plan.counts[:, None]  # [P, steps]
        off = np.concatenate([[0], np.cumsum(drafting.sum(0))])[:-1]
        rank = np.cumsum(drafting, axis=0) - 1
        return feeds, as_device((off[None, :] + rank)[drafting], self.device)

    def _run_chains(self, plan: "_ChainPlan"):
        """The catch-up forward, then the draft steps back to back (no host round trip per draft
        position) -> (int64[N] the drafted tokens, request after request, as a device tensor; per
        request q Tensor[k_j, V] or None when every draft is deterministic)."""
        hidden = self._catch_up_forward(plan.catch_up)
        steps = len(plan.actives)
        if steps == 0:  # (a catch-up alone: prefill chunks)
            return torch.zeros(0, dtype=torch.int64, device=hidden.device), None
        logits = self.runner.logits(hidden[plan.last_rows])
        feeds, order = self._feeds(plan)  # (beside the catch-up, where the device computes asynchronously)
        tokens, probs_out = [], []
        for i in range(steps):
            tok, probs = sample_drafts(logits, plan.meta, plan.actives[i], i, plan.want_probs)
            tokens.append(tok)
            probs_out.append((plan.actives[i], probs))
            if i + 1 == steps:
                break
            keep, pos_t, attn = feeds[i]
            hidden, _ = self.runner.forward(tok if keep is None else tok[keep], pos_t, attn)
            logits = self.runner.logits(hidden)
        q = gather_probs(probs_out, len(plan.counts), plan.counts) if plan.want_probs else None
        return torch.cat(tokens)[order], q

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
            hidden, _ = self.runner.forward(as_device(tokens, self.device), as_device(positions, self.device), attn)
            return self.runner.logits(hidden), None

        cap = inp.max_drafts[rows]
        # fed node slots must stay below root + lookahead (reserved) and max_model_len (cap <= len_left)
        fed_cap = np.minimum(cap, self.num_lookahead_tokens) - 1
        trees = draft_trees(self.tree, logits, None, cap, fed_cap, feed)
        return tree_proposal(np.asarray([inp.requests[r].core_id for r in rows], np.uint64), trees)

def _slot_ranges(req, slots, n):
    """(lo int64[distinct req], hi) smallest and largest slot fed per request (req grouped, ascending)."""
    lo = np.full(n, np.iinfo(np.int64).max, np.int64)
    hi = np.full(n, -1, np.int64)
    np.minimum.at(lo, req, slots)
    np.maximum.at(hi, req, slots)
    ids = np.unique(req)
    return lo[ids], hi[ids]


class _CatchUp:
    """The catch-up forward's runs: requests `live` (int64) feed positions starts[r] .. ends[r]."""

    def __init__(self, live, starts, ends):
        self.live, self.starts, self.ends = live, starts, ends
        self.tokens = None  # int64[T] the tokens fed, where some request catches up
        self.block_rows = None  # int32[len(live), W]
        self.records = None  # wrote_confirmed_runs' arguments, once the forward ran
        self.states: list = []  # of the live requests


class _ChainPlan:
    """The host's part of a chain proposal (DraftModelProposer._chain_plan), for _run_chains."""

    def __init__(self, catch_up, last_rows, meta, want_probs: bool):
        self.catch_up, self.last_rows, self.meta, self.want_probs = catch_up, last_rows, meta, want_probs
        self.actives: list = []  # per draft step: the drafting requests (rows of the proposal) int64
        self.draft_rows = None  # (block rows int32[P, W], next KV position int64[P]) of the drafting requests
        self.writes = None  # (block rows, starts, ends): the draft KV runs the forwards write
        self.counts = self.cu = self.core_ids = None
        self.forward_tokens: list = []


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
