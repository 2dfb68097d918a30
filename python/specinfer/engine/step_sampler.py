"""Turns one step's logits into emitted tokens: plain sampling, or verification of drafts.

Rows: request r owns logits rows cu_num_logits[r] .. cu_num_logits[r+1]. A plain decode (or a
final prefill chunk) owns one row; a verification of k drafts owns 1 + k rows (one per draft
position plus the bonus row), or k rows when the token budget split its proposal (no bonus
row: the core verifies one draft past the query, scored by the last row). Emitted tokens per
request = accepted drafts + one recovered or bonus token (none after a fully accepted split).
Logprobs always come from the target's raw logits. Randomness comes from each request's
counter-based streams (seed, output position), see specinfer.sample.random_streams.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from specinfer.sample import (LogprobsTensors, RandomStreams, Sampler, SamplingMetadata, compute_logprobs,
                              probs_from_logits, rejection_sample)
from specinfer.sample.typical_acceptance import typical_acceptance_sample


@dataclass
class Emitted:
    token_ids: np.ndarray  # int64[N] all emitted tokens, request after request
    cu_num_emitted: np.ndarray  # int32[R + 1] over every scheduled request (0 for prefill chunks)
    num_draft_tokens: np.ndarray  # int32[R] drafts verified per request
    num_accepted: np.ndarray  # int32[R] accepted drafts per request
    num_rows: np.ndarray  # int32[R] logits rows per request (a split proposal has no bonus row)
    logprobs: list  # per scheduled request: list[dict[int, float]] aligned with its tokens, or None


def sampling_metadata(states, rows_per_request=None, device=None, positions=None) -> SamplingMetadata:
    """One row per state (or rows_per_request[i] rows for state i) with its request's parameters;
    row i decides output position positions[i] (default: the request's next output token)."""
    p = [s.params for s in states]
    if positions is None:
        positions = [len(s.output_token_ids) for s in states]
    streams = RandomStreams.build([s.seed for s in states], positions)
    meta = SamplingMetadata.build(
        [x.temperature for x in p], [x.top_k for x in p], [x.top_p for x in p], [x.min_p for x in p],
        streams, device=device)
    if rows_per_request is not None and any(n != 1 for n in rows_per_request):
        meta = meta.expand(rows_per_request)
    return meta


def stop_ids_blocked(state, eos_token_ids) -> list[int]:
    """Tokens that may not be emitted before min_tokens: EOS (unless ignored) and stop token ids."""
    ids = [] if state.params.ignore_eos else list(eos_token_ids)
    return ids + list(state.params.stop_token_ids or ())


def mask_min_tokens(logits: torch.Tensor, cu_logits, sampling, states, eos_token_ids) -> torch.Tensor:
    """logits [L, V] -> the same (or a masked copy) with stop tokens at -inf on rows whose token
    would land before the request's min_tokens (as HF's MinNewTokensLogitsProcessor does)."""
    rows, cols = [], []
    for i in sampling:
        st = states[i]
        need = st.params.min_tokens - len(st.output_token_ids)
        if need <= 0:
            continue
        blocked = stop_ids_blocked(st, eos_token_ids)
        for j in range(min(need, int(cu_logits[i + 1] - cu_logits[i]))):
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
            self.verify = rejection_sample
        else:
            self.verify = partial(typical_acceptance_sample, posterior_threshold=spec.posterior_threshold,
                                  posterior_alpha=spec.posterior_alpha)

    def __call__(self, logits: torch.Tensor, sched, states, draft_probs: dict) -> Emitted:
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
        raw_logits = logits  # logprobs are reported from the model's raw distribution
        logits = mask_min_tokens(logits, cu_logits, sampling, states, self.eos_token_ids)
        if num_draft.sum() == 0:
            if all(st.params.temperature == 0.0 for st in s_states):
                tokens = logits.argmax(dim=-1)  # all greedy: nothing else to do
            else:
                tokens = self.sampler(logits, sampling_metadata(s_states, device=logits.device)).token_ids
            counts = np.ones(len(sampling), dtype=np.int32)
            flat = tokens.cpu().numpy()
        else:
            flat, counts, acc = self._verify(logits, sched, s_states, sampling, n_rows, num_draft, draft_probs)
            accepted[sampling] = acc
        cu[1:] = np.cumsum(np.bincount(sampling, weights=counts, minlength=R).astype(np.int32))
        want = [i for i in sampling if states[i].params.logprobs is not None]
        if want and not (self.disable_logprobs and num_draft.sum() > 0):
            self._logprobs(raw_logits, cu_logits, cu, flat, want, states, logprobs)
        return Emitted(flat.astype(np.int64), cu, num_draft, accepted, rows_i32, logprobs)

    def _verify(self, logits, sched, s_states, sampling, n_rows, num_draft, draft_probs):
        rows = n_rows[sampling]
        d = num_draft[sampling]
        meta = sampling_metadata(s_states, rows.tolist(), device=logits.device)
        target_probs = probs_from_logits(logits, meta)  # [L, V]
        draft_ids = torch.from_numpy(np.asarray(sched.draft_token_ids, dtype=np.int64))
        cu_draft = torch.from_numpy(np.concatenate([[0], np.cumsum(d)]).astype(np.int64))
        has_bonus = torch.from_numpy(rows > d)  # a split proposal has no bonus row
        q = None
        if draft_probs:
            V = target_probs.shape[1]
            q = target_probs.new_zeros(int(d.sum()), V)
            start = 0
            for st, k in zip(s_states, d.tolist()):
                probs = draft_probs.get(st.core_id)
                if probs is not None and k:
                    q[start:start + k] = probs[:k].to(q.dtype)
                elif k and st.params.temperature != 0.0:
                    raise RuntimeError(f"request {st.request_id!r} verifies drafts without their draft probabilities")
                start += k
        greedy = torch.tensor([s.params.temperature == 0.0 for s in s_states])
        streams = RandomStreams.build([s.seed for s in s_states], [len(s.output_token_ids) for s in s_states])
        out, n_emit = self.verify(draft_ids, cu_draft, q, target_probs, greedy, streams, has_bonus)
        out = out.cpu().numpy()
        n_emit = n_emit.cpu().numpy().astype(np.int32)
        flat = out[np.arange(out.shape[1])[None, :] < n_emit[:, None]]
        return flat, n_emit, _num_accepted(out, n_emit, d, np.asarray(sched.draft_token_ids))

    @staticmethod
    def _logprobs(logits, cu_logits, cu, flat, want, states, logprobs):
        """Raw logprobs of every emitted token of the requests in `want` (one batched call)."""
        rows, toks, spans = [], [], []
        for i in want:
            n = int(cu[i + 1] - cu[i])  # emitted tokens = the first n of the request's logits rows
            if n:
                spans.append((i, len(toks), n))
                rows.extend(range(int(cu_logits[i]), int(cu_logits[i]) + n))
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
