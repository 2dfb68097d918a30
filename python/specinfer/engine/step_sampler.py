"""Turns one step's logits into emitted tokens: plain sampling, or verification of drafts.

Rows: request r owns logits rows cu_num_logits[r] .. cu_num_logits[r+1]. A plain decode (or a
final prefill chunk) owns one row; a verification of k drafts owns 1 + k rows (one per draft
position plus the bonus row), or k rows when the token budget split its proposal (no bonus
row: the core verifies one draft past the query, scored by the last row). Emitted tokens per
request = accepted drafts + one recovered or bonus token (none after a fully accepted split).

Token trees (docs/trees.md): ``sched.draft_parents`` int32[sum num_draft_tokens] gives each
draft's parent (-1 = the root; chains are -1, 0, 1, ...). A request whose parents are not a chain
owns 1 + m rows (row 0 = root, row 1 + i = node i; never split) and is verified by
``sample.tree_verify`` (or typical acceptance over trees); its draft probabilities are q rows of
independently sampled children, or missing = deterministic top-k children (one-hot q). Chains
take the chain verifier, untouched. ``Emitted.tree_paths`` holds each tree request's accepted
node indices, so the engine can reorder hidden states and the core's copy list matches.
Logprobs always come from the target's raw logits. Randomness comes from each request's
counter-based streams (seed, output position), see specinfer.sample.random_streams.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from specinfer.sample.argmax import argmax_last
from specinfer.sample import (LogprobsTensors, RandomStreams, Sampler, SamplingMetadata, compute_logprobs,
                              probs_from_logits, rejection_sample)
from specinfer.sample.tree_layout import is_chain_request, node_depths
from specinfer.sample.tree_typical_acceptance import tree_typical_acceptance_sample
from specinfer.sample.tree_verify import tree_rejection_sample
from specinfer.sample.typical_acceptance import typical_acceptance_sample
from specinfer.request_error import RequestError
from specinfer.engine.step_penalties import penalty_rows
from specinfer.sample.penalties import apply_penalties
from specinfer.sample.metadata import RowParameterError
from specinfer.sample.request_rows import sampling_metadata
from specinfer.spec_decode.proposer import DETERMINISTIC


@dataclass
class Emitted:
    token_ids: np.ndarray  # int64[N] all emitted tokens, request after request
    cu_num_emitted: np.ndarray  # int32[R + 1] over every scheduled request (0 for prefill chunks)
    num_draft_tokens: np.ndarray  # int32[R] drafts verified per request
    num_accepted: np.ndarray  # int32[R] accepted drafts per request (a tree's: its path length)
    num_rows: np.ndarray  # int32[R] logits rows per request (a split proposal has no bonus row)
    logprobs: list  # per scheduled request: list[dict[int, float]] aligned with its tokens, or None
    # scheduled request index -> int64[num_accepted] node indices of its accepted path (tree
    # requests only; chains are absent): emitted token j + 1 came from node tree_paths[r][j]
    tree_paths: dict = field(default_factory=dict)


def stop_ids_blocked(state, eos_token_ids) -> list[int]:
    """Tokens that may not be emitted before min_tokens: EOS (unless ignored) and stop token ids."""
    ids = [] if state.params.ignore_eos else list(eos_token_ids)
    return ids + list(state.params.stop_token_ids or ())


def mask_min_tokens(logits: torch.Tensor, cu_logits, sampling, states, eos_token_ids,
                    row_offsets: dict | None = None) -> torch.Tensor:
    """logits [L, V] -> the same (or a masked copy) with stop tokens at -inf on rows whose token
    would land before the request's min_tokens (as HF's MinNewTokensLogitsProcessor does).
    Row j of request i decides output offset j, or ``row_offsets[i][j]`` (a tree: 0, then the
    depth of each node)."""
    rows, cols = [], []
    if not any(states[i].params.min_tokens for i in sampling):
        return logits  # (the common case, checked without a length per request)
    for i in sampling:
        st = states[i]
        need = st.params.min_tokens - len(st.output_token_ids)
        if need <= 0:
            continue
        blocked = stop_ids_blocked(st, eos_token_ids)
        n = int(cu_logits[i + 1] - cu_logits[i])
        offsets = row_offsets[i] if row_offsets and i in row_offsets else range(n)
        for j in range(n):
            if offsets[j] >= need:
                continue
            rows += [int(cu_logits[i]) + j] * len(blocked)
            cols += blocked
    if not rows:
        return logits
    logits = logits.clone()
    logits[torch.tensor(rows), torch.tensor(cols)] = float("-inf")
    return logits


class StepSampler:
    def __init__(self, spec, eos_token_ids=()):
        self.eos_token_ids = tuple(eos_token_ids)
        self.sampler = Sampler()
        self.disable_logprobs = bool(spec and spec.disable_logprobs)
        if spec is None or spec.acceptance_method == "rejection_sampler":
            self.verify, self.verify_tree = rejection_sample, tree_rejection_sample
        else:
            typical = dict(posterior_threshold=spec.posterior_threshold, posterior_alpha=spec.posterior_alpha)
            self.verify = partial(typical_acceptance_sample, **typical)
            self.verify_tree = partial(tree_typical_acceptance_sample, **typical)

    def __call__(self, logits: torch.Tensor, sched, states, draft_probs: dict, masks=None,
                 positions=None, draft_ids=None) -> Emitted:
        """`masks`: the grammar masks of constrained rows (engine.step_grammar.StepMasks) or None.
        `positions`: each scheduled request's next output position, given where the states may not
        hold the previous step's tokens yet (a step launched before they take them: no penalties,
        no min_tokens left, no grammar); else len(output_token_ids). `draft_ids`: the step's draft
        tokens where the core holds placeholders of a proposal drafted on the device
        (engine/launched_drafts.py; chains, no penalties, no grammar); else sched.draft_token_ids."""
        cu_logits = sched.cu_num_logits
        n_rows = np.diff(cu_logits)  # [R]
        num_draft = np.asarray(sched.num_draft_tokens, dtype=np.int32)
        sampling = np.flatnonzero(n_rows > 0)
        R = len(n_rows)
        cu = np.zeros(R + 1, dtype=np.int32)
        accepted = np.zeros(R, dtype=np.int32)
        logprobs = [None] * R
        rows_i32 = n_rows.astype(np.int32)
        if len(sampling) == 0:
            return Emitted(np.zeros(0, np.int64), cu, num_draft, accepted, rows_i32, logprobs)
        s_states = [states[i] for i in sampling]
        pos = (None if positions is None else [int(positions[i]) for i in sampling])  # counter-based draws
        if masks is not None:  # grammars first: what follows only ever sees allowed tokens
            logits = masks.apply(logits)
        # logprobs are reported from the model's raw distribution (constrained: the masked one)
        raw_logits = logits
        trees = _tree_requests(sched, num_draft, n_rows)  # scheduled index -> its parents
        offsets = {i: np.concatenate([[0], node_depths(par)]) for i, par in trees.items()}
        logits = mask_min_tokens(logits, cu_logits, sampling, states, self.eos_token_ids, offsets)
        if masks is not None and logits is not raw_logits:  # min_tokens refused all the grammar allows
            dead = torch.isneginf(logits[torch.from_numpy(masks.rows).to(logits.device)]).all(dim=1)
            if bool(dead.any()):  # (a complete grammar allows only EOS): the grammar wins
                r = torch.from_numpy(masks.rows).to(logits.device)[dead]
                logits[r] = raw_logits[r]
        penalized = penalty_rows(sched, states, sampling, cu_logits, num_draft, trees)
        if penalized:  # logit_bias, then the penalties, each row as of its own position (vLLM's order)
            logits = apply_penalties(logits, penalized)
        tree_paths = {}
        if num_draft.sum() == 0:
            if all(st.params.temperature == 0.0 for st in s_states):
                tokens = argmax_last(logits)  # all greedy: nothing else to do
            else:
                tokens = self.sampler(logits, sampling_metadata(s_states, device=logits.device,
                                                                positions=pos)).token_ids
            counts = np.ones(len(sampling), dtype=np.int32)
            flat = tokens.cpu().numpy()
        else:
            if draft_ids is None:
                draft_ids = np.asarray(sched.draft_token_ids, dtype=np.int64)
            flat, counts, acc, tree_paths = self._verify(logits, draft_ids, s_states, sampling, n_rows, num_draft,
                                                         draft_probs, trees, pos)
            accepted[sampling] = acc
        cu[1:] = np.cumsum(np.bincount(sampling, weights=counts, minlength=R).astype(np.int32))
        want = [i for i in sampling if states[i].params.logprobs is not None]
        if want and not (self.disable_logprobs and num_draft.sum() > 0):
            self._logprobs(raw_logits, cu_logits, cu, flat, want, states, logprobs, tree_paths)
        return Emitted(flat.astype(np.int64), cu, num_draft, accepted, rows_i32, logprobs, tree_paths)

    def _verify(self, logits, draft_ids, s_states, sampling, n_rows, num_draft, draft_probs, trees, pos=None):
        """draft_ids int64[sum num_draft]: the step's drafts -> flat emitted tokens, emitted and
        accepted counts per sampled request, tree paths.
        pos: each sampled request's first output position (None: len(output_token_ids))."""
        if pos is None:
            pos = [len(s.output_token_ids) for s in s_states]
        rows = n_rows[sampling]
        d = num_draft[sampling]
        if not trees and all(st.params.temperature == 0.0 for st in s_states):
            flat, n_emit, acc = greedy_chains(argmax_last(logits).cpu().numpy(), draft_ids, rows, d)
            return flat, n_emit, acc, {}
        meta = sampling_metadata(s_states, rows.tolist(), device=logits.device, positions=pos)
        target_probs = probs_from_logits(logits, meta)  # [L, V]
        is_tree = np.array([int(i) in trees for i in sampling], dtype=bool)
        if not is_tree.any():  # chains only: today's path
            out, n_emit, acc = self._verify_chains(target_probs, draft_ids, rows, d, s_states, draft_probs, pos)
            flat = out[np.arange(out.shape[1])[None, :] < n_emit[:, None]]
            return flat, n_emit, acc, {}
        cu_rows = np.concatenate([[0], np.cumsum(rows)])
        cu_d = np.concatenate([[0], np.cumsum(d)])

        def span(cu, idx):  # the concatenated ranges cu[i] .. cu[i + 1] of the given requests
            return np.concatenate([np.arange(cu[i], cu[i + 1]) for i in idx] + [np.zeros(0, np.int64)])

        per_request = [None] * len(sampling)
        n_emit = np.zeros(len(sampling), dtype=np.int32)
        acc = np.zeros(len(sampling), dtype=np.int32)
        chains = np.flatnonzero(~is_tree)
        if len(chains):
            sel = torch.from_numpy(span(cu_rows, chains)).to(target_probs.device)
            out, n_c, a_c = self._verify_chains(target_probs[sel], draft_ids[span(cu_d, chains)], rows[chains],
                                                d[chains], [s_states[j] for j in chains], draft_probs,
                                                [pos[j] for j in chains])
            for k, j in enumerate(chains):
                per_request[j] = out[k, : n_c[k]]
            n_emit[chains], acc[chains] = n_c, a_c
        tree_idx = np.flatnonzero(is_tree)
        sel = torch.from_numpy(span(cu_rows, tree_idx)).to(target_probs.device)
        res = self._verify_trees(target_probs[sel], draft_ids[span(cu_d, tree_idx)], d[tree_idx],
                                 [trees[int(sampling[j])] for j in tree_idx], [s_states[j] for j in tree_idx],
                                 draft_probs, [pos[j] for j in tree_idx])
        out = res.token_ids.cpu().numpy()
        n_t = res.num_emitted.cpu().numpy().astype(np.int32)
        nodes = res.accepted_nodes.cpu().numpy()
        tree_paths = {}
        for k, j in enumerate(tree_idx):
            per_request[j] = out[k, : n_t[k]]
            tree_paths[int(sampling[j])] = nodes[k, : n_t[k] - 1].astype(np.int64)
        n_emit[tree_idx], acc[tree_idx] = n_t, n_t - 1
        return np.concatenate(per_request), n_emit, acc, tree_paths

    def _verify_chains(self, target_probs, draft_ids, rows, d, s_states, draft_probs, pos):
        """Chain verification of the given requests (rows: their logits rows, in order)."""
        cu_draft = torch.from_numpy(np.concatenate([[0], np.cumsum(d)]).astype(np.int64))
        has_bonus = torch.from_numpy(rows > d)  # a split proposal has no bonus row
        q = None
        if draft_probs and d.sum() > 0:  # (beside trees, the chains may be plain decodes only)
            V = target_probs.shape[1]
            q = target_probs.new_zeros(int(d.sum()), V)
            start = 0
            for st, k in zip(s_states, d.tolist()):
                probs = draft_probs.get(st.core_id)
                if probs is DETERMINISTIC and k:  # deterministic drafts: q = one-hot
                    q[torch.arange(start, start + k, device=q.device),
                      torch.from_numpy(draft_ids[start:start + k]).to(q.device)] = 1.0
                elif probs is not None and k:
                    q[start:start + k] = probs[:k].to(q.dtype)
                elif k and st.params.temperature != 0.0:
                    raise RuntimeError(f"request {st.request_id!r} verifies drafts without their draft probabilities")
                start += k
        greedy = torch.tensor([s.params.temperature == 0.0 for s in s_states])
        streams = RandomStreams.build([s.seed for s in s_states], pos)
        out, n_emit = self.verify(torch.from_numpy(draft_ids), cu_draft, q, target_probs, greedy, streams, has_bonus)
        out = out.cpu().numpy()
        n_emit = n_emit.cpu().numpy().astype(np.int32)
        return out, n_emit, _num_accepted(out, n_emit, d, draft_ids)

    def _verify_trees(self, target_probs, draft_ids, d, parents, s_states, draft_probs, pos):
        """Tree verification: target_probs [sum(1 + m), V]; q rows where the proposer gave them,
        one-hot (deterministic top-k children) where not."""
        if target_probs.shape[0] != int(d.sum()) + len(d):
            raise RuntimeError("a tree request must own 1 + m logits rows (trees are never split)")
        V = target_probs.shape[1]
        one_hot = torch.ones(len(d), dtype=torch.bool)
        q = None
        start = 0
        for r, (st, k) in enumerate(zip(s_states, d.tolist())):
            probs = draft_probs.get(st.core_id) if draft_probs else None
            if probs is not None and probs is not DETERMINISTIC:
                if q is None:
                    q = target_probs.new_zeros(int(d.sum()), V)
                q[start:start + k] = probs[:k].to(q.dtype)
                one_hot[r] = False
            start += k
        greedy = torch.tensor([s.params.temperature == 0.0 for s in s_states])
        streams = RandomStreams.build([s.seed for s in s_states], pos)
        cu_draft = torch.from_numpy(np.concatenate([[0], np.cumsum(d)]).astype(np.int64))
        return self.verify_tree(torch.from_numpy(draft_ids), torch.from_numpy(np.concatenate(parents)), cu_draft,
                                q, target_probs, greedy, streams, one_hot=one_hot)

    @staticmethod
    def _logprobs(logits, cu_logits, cu, flat, want, states, logprobs, tree_paths=None):
        """Raw logprobs of every emitted token of the requests in `want` (one batched call)."""
        rows, toks, spans = [], [], []
        for i in want:
            n = int(cu[i + 1] - cu[i])  # emitted tokens = the first n of the request's logits rows
            if n:
                spans.append((i, len(toks), n))
                if tree_paths and i in tree_paths:  # a tree: the root row, then its path's rows
                    local = [0] + (np.asarray(tree_paths[i]) + 1).tolist()
                else:
                    local = range(n)
                rows.extend(int(cu_logits[i]) + j for j in local)
                toks.extend(flat[cu[i]: cu[i + 1]].tolist())
        if not spans:
            return
        top_n = max(states[i].params.logprobs for i, _, _ in spans)
        lp = compute_logprobs(logits[torch.tensor(rows, device=logits.device)],
                              torch.tensor(toks, dtype=torch.int64), top_n)  # [T, top_n + 1]
        for i, start, n in spans:
            part = LogprobsTensors(lp.token_ids[start:start + n], lp.logprobs[start:start + n],
                                   lp.sampled_token_ranks[start:start + n])
            logprobs[i] = part.entries(states[i].params.logprobs)


