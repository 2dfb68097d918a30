"""The step that verifies a launched proposal (spec_decode/launched_proposal.py): where its packed
batch holds the proposal's placeholders, and how the drafted tokens reach it.

The core stored placeholders of the proposal's shape, so the step was scheduled and packed before
the tokens existed. Where the forwards run, in order after the proposal's, `fill_inputs` writes
the drafted tokens into the packed input ids (a device-side gather and scatter), and the verifier
reads the same tokens as its draft ids (`draft_ids`) and the proposal's q (`draft_probs`). A run's
verified drafts are the last `num_draft_tokens[r]` of its query tokens (the first is the request's
last confirmed token), and drafts `cu_draft[r] ..` of the step's draft ids; a split proposal
verifies a prefix of its drafts, its last logits row the draft after its query tokens."""
from __future__ import annotations

from collections import ChainMap

import numpy as np
import torch

from specinfer.attention.batch_metadata import as_device
from specinfer.spec_decode.launched_proposal import concat_ranges


class DraftFill:
    def __init__(self, sched, launched, device: torch.device):
        self.launched = launched
        num_draft = np.asarray(sched.num_draft_tokens, np.int64)
        runs = np.flatnonzero(num_draft)
        row_of = launched.row_of
        rows = np.fromiter((row_of.get(i, -1) for i in np.asarray(sched.req_ids)[runs].tolist()), np.int64,
                           len(runs))
        keep = rows >= 0  # (a request whose pending proposal is older holds real drafts already)
        runs, rows = runs[keep], rows[keep]
        v = num_draft[runs]
        n = np.asarray(sched.num_scheduled_tokens, np.int64)
        tok_start = (np.cumsum(n) - n)[runs]  # each run's first query token: the request's last token
        cu_draft = (np.cumsum(num_draft) - num_draft)[runs]
        first = self.launched.cu_num_draft[rows].astype(np.int64)  # the run's drafts in the tokens
        # the verifier reads all v drafts; the inputs hold n - 1 of them (a split proposal's last
        # logits row verifies the draft after its query)
        self.draft_pos, self.src = concat_ranges(cu_draft, v), concat_ranges(first, v)
        self.input_pos, in_src = concat_ranges(tok_start + 1, n[runs] - 1), concat_ranges(first, n[runs] - 1)
        self._input_pos_t = as_device(self.input_pos, device)
        self._in_src_t = as_device(in_src, device)
        self._src_t = as_device(self.src, device)

    @property
    def empty(self) -> bool:
        return len(self.src) == 0

    def fill_inputs(self, batch) -> None:
        """Where the forwards run, before the step's: its input ids at the placeholders."""
        tokens = self.launched.result()[0]
        batch.input_ids[self._input_pos_t] = tokens[self._in_src_t].to(batch.input_ids.device)

    def draft_ids(self, sched) -> np.ndarray:
        """int64[sum num_draft_tokens]: the step's draft ids, the placeholders replaced."""
        ids = np.array(sched.draft_token_ids, dtype=np.int64)
        ids[self.draft_pos] = self.launched.result()[0][self._src_t].cpu().numpy()
        return ids

    def draft_probs(self, base: dict):
        """The verifier's q per core id: the proposal's, then the engine's pending ones."""
        q = self.launched.result()[1]
        if q is None:
            return base
        return ChainMap(dict(zip(self.launched.core_ids.tolist(), q)), base)


def verify_filled(step_sampler, fill: DraftFill, logits, sched, states, draft_probs, masks=None, positions=None):
    """The step sampler over a step whose drafts a launched proposal fills."""
    return step_sampler(logits, sched, states, fill.draft_probs(draft_probs), masks, positions,
                        draft_ids=fill.draft_ids(sched))

