"""The per-row penalty inputs of one step: which logits rows belong to requests with
logit_bias or penalties, and what each row has seen (prompt, output, the drafts before it)."""
from __future__ import annotations

import numpy as np

from specinfer.sample.penalties import RowHistory


def penalty_rows(sched, states, sampling, cu_logits, num_draft, trees) -> list[RowHistory]:
    """RowHistory for every logits row of the sampled requests that penalize or bias.

    Row j of a chain request decides output offset j: it has seen drafts 0 .. j-1. Row 0 of a tree
    request is the root; row 1 + m is node m, which has seen the drafts on the path to m (m
    included)."""
    if not any(states[i].params.penalized for i in sampling):
        return []
    cu_d = np.concatenate([[0], np.cumsum(num_draft, dtype=np.int64)])
    drafts = np.asarray(sched.draft_token_ids, dtype=np.int64)
    out = []
    for i in sampling:
        st = states[i]
        p = st.params
        if not p.penalized:
            continue
        d = drafts[cu_d[i]:cu_d[i + 1]]
        base = np.asarray(st.output_token_ids, dtype=np.int64)
        prompt = st.prompt_distinct() if p.repetition_penalty != 1.0 else _EMPTY
        bias_ids, bias_vals = p.logit_bias_arrays()
        first, n = int(cu_logits[i]), int(cu_logits[i + 1] - cu_logits[i])
        if i in trees:
            parents = trees[i]
            prefixes = [_EMPTY] + [d[_path(parents, m)] for m in range(len(parents))]
        else:
            prefixes = [d[:j] for j in range(n)]
        for j in range(n):
            out.append(RowHistory(first + j, p.presence_penalty, p.frequency_penalty, p.repetition_penalty,
                                  bias_ids, bias_vals, prompt, np.concatenate([base, prefixes[j]])))
    return out


_EMPTY = np.zeros(0, dtype=np.int64)


def _path(parents, m: int) -> list[int]:
    """Node indices from the root's child down to node m."""
    path = []
    while m >= 0:
        path.append(m)
        m = int(parents[m])
    return path[::-1]
