"""The proposing side of an engine step (StepProposing): spend the verified proposals, decide each
request's draft budget for the next step, run the proposer, and hand its proposals (chains or
trees) to the core. The engine holds one StepProposing when it speculates and calls it; the
object owns the proposer, the policy and the pending proposals' draft probabilities."""
from __future__ import annotations

import numpy as np


from specinfer.engine.tree_steps import chain_rows, reorder_rows
from specinfer.spec_decode.ngram_first import merge
from specinfer.spec_decode.proposer import DETERMINISTIC, ProposalInput, TargetHidden


def spend_verified_drafts(draft_probs: dict, states, emitted) -> np.ndarray:
    """Drop the draft probabilities of proposals verified this step; a split proposal whose
    verified drafts were all accepted keeps the rest (the core kept its tokens).
    Returns bool[R]: the request still has a pending proposal."""
    d = emitted.num_draft_tokens
    kept = (emitted.num_rows == d) & (d > 0) & (emitted.num_accepted == d)
    if not draft_probs:
        return kept  # model-free drafts (n-gram) keep no probabilities
    for r, st in enumerate(states):
        if emitted.num_rows[r] == 0:
            continue  # a prefill chunk verified nothing; a kept proposal waits
        q = draft_probs.pop(st.core_id, None)
        if kept[r] and q is not None:
            draft_probs[st.core_id] = q[int(d[r]):]
    return kept


def draft_length(spec, proposer, platform, num_requests: int) -> int:
    """The most drafts (chain length, or tree nodes) any request may get next step."""
    # a tree's budget is in nodes (and, for a dynamic tree drafted into the proposer's own KV, its
    # scratch slots: the proposer's lookahead, when it keeps a KV)
    slots = spec.num_speculative_tokens
    if spec.token_tree is not None:
        slots = max(spec.num_draft_slots, proposer.num_lookahead_tokens)
    return platform.speculation_length(slots, num_requests, spec.scorer)


def request_flags(states, paused: bool, max_model_len: int) -> np.ndarray:
    """int64[R, 5], one pass over the states (this runs every step): alive, wants drafts (a seeded
    request's tokens must not depend on the load: it is never paused), unseeded, constrained, and
    the tokens it may still emit past the next one (max_tokens and max_model_len)."""
    rows = [(not st.finished, st.params.speculate and (not paused or st.params.seed is not None),
             st.params.seed is None, st.grammar is not None,
             min(st.params.max_tokens - len(st.output_token_ids),
                 max_model_len - len(st.prompt_token_ids) - len(st.output_token_ids)) - 1)
            for st in states]
    return np.array(rows, dtype=np.int64).reshape(len(states), 5)


def whole_batch_tokens_left(core, max_model_len: int, states, alive) -> np.ndarray | None:
    """int64[R] the most tokens each request may still emit, when the run ends with its last
    request: every request was added by a caller that waits for its whole batch
    (Generator.generate) and none waits for a slot; else None (a finished request's slot is
    refilled, so every request's progress counts)."""
    if core.num_waiting() or core.num_running() != int(alive.sum()):
        return None
    if not all(st.whole_batch for st in states):
        return None
    return np.array([0 if st.finished else max(0, min(st.params.max_tokens - len(st.output_token_ids),
                                                      max_model_len - st.num_tokens))
                     for st in states], dtype=np.int64)