def tree_requests(sched) -> dict:
    """Scheduled request index -> draft parents of the requests verifying a tree this step."""
    return _tree_requests(sched, np.asarray(sched.num_draft_tokens, dtype=np.int32),
                          np.diff(np.asarray(sched.cu_num_logits)))


def _tree_requests(sched, num_draft, n_rows) -> dict:
    """Scheduled request index -> its draft parents (int64[m]), for requests whose proposal is a
    tree (not a chain). Empty when ``sched`` has no ``draft_parents`` or only chains."""
    parents = getattr(sched, "draft_parents", None)
    if parents is None or num_draft.sum() == 0:
        return {}
    tree_mask = getattr(sched, "tree_mask", None)
    if tree_mask is not None and len(tree_mask) == 0:
        return {}  # the core packs tree masks iff the batch holds a tree run: chains only
    parents = np.asarray(parents, dtype=np.int64)
    cu = np.concatenate([[0], np.cumsum(num_draft, dtype=np.int64)])
    if parents.shape != (int(cu[-1]),):
        raise RuntimeError(f"sched.draft_parents has shape {parents.shape}, expected [{int(cu[-1])}]")
    tree = ~is_chain_request(parents, cu) & (n_rows > 0)
    return {int(i): parents[cu[i]:cu[i + 1]] for i in np.flatnonzero(tree)}


