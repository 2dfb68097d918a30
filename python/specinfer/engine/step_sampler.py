"""Turns one step's logits into emitted tokens: plain sampling, or verification of drafts.

Rows: request r owns logits rows cu_num_logits[r] .. cu_num_logits[r+1]. A plain decode (or a
final prefill chunk) owns one row; a verification of k drafts owns 1 + k rows (one per draft
position plus the bonus row). Emitted tokens per request = accepted drafts + one recovered or
bonus token. Logprobs always come from the target's raw logits.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from specinfer.sample import (LogprobsTensors, Sampler, SamplingMetadata, compute_logprobs, probs_from_logits,
                              rejection_sample)
from specinfer.sample.typical_acceptance import typical_acceptance_sample


@dataclass
class Emitted:
    token_ids: np.ndarray  # int64[N] all emitted tokens, request after request
    cu_num_emitted: np.ndarray  # int32[R + 1] over every scheduled request (0 for prefill chunks)
    num_draft_tokens: np.ndarray  # int32[R] drafts verified per request
    num_accepted: np.ndarray  # int32[R] accepted drafts per request
    logprobs: list  # per scheduled request: list[dict[int, float]] aligned with its tokens, or None


def sampling_metadata(states, rows_per_request=None, device=None) -> SamplingMetadata:
    """One row per state (or rows_per_request[i] rows for state i) with its request's parameters."""
    p = [s.params for s in states]
    meta = SamplingMetadata.build(
        [x.temperature for x in p], [x.top_k for x in p], [x.top_p for x in p], [x.min_p for x in p],
        [s.generator for s in states], device=device)
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
    def __init__(self, spec, default_generator: torch.Generator, eos_token_ids=()):
        self.eos_token_ids = tuple(eos_token_ids)
        self.default_generator = default_generator
        self.sampler = Sampler(default_generator)
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
        if len(sampling) == 0:
            return Emitted(np.zeros(0, np.int64), cu, num_draft, accepted, logprobs)
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
            flat, counts = self._verify(logits, sched, s_states, sampling, n_rows, num_draft, draft_probs)
            accepted[sampling] = np.where(num_draft[sampling] > 0, counts - 1, 0)
        cu[1:] = np.cumsum(np.bincount(sampling, weights=counts, minlength=R).astype(np.int32))
        want = [i for i in sampling if states[i].params.logprobs is not None]
        if want and not (self.disable_logprobs and num_draft.sum() > 0):
            self._logprobs(raw_logits, cu_logits, cu, flat, want, states, logprobs)
        return Emitted(flat.astype(np.int64), cu, num_draft, accepted, logprobs)

    def _verify(self, logits, sched, s_states, sampling, n_rows, num_draft, draft_probs):
        rows = n_rows[sampling]
        meta = sampling_metadata(s_states, rows.tolist(), device=logits.device)
        target_probs = probs_from_logits(logits, meta)  # [L, V]
        # draft tokens are the query tokens after the first of each verification run
        li = np.asarray(sched.logits_indices)
        first = np.repeat(np.asarray(sched.cu_num_logits[:-1])[sampling], rows)
        is_draft_row = np.arange(len(li)) != first
        draft_ids = torch.from_numpy(np.asarray(sched.input_ids)[li[is_draft_row]])
        d = num_draft[sampling]
        cu_draft = torch.from_numpy(np.concatenate([[0], np.cumsum(d)]).astype(np.int64))
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
        out, n_emit = self.verify(draft_ids, cu_draft, q, target_probs, greedy,
                                  [s.generator for s in s_states], self.default_generator)
        out = out.cpu().numpy()
        n_emit = n_emit.cpu().numpy().astype(np.int32)
        flat = out[np.arange(out.shape[1])[None, :] < n_emit[:, None]]
        return flat, n_emit

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