class StepProposing:
    """The proposing side of the step, as one object owning its state: the proposer, the
    speculation policy (and `disable_by_batch_size`, one of its inputs), the draft probabilities
    q of each request's pending proposal (read by the verifier), and how many drafts the last
    step proposed (for the policy's step-cost fit)."""

    def __init__(self, spec, proposer, policy, *, get_core, platform, max_model_len: int, target_runner):
        self.spec, self.proposer, self.policy = spec, proposer, policy
        self.get_core = get_core  # -> the engine's Rust core (read at each use: the engine's is the one)
        self.platform, self.max_model_len = platform, max_model_len
        self.target_runner = target_runner  # its last_aux: the aux-layer states of the forward that ran
        self.draft_probs: dict = {}  # core id -> q of its pending proposal (DETERMINISTIC: one-hot)
        self.num_drafted = 0
        self.forced_ids: set = set()  # core ids whose pending proposal is grammar-forced tokens
        self.num_forced_drafts = 0  # grammar-forced tokens proposed, in all
        # the policy's choice for the next proposal, made beside the forward (plan()): int64[R] per
        # request of the step, or None (then the choice is made after the step, on the general path)
        self.budgets: np.ndarray | None = None
        self._budget_states = None  # the states plan() chose for
        # prepare_core_proposal(), beside the forward: the step's states, whether every one of them
        # speculates unconstrained, and the platform's k for their batch
        self._core_states = None
        self._core_ok = False
        self._all_plain = False  # every request of _core_states speculates unconstrained
        self._core_k = 0
        # where set (the overlapped loop, one process): launch(fn, forward_tokens) -> PendingForward,
        # the executor's launch_job; a proposer that can (a draft model's chains) then launches its
        # forwards there and the next step is scheduled before its tokens exist (launch_proposal)
        self.launch_job = None
        self._prepared = None  # (states, block rows, flags before the step's tokens): prepare_proposal
        self.history_readers: set = set()  # the engine's ids of requests with penalties, grammars, min_tokens
        self.launched = None  # the LaunchedProposal whose tokens the core does not hold yet
        self.num_launched = 0  # proposals with drafts launched so far
        self._forgotten: set = set()  # core ids forgotten while a proposal was launched

    @property
    def plans_beside_forward(self) -> bool:
        """A policy chooses the drafts of a proposer that drafts in the core (n-gram) or launches
        its proposals (a draft model's chains): the choice is made beside the forward from the
        acceptance estimates one verification old (plan()), the verification is observed with the
        output work, and the proposal is made within the budgets — the policy's work is off the
        critical path."""
        return self.policy is not None and (self.proposer.drafts_in_core or (
            self.launch_job is not None and self.proposer.launches_proposals))

    def speculation_paused(self) -> bool:
        """disable_by_batch_size: no drafts for unseeded requests while this many run."""
        limit = self.spec.disable_by_batch_size
        return limit is not None and self.get_core().num_running() >= limit

    def _core_proposes(self, states, budgets=None) -> bool:
        """The step's proposal is the core's own (propose_in_core): a proposer that drafts there,
        and nothing else shaping the budgets — no policy (or its choice made beside the forward:
        `budgets`, plan()), no pause, every request speculating and unconstrained. It is given the requests that got tokens this step (the general
        path's `sampled`; finished ones have left the core) and, as the general path does, skips
        those holding a split proposal's kept rest and clips to each budget."""
        return (self._unconstrained(states) and (self.policy is None or budgets is not None)
                and not self.speculation_paused())

    def prepare_core_proposal(self, states) -> None:
        """Beside the forward of a step: what the core's own proposal after it reads of the step's
        states, ahead of the critical path (propose_in_core runs right after update())."""
        self._core_states = states
        self._all_plain = all(st.params.speculate and st.grammar is None for st in states)
        self._core_ok = self.proposer.drafts_in_core and self._all_plain
        self._core_k = draft_length(self.spec, self.proposer, self.platform, len(states))

    def prepare_proposal(self, sched, states) -> None:
        """Beside the forward of a step whose proposal is launched (launch_job): what the general
        path reads of the step, as of now — each request's block-table row, and its flags, which
        propose() then corrects by the step's tokens (ended requests, tokens left) — off the
        critical path. Not where a pause (disable_by_batch_size) may change with the update."""
        self._prepared = None
        if self.launch_job is not None and self.spec.disable_by_batch_size is None and not self.proposer.drafts_in_core:
            self._prepared = (states, request_block_rows(sched), request_flags(states, False, self.max_model_len))

    def _requests_now(self, sched, states, emitted) -> tuple[np.ndarray, np.ndarray]:
        """(request_flags, request_block_rows) of the step's requests once the states took its
        tokens: those prepare_proposal made beside the forward, corrected by them, where made."""
        prepared, self._prepared = self._prepared, None
        if prepared is None or prepared[0] is not states:
            return request_flags(states, self.speculation_paused(), self.max_model_len), request_block_rows(sched)
        _, block_rows, flags = prepared
        flags[:, 0] = np.fromiter((not st.finished for st in states), np.int64, len(states))
        flags[:, 4] -= np.diff(emitted.cu_num_emitted)
        return flags, block_rows

    def _unconstrained(self, states) -> bool:
        """A proposer that drafts in the core, and every request speculates unconstrained."""
        if states is self._core_states:
            return self._core_ok
        return self.proposer.drafts_in_core and all(st.params.speculate and st.grammar is None for st in states)

    def plan(self, sched, states) -> None:
        """Beside the forward of a step (plans_beside_forward): each request that samples in it gets
        its draft budget for the next proposal — the policy's choice for unseeded requests (from the
        estimates through the last verification observed), min(k, what it may still emit) for seeded
        ones — as if it emits one token now (the core clips each budget to what is left)."""
        self.budgets = None
        if not self.plans_beside_forward or self.speculation_paused():
            return  # the general path decides after the step
        plain = self._all_plain if states is self._core_states else all(
            st.params.speculate and st.grammar is None for st in states)
        if not plain:
            return
        flags = request_flags(states, False, self.max_model_len)
        alive, unseeded = flags[:, 0].astype(bool), flags[:, 2].astype(bool)
        cu = np.asarray(sched.cu_num_logits)
        samples = (cu[1:] > cu[:-1]) & alive
        k = self._core_k if states is self._core_states else draft_length(self.spec, self.proposer, self.platform,
                                                                          len(states))
        max_drafts = np.minimum(np.maximum(flags[:, 4] - 1, 0), k)  # after this step's token
        speculate = samples & (max_drafts > 0)
        budgets = np.where(speculate, max_drafts, 0)
        free = np.flatnonzero(speculate & unseeded)
        if len(free):
            left = whole_batch_tokens_left(self.get_core(), self.max_model_len, states, alive)
            horizon = 0.0
            if left is not None:
                left = np.maximum(left - samples, 0)  # this step's token
                others = np.ones(len(states), dtype=bool)
                others[free] = False
                horizon = float(left[others].max()) if others.any() else 0.0
            budgets[free] = self.policy.num_drafts([states[r].core_id for r in free], max_drafts[free],
                                                   int(alive.sum()), None if left is None else left[free], horizon)
        self.budgets = budgets
        self._budget_states = states

    def observe_verification(self, states, emitted) -> None:
        if self.policy is not None:
            d = emitted.num_draft_tokens
            if self.forced_ids:  # forced drafts say nothing of the proposer's acceptance
                d = d * np.array([st.core_id not in self.forced_ids for st in states], dtype=d.dtype)
            self.policy.observe_verification([st.core_id for st in states], d, emitted.num_accepted)

    def prepare(self, num_requests: int) -> None:
        """Beside the forward of a step of num_requests requests: what the next proposal's choice
        reads, built ahead (the policy's step-cost tables, changed by the last step's record, and
        its cost curve for that batch)."""
        if self.policy is not None:
            k = draft_length(self.spec, self.proposer, self.platform, num_requests)
            self.policy.prepare(num_requests, num_requests * k)

    def observe_step(self, num_tokens: int, step_s: float, propose_s: float) -> None:
        if self.policy is not None:
            self.policy.observe_step(num_tokens, step_s, self.num_drafted, propose_s)

    @staticmethod
    def _state_of(states) -> dict:
        return {st.core_id: st for st in states}

    def forget(self, core_ids) -> None:
        """Requests that finished or were aborted: drop their proposal state."""
        for cid in core_ids:
            self.draft_probs.pop(cid, None)
        if self.launched is not None:
            self._forgotten.update(core_ids)
        if self.policy is not None:
            self.policy.forget(core_ids)
        self.proposer.forget(core_ids)

    def propose_in_core(self, sched, states, emitted) -> bool:
        """The step's proposal where the core makes it alone (_core_proposes: it needs nothing of the
        Python states' tokens, so it may run right after update(), before they take them) -> True;
        False (nothing done) where the general path (propose) must."""
        budgets = self.budgets
        if not self._core_proposes(states, budgets):
            return False
        self.num_drafted = 0
        self.budgets = None
        self.forced_ids = set()
        cu = emitted.cu_num_emitted
        got = cu[1:] > cu[:-1]  # the requests that got tokens this step
        k = self._core_k if states is self._core_states else draft_length(  # (a platform may cap it)
            self.spec, self.proposer, self.platform, len(states))
        self.num_drafted = self.proposer.propose_in_core(sched.req_ids[got], k,
                                                         None if budgets is None else budgets[got])
        return True

    def propose(self, sched, states, emitted, hidden) -> None:
        """Spend the verified proposals, decide each request's budget, run the proposer and hand
        its proposals (chains or trees) to the core."""
        if self.propose_in_core(sched, states, emitted):
            return
        self.num_drafted = 0
        planned = self.budgets if self._budget_states is states else None  # (plan(): beside the forward)
        self.budgets = self._budget_states = None
        R = len(states)
        kept = spend_verified_drafts(self.draft_probs, states, emitted)
        flags, block_rows = self._requests_now(sched, states, emitted)
        alive, wants, unseeded, constrained = (flags[:, j].astype(bool) for j in range(4))
        cu = emitted.cu_num_emitted
        sampled = (cu[1:] > cu[:-1]) & alive
        # EAGLE's draft KV takes in every step's target states (they exist only now), drafting or not
        sees_every_step = self.proposer.sees_every_step
        if not wants.any() and not sees_every_step:
            return
        k = draft_length(self.spec, self.proposer, self.platform, R)
        max_drafts = np.minimum(np.maximum(flags[:, 4], 0), k)
        speculate = sampled & wants & ~kept & (max_drafts > 0)
        # grammar-forced tokens are the drafts of a constrained request wherever there are some:
        # certain to be accepted, whatever the policy would give the proposer
        any_grammar = bool(constrained.any())
        forced = forced_drafts(states, np.where(speculate, max_drafts, 0)) if any_grammar else {}
        self.forced_ids = {states[r].core_id for r in forced}
        if forced:
            self.num_forced_drafts += sum(len(t) for t in forced.values())
            max_drafts[list(forced)] = 0
            speculate &= max_drafts > 0
        if self.policy is not None and planned is not None:  # its choice, made beside the forward
            free = np.flatnonzero(speculate & unseeded)
            max_drafts[free] = np.minimum(max_drafts[free], planned[free])
            speculate &= max_drafts > 0
        elif self.policy is not None:  # unseeded requests: drafts chosen for goodput (seeded keep k)
            free = np.flatnonzero(speculate & unseeded)
            left = whole_batch_tokens_left(self.get_core(), self.max_model_len, states, alive)
            horizon = 0.0
            if left is not None:
                others = np.ones(R, dtype=bool)
                others[free] = False
                horizon = float(left[others].max()) if others.any() else 0.0
            chosen = self.policy.num_drafts([states[r].core_id for r in free], max_drafts[free], int(alive.sum()),
                                            None if left is None else left[free], horizon)
            max_drafts[free] = chosen
            speculate &= max_drafts > 0
        num_scheduled = np.asarray(sched.num_scheduled_tokens, np.int64)
        num_rows = emitted.num_rows.astype(np.int64)
        target = None
        if self.proposer.reads_target_hidden:
            # a verified tree is shown to the proposer as the chain it accepted (root, path, the rest)
            start = np.zeros(R + 1, np.int64)
            np.cumsum(num_scheduled, out=start[1:])
            order = chain_rows(start, num_scheduled, num_rows, getattr(emitted, "tree_paths", None))
            target = TargetHidden(reorder_rows(hidden, order), reorder_rows(self.target_runner.last_aux, order))
        inp = ProposalInput(
            states, np.asarray(sched.num_computed_tokens, np.int64), num_scheduled,
            emitted.num_draft_tokens.astype(np.int64), emitted.num_accepted.astype(np.int64),
            num_rows, sampled, np.where(speculate, max_drafts, 0),
            alive if sees_every_step else wants & alive, block_rows, target,
            (emitted.token_ids, emitted.cu_num_emitted))
        readers = self.history_readers  # (a penalized request's verification reads its drafts on the host)
        if (self.launch_job is not None and not any_grammar and not forced
                and not (readers and any(st.core_id in readers and st.params.penalized for st in states))):
            launched = self.proposer.launch_proposal(inp, self.launch_job)
            if launched is not None:
                self._placeholders(launched)
                return
        prop = self.proposer.propose(inp)
        if any_grammar:
            prop = grammar_valid_prefixes(prop, self._state_of(states))
        if forced:
            prop = merge(inp, forced, prop)
        self.num_drafted = len(prop.draft_token_ids)
        if len(prop.core_ids) == 0:
            return
        core = self.get_core()
        if prop.draft_parents is not None:
            core.set_draft_tokens(prop.core_ids, prop.cu_num_draft, prop.draft_token_ids,
                                  np.asarray(prop.draft_parents, np.int32))
        else:
            core.set_draft_tokens(prop.core_ids, prop.cu_num_draft, prop.draft_token_ids)
        if prop.draft_probs is not None:
            for cid, q in zip(prop.core_ids.tolist(), prop.draft_probs):
                if q is not None:
                    self.draft_probs[cid] = q
        if prop.draft_parents is not None:  # tree drafts without q are deterministic (top-k children)
            for j, cid in enumerate(prop.core_ids.tolist()):
                if prop.draft_probs is None or prop.draft_probs[j] is None:
                    self.draft_probs[cid] = DETERMINISTIC


    # ------------------------------------------------------------------ launched proposals
    def _placeholders(self, launched) -> None:
        """The core stores placeholders of the launched proposal's shape (the step that verifies it
        is scheduled and packed with them; the device fills them: engine/launched_drafts.py)."""
        self.num_drafted = launched.num_drafts
        if launched.pending is None:
            return  # (nothing ran)
        self.launched = launched
        self._forgotten = set()
        if len(launched.core_ids):
            self.num_launched += 1
            self.get_core().set_draft_tokens(launched.core_ids, launched.cu_num_draft,
                                             np.zeros(launched.num_drafts, np.int64))

    def settle_launched(self) -> None:
        """Wait for the launched proposal's tokens (the forwards ran, or their step's forward is
        already queued behind them): the core takes them in place of the placeholders, before the
        update of the step verifying them; their q joins the pending proposals'. A failure of the
        forwards is raised here, the proposal still held (discard_launched undoes it)."""
        launched = self.launched
        if launched is None:
            return
        tokens, q = launched.wait()
        launched.settled()
        if len(launched.core_ids):
            self.get_core().replace_draft_tokens(launched.core_ids, launched.cu_num_draft, tokens)
            if q is not None:
                for cid, qj in zip(launched.core_ids.tolist(), q):
                    if qj is not None and cid not in self._forgotten:
                        self.draft_probs[cid] = qj
        self.launched = None
        self._forgotten = set()

    def discard_launched(self) -> None:
        """A step failed before the launched proposal settled: its forwards end, the proposer forgets
        what they wrote, and the requests lose the placeholders (no step is pending in the core: it
        was cancelled), so a retry decodes them plainly and proposes afresh."""
        launched, self.launched = self.launched, None
        if launched is None:
            return
        launched.discard()
        if len(launched.core_ids):
            self.get_core().set_draft_tokens(launched.core_ids, np.zeros(len(launched.core_ids) + 1, np.int32),
                                             np.zeros(0, np.int64))