def greedy_chains(top: np.ndarray, drafts: np.ndarray, rows: np.ndarray, d: np.ndarray):
    """Verification of greedy chains from the target's argmax per logits row (top int64[sum rows]),
    what rejection sampling and typical acceptance do for greedy requests without the one-hot
    probabilities: accept drafts while each equals the argmax of its row, then emit the argmax of
    the next row (the recovered token, or the bonus token when all were accepted and the request
    has a bonus row; a split proposal has none). drafts int64[sum d]; rows, d int[R].
    -> (emitted tokens flat, emitted per request int32[R], accepted per request int32[R]).

    Vectorized over requests (this runs every verification step; a Python loop per request cost
    ~3 us each): accepted drafts equal their rows' argmax, so request i emits the argmax of rows
    r0_i .. r0_i + a_i (+ 1 unless it has no row past its last accepted draft), one gather."""
    R = len(d)
    d = np.asarray(d, dtype=np.int64)
    rows = np.asarray(rows, dtype=np.int64)
    r0 = np.zeros(R, dtype=np.int64)
    k0 = np.zeros(R, dtype=np.int64)
    if R:
        np.cumsum(rows[:-1], out=r0[1:])
        np.cumsum(d[:-1], out=k0[1:])
    width = int(d.max(initial=0))
    if width and len(top) and len(drafts):
        j = np.arange(width)
        valid = j < d[:, None]
        t = top[np.minimum(r0[:, None] + j, len(top) - 1)]
        x = drafts[np.minimum(k0[:, None] + j, len(drafts) - 1)]
        acc = np.cumprod((t == x) & valid, axis=1).sum(axis=1)
    else:
        acc = np.zeros(R, dtype=np.int64)
    n_emit = acc + (acc < rows)
    total = int(n_emit.sum())
    offsets = np.repeat(r0 - (np.cumsum(n_emit) - n_emit), n_emit) + np.arange(total)
    return top[offsets].astype(np.int64), n_emit.astype(np.int32), acc.astype(np.int32)


def _num_accepted(out: np.ndarray, n_emit: np.ndarray, d: np.ndarray, drafts: np.ndarray) -> np.ndarray:
    """Accepted drafts per request: the leading emitted tokens equal to its drafts (a recovered
    token never equals the draft it replaces, so this is exact; the core applies the same rule
    to decide whether a split proposal's rest is kept).

    out int64[R, W] padded -1, n_emit int32[R], d int32[R] drafts verified, drafts int64[sum d]."""
    R = len(d)
    width = int(d.max(initial=0))
    grid = np.full((R, width), -2, dtype=np.int64)
    cols = np.arange(width)[None, :]
    valid = cols < d[:, None]
    grid[valid] = drafts
    same = (out[:, :width] == grid) & valid & (cols < n_emit[:, None])
    return np.cumprod(same, axis=1).sum(axis=1).astype(np.int32)
