"""logit_bias and the repetition, frequency and presence penalties, row by row.

vLLM's semantics and order (and OpenAI's definitions), applied to the raw logits before
temperature, min-p, top-k and top-p:

1. ``logit_bias``: ``l[t] += bias[t]``;
2. ``repetition_penalty`` r over every token seen in the prompt or the output so far:
   ``l[t] = l[t] / r`` where ``l[t] > 0``, else ``l[t] * r`` (CTRL's rule, as HF and vLLM);
3. ``frequency_penalty`` f and ``presence_penalty`` p over the output so far:
   ``l[t] -= f * count[t] + p * (count[t] > 0)``.

"So far" is per row: in a verification run the row that decides draft position j has seen the
output plus drafts 0 .. j-1 (a tree node: the drafts on its path), so every position is judged
as plain decoding would judge it once the drafts before it are accepted. That makes rejection
sampling against these logits lossless with respect to penalized sampling.

The work is sparse: only the (row, token) pairs a row has seen are touched, three gathers and
scatters over the whole batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class RowHistory:
    """One logits row's penalty inputs."""

    row: int  # the logits row
    presence: float
    frequency: float
    repetition: float
    bias_ids: np.ndarray  # int64[B]: logit_bias token ids (unique)
    bias_values: np.ndarray  # float[B]
    prompt_ids: np.ndarray  # int64[P]: the prompt's distinct tokens (for the repetition penalty)
    output_ids: np.ndarray  # int64: the output so far, drafts before this row included (repeats kept)


def apply_penalties(logits: torch.Tensor, rows: list[RowHistory]) -> torch.Tensor:
    """logits [L, V] -> a float32/float64 copy with each listed row biased and penalized (the
    input is not modified). Rows not listed are copied unchanged."""
    dtype = logits.dtype if logits.dtype in (torch.float32, torch.float64) else torch.float32
    out = logits.to(dtype, copy=True)
    dev = out.device
    b_rows, b_ids, b_vals = [], [], []
    s_rows, s_ids, s_rep = [], [], []
    o_rows, o_ids, o_sub = [], [], []
    for h in rows:
        if len(h.bias_ids):
            b_rows.append(np.full(len(h.bias_ids), h.row, dtype=np.int64))
            b_ids.append(h.bias_ids)
            b_vals.append(np.asarray(h.bias_values, dtype=np.float64))
        out_ids, counts = np.unique(h.output_ids, return_counts=True)
        if h.repetition != 1.0:
            seen = np.union1d(h.prompt_ids, out_ids)
            s_rows.append(np.full(len(seen), h.row, dtype=np.int64))
            s_ids.append(seen)
            s_rep.append(np.full(len(seen), h.repetition))
        if (h.frequency or h.presence) and len(out_ids):
            o_rows.append(np.full(len(out_ids), h.row, dtype=np.int64))
            o_ids.append(out_ids)
            o_sub.append(h.frequency * counts + h.presence)

    def cat(parts, dt):
        return torch.from_numpy(np.concatenate(parts).astype(dt)).to(dev)

    if b_rows:
        r, t = cat(b_rows, np.int64), cat(b_ids, np.int64)
        out[r, t] += cat(b_vals, np.float64).to(dtype)
    if s_rows:
        r, t = cat(s_rows, np.int64), cat(s_ids, np.int64)
        rep = cat(s_rep, np.float64).to(dtype)
        g = out[r, t]
        out[r, t] = torch.where(g > 0, g / rep, g * rep)
    if o_rows:
        r, t = cat(o_rows, np.int64), cat(o_ids, np.int64)
        out[r, t] -= cat(o_sub, np.float64).to(dtype)
    return out
