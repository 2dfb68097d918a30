"""The last part of an engine step: spend the verified proposals, decide each request's draft
budget for the next step, run the proposer, and hand its proposals (chains or trees) to the core."""
from __future__ import annotations

import numpy as np

from specinfer.engine.tree_steps import chain_rows, reorder_rows
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


def draft_budgets(engine, states) -> np.ndarray:
    """int64[R] the most drafts (chain length, or tree nodes) each request may get next step."""
    spec = engine.spec
    # a tree's budget is in nodes (and, for a dynamic tree drafted into the proposer's own KV, its
    # scratch slots: the proposer's lookahead, when it keeps a KV)
    slots = spec.num_speculative_tokens
    if spec.token_tree is not None:
        slots = max(spec.num_draft_slots, engine.proposer.num_lookahead_tokens)
    k = engine.platform.speculation_length(slots, len(states), spec.scorer)
    num_out = np.fromiter((len(st.output_token_ids) for st in states), np.int64, len(states))
    num_prompt = np.fromiter((len(st.prompt_token_ids) for st in states), np.int64, len(states))
    max_tokens = np.fromiter((st.params.max_tokens for st in states), np.int64, len(states))
    out_left = max_tokens - num_out - 1
    len_left = engine.max_model_len - (num_prompt + num_out) - 1
    return np.clip(np.minimum(out_left, len_left), 0, k)


def whole_batch_tokens_left(engine, states, alive) -> np.ndarray | None:
    """int64[R] the most tokens each request may still emit, when the run ends with its last
    request: every request was added by a caller that waits for its whole batch
    (Generator.generate) and none waits for a slot; else None (a finished request's slot is
    refilled, so every request's progress counts)."""
    if engine.core.num_waiting() or engine.core.num_running() != int(alive.sum()):
        return None
    if not all(st.whole_batch for st in states):
        return None
    return np.array([0 if st.finished else max(0, min(st.params.max_tokens - len(st.output_token_ids),
                                                      engine.max_model_len - st.num_tokens))
                     for st in states], dtype=np.int64)


def propose_next_step(engine, sched, states, emitted, hidden) -> None:
    R = len(states)
    kept = spend_verified_drafts(engine._draft_probs, states, emitted)
    alive = np.array([not st.finished for st in states])
    sampled = (np.diff(emitted.cu_num_emitted) > 0) & alive
    spec = engine.spec
    disabled = (spec.disable_by_batch_size is not None
                and engine.core.num_running() >= spec.disable_by_batch_size)
    # a seeded request's tokens must not depend on the load: it is never disabled
    wants = np.array([st.params.speculate and (not disabled or st.params.seed is not None)
                      for st in states], dtype=bool)
    # EAGLE's draft KV takes in every step's target states (they exist only now), drafting or not
    sees_every_step = engine.proposer.sees_every_step
    if not wants.any() and not sees_every_step:
        return
    max_drafts = draft_budgets(engine, states)
    speculate = sampled & wants & ~kept & (max_drafts > 0)
    if engine.policy is not None:  # unseeded requests: drafts chosen for goodput (seeded keep k)
        free = np.flatnonzero(speculate & np.array([st.params.seed is None for st in states], dtype=bool))
        left = whole_batch_tokens_left(engine, states, alive)
        horizon = 0.0
        if left is not None:
            others = np.ones(R, dtype=bool)
            others[free] = False
            horizon = float(left[others].max()) if others.any() else 0.0
        chosen = engine.policy.num_drafts([states[r].core_id for r in free], max_drafts[free], int(alive.sum()),
                                          None if left is None else left[free], horizon)
        max_drafts[free] = chosen
        speculate &= max_drafts > 0
    num_scheduled = np.asarray(sched.num_scheduled_tokens, np.int64)
    num_rows = emitted.num_rows.astype(np.int64)
    # a verified tree is shown to the proposer as the chain it accepted (root, path, the rest)
    start = np.zeros(R + 1, np.int64)
    np.cumsum(num_scheduled, out=start[1:])
    order = chain_rows(start, num_scheduled, num_rows, getattr(emitted, "tree_paths", None))
    target = TargetHidden(reorder_rows(hidden, order), reorder_rows(engine.runner.last_aux, order))
    inp = ProposalInput(
        states, np.asarray(sched.num_computed_tokens, np.int64), num_scheduled,
        emitted.num_draft_tokens.astype(np.int64), emitted.num_accepted.astype(np.int64),
        num_rows, sampled, np.where(speculate, max_drafts, 0),
        alive if sees_every_step else wants & alive, request_block_rows(sched), target)
    prop = engine.proposer.propose(inp)
    engine._num_drafted = len(prop.draft_token_ids)
    if len(prop.core_ids) == 0:
        return
    if prop.draft_parents is not None:
        engine.core.set_draft_tokens(prop.core_ids, prop.cu_num_draft, prop.draft_token_ids,
                                     np.asarray(prop.draft_parents, np.int32))
    else:
        engine.core.set_draft_tokens(prop.core_ids, prop.cu_num_draft, prop.draft_token_ids)
    if prop.draft_probs is not None:
        for cid, q in zip(prop.core_ids.tolist(), prop.draft_probs):
            if q is not None:
                engine._draft_probs[cid] = q
    if prop.draft_parents is not None:  # tree drafts without q are deterministic (top-k children)
        for j, cid in enumerate(prop.core_ids.tolist()):
            if prop.draft_probs is None or prop.draft_probs[j] is None:
                engine._draft_probs[cid] = DETERMINISTIC


def request_block_rows(sched) -> np.ndarray:
    """int32[R, W]: each request's block-table row (its first query sequence's row)."""
    seq_req = np.asarray(sched.seq_req_indices)
    first = np.searchsorted(seq_req, np.arange(len(sched.req_ids)))
    return np.asarray(sched.block_table)[first]
