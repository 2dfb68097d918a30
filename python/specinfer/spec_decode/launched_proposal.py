"""A proposal whose drafts are still being made where the forwards run (issue 38).

A draft model's proposal is k forwards that depend on the step just verified; waiting for their
tokens before scheduling the next step leaves the device idle for the host's schedule, pack and
launch after every proposal. Instead the proposer launches its forwards (DraftModelProposer.
launch_proposal) and hands back what the host knows at once — which requests drafted how many
tokens — with the tokens themselves pending on the device. The engine (engine/launched_drafts.py)
stores placeholders of that shape in the core, schedules and launches the step that verifies them
(the device writes the drafted tokens into its packed inputs and its verifier's draft ids), and
gives the core the real tokens once they exist (`SchedulerCore.replace_draft_tokens`), before that
step's update reads them.
"""
from __future__ import annotations

import numpy as np


class LaunchedProposal:
    """core_ids uint64[P] and cu_num_draft int32[P + 1]: the proposal's shape, known at launch;
    `pending` (executor PendingForward) -> (int64[N] the drafted tokens request after request,
    where the forwards run; per request q Tensor[k_j, V] or None, or None when every draft is
    deterministic); `undo()`: the proposer forgets what the forwards would have written (they
    failed, or their step was undone); `settled()`: its bookkeeping once they ran (the draft KV
    records), off the critical path."""

    def __init__(self, core_ids: np.ndarray, cu_num_draft: np.ndarray, pending, undo, settled=None):
        self.core_ids, self.cu_num_draft, self.pending, self._undo = core_ids, cu_num_draft, pending, undo
        self.settled = settled if settled is not None else _nothing
        self.row_of = {cid: j for j, cid in enumerate(core_ids.tolist())}  # core id -> row of the proposal

    @classmethod
    def empty(cls) -> "LaunchedProposal":
        return cls(np.zeros(0, np.uint64), np.zeros(1, np.int32), None, _nothing)

    @property
    def num_drafts(self) -> int:
        return int(self.cu_num_draft[-1])

    def result(self):
        """(tokens, q) where the forwards run, after the proposal's (a later job on the forward thread,
        or device work queued behind it on CUDA); RuntimeError if the proposal's forwards failed."""
        return self.pending.done_result()

    def wait(self) -> tuple[np.ndarray, list | None]:
        """Block until the forwards ended -> (int64[N] the drafted tokens on the host, q); their
        exception re-raised here."""
        tokens, q = self.pending.wait()
        return tokens.cpu().numpy(), q

    def discard(self) -> None:
        """The forwards end (whatever they did) and the proposer forgets what they wrote."""
        if self.pending is not None:
            self.pending.settle()
        self._undo()


def _nothing() -> None:
    pass


def concat_ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """int64: starts[i] .. starts[i] + lens[i] - 1, one range after another."""
    lens = lens.astype(np.int64)
    return np.repeat(starts.astype(np.int64) - (np.cumsum(lens) - lens), lens) + np.arange(int(lens.sum()))
