"""A stand-in for an engine's Rust core that counts the scheduled proposals which branch (token
trees that are not chains), delegating everything to the real core."""
from __future__ import annotations

import numpy as np

from specinfer.spec_decode.token_tree import is_chain


class BranchSpy:
    def __init__(self, core):
        self._core, self.branching = core, 0

    def __getattr__(self, name):
        return getattr(self._core, name)

    def schedule(self, *a, **kw):
        out = self._core.schedule(*a, **kw)
        parents, n = np.asarray(out.draft_parents), np.asarray(out.num_draft_tokens)
        cu = np.concatenate([[0], np.cumsum(n)])
        self.branching += sum(not is_chain(parents[cu[i]:cu[i + 1]]) for i in range(len(n)))
        return out