def forced_drafts(states, budget: np.ndarray) -> dict:
    """Batch row -> the tokens its grammar forces next (at most its budget), for the constrained
    requests that have some."""
    out = {}
    for r, st in enumerate(states):
        g = st.grammar
        if g is not None and budget[r] > 0 and not st.finished:
            toks = g.forced(int(budget[r]))
            if toks:
                out[r] = np.asarray(toks, dtype=np.int64)
    return out


def grammar_valid_prefixes(prop, state_of: dict):
    """A constrained request's chain is cut before its first draft the grammar refuses (that
    draft would be rejected for certain, and the rows after it verify nothing), where that keeps
    the law: greedy requests, and deterministic drafts (q one-hot: the rejection's residual is
    then the masked target itself, what the cut's bonus row samples). Drafts sampled from a q
    are never cut: whether a row is verified may not depend on the drafted value (the residual
    max(0, p - q) is not p). Trees are kept (their refused nodes are rejected by the masks)."""
    if prop.draft_parents is not None or len(prop.core_ids) == 0:
        return prop
    cu = prop.cu_num_draft
    keep = np.ones(len(prop.draft_token_ids), dtype=bool)
    for j, cid in enumerate(prop.core_ids.tolist()):
        st = state_of.get(cid)
        a, b = int(cu[j]), int(cu[j + 1])
        if st is None or st.grammar is None or b == a or st.grammar.error is not None:
            continue
        q = prop.draft_probs[j] if prop.draft_probs is not None else None
        if q is not None and hasattr(q, "shape") and st.params.temperature != 0.0:
            continue
        n = st.grammar.matcher.validate_tokens(prop.draft_token_ids[a:b].tolist())
        keep[a + n:b] = False
    if keep.all():
        return prop
    counts = np.array([int(keep[cu[j]:cu[j + 1]].sum()) for j in range(len(cu) - 1)], dtype=np.int32)
    new_cu = np.zeros(len(cu), np.int32)
    np.cumsum(counts, out=new_cu[1:])
    probs = None
    if prop.draft_probs is not None:
        probs = [q if q is None or not hasattr(q, "shape") else q[:int(c)] for q, c in zip(prop.draft_probs, counts)]
    return type(prop)(prop.core_ids, new_cu, prop.draft_token_ids[keep], probs, None)


def request_block_rows(sched) -> np.ndarray:
    """int32[R, W]: each request's block-table row (its first query sequence's row)."""
    seq_req = np.asarray(sched.seq_req_indices)
    first = np.searchsorted(seq_req, np.arange(len(sched.req_ids)))
    return np.asarray(sched.block_table)[first]
