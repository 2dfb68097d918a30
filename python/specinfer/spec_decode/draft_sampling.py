"""Sampled chain drafts for proposers with a distribution over the target vocabulary (draft_model,
eagle, eagle3): draft i of a request is argmax for a greedy request, else a draw from q (its
logits under the request's temperature / top-k / top-p / min-p) by inverse CDF with the
request's counter-based uniform ``U(seed, output position P + i, DRAFT)``. q goes to the
rejection sampler, which keeps sampling lossless."""
from __future__ import annotations

import torch

from specinfer.sample import probs_from_logits
from specinfer.sample.random_streams import DRAFT, sample_from_weights


def sample_drafts(logits, meta, active, i: int, want_probs: bool):
    """logits float32[A, V] of the active rows (int64[A] indices into meta's rows) at draft i ->
    (int64[A] tokens, float32[A, V] q or None when every request is greedy)."""
    if not want_probs:
        return logits.argmax(-1), None
    sub = meta.take(active.tolist())
    probs = probs_from_logits(logits, sub)  # [A, V], the draft's q for each row
    u = sub.streams.uniform(DRAFT, i + 1, probs.device)[:, i]  # output position P + i
    tok = torch.where(sub.is_greedy, logits.argmax(-1), sample_from_weights(probs, u))
    return tok, probs


def gather_probs(probs_out, n: int, counts) -> list:
    """[(active int64[A], q [A, V])] per draft step -> per request Tensor[counts[j], V] (or None)."""
    per = [[] for _ in range(n)]
    for active, probs in probs_out:
        for j, a in enumerate(active.tolist()):
            if len(per[a]) < counts[a]:
                per[a].append(probs[j])
    return [torch.stack(p) if p else None for p in per]
