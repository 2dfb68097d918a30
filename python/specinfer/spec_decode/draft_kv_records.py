"""Which KV blocks hold a proposer's own KV (a draft model's, an EAGLE head's) for which tokens.

The target's prefix cache shares a block between requests whose token prefixes match, but a
proposer's KV in that block is valid only if the proposer itself wrote it for that prefix: a
request that finished, was paused (speculation disabled) or aborted before its proposer caught
up leaves cached blocks whose proposer KV is stale or garbage. So the proposer records, per
block, the identity of the token prefix whose KV it fully wrote there (a chain key: a hash of
the block's tokens and its predecessor's key, like the prefix cache's own hash chain). On a
request's first sight it reuses only the leading blocks whose record matches the request's
own chain keys, and catches up from the first one that does not.

Every write of the proposer into a block first drops that block's record; a record is set
again only when a catch-up completes the block with confirmed tokens.
"""
from __future__ import annotations

import numpy as np


class DraftKvRecords:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self._key_of_block: dict[int, int] = {}  # block id -> chain key of the prefix it holds
        self._chain: dict[int, list[int]] = {}  # core id -> chain keys of its full blocks so far

    def forget(self, core_id: int) -> None:
        self._chain.pop(core_id, None)

    def _chain_keys(self, state, num_blocks: int, keep: bool = True) -> list[int]:
        keys = self._chain.setdefault(state.core_id, []) if keep else list(self._chain.get(state.core_id, ()))
        bs = self.block_size
        while len(keys) < num_blocks:
            i = len(keys)
            prev = keys[-1] if keys else 0
            keys.append(hash((prev, tuple(state.tokens_slice(i * bs, (i + 1) * bs)))))
        return keys

    def reusable_tokens(self, state, block_row: np.ndarray, limit: int) -> int:
        """Leading tokens (whole blocks, at most ``limit``) whose proposer KV is valid."""
        n = limit // self.block_size
        keys = self._chain_keys(state, n)
        i = 0
        while i < n and self._key_of_block.get(int(block_row[i])) == keys[i]:
            i += 1
        return i * self.block_size

    def will_write(self, block_row: np.ndarray, start: int, end: int) -> None:
        """The proposer is about to write positions [start, end) of this block-table row."""
        if end <= start:
            return
        for b in block_row[start // self.block_size: (end - 1) // self.block_size + 1].tolist():
            self._key_of_block.pop(int(b), None)

    def will_write_runs(self, block_rows: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> None:
        """will_write for runs at once (each step's catch-up and drafts: one numpy gather instead
        of a call per request): block_rows int32[S, W], starts / ends int64[S]."""
        keep = ends > starts
        if not self._key_of_block or not keep.any():
            return  # (no records yet: nothing to drop)
        bs = self.block_size
        first = starts[keep] // bs
        n = (ends[keep] - 1) // bs - first + 1
        cu = np.zeros(len(n) + 1, np.int64)
        np.cumsum(n, out=cu[1:])
        run = np.repeat(np.arange(len(n)), n)
        col = first[run] + np.arange(int(cu[-1])) - cu[:-1][run]
        pop = self._key_of_block.pop
        for b in block_rows[keep][run, col].tolist():
            pop(b, None)

    def wrote_confirmed_runs(self, states, block_rows: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> None:
        """wrote_confirmed for runs at once; only runs that completed a block record anything."""
        bs = self.block_size
        for j in np.flatnonzero(ends // bs > starts // bs).tolist():
            self.wrote_confirmed(states[j], block_rows[j], int(starts[j]), int(ends[j]))

    def wrote_confirmed(self, state, block_row: np.ndarray, start: int, end: int) -> None:
        """Positions [0, end) now hold the proposer's KV of the request's confirmed tokens
        (it wrote [start, end) and [0, start) was valid): record the blocks that became full."""
        bs = self.block_size
        last = end // bs
        keys = self._chain_keys(state, last)
        for i in range(start // bs, last):
            self._key_of_block[int(block_row[i])] = keys[i]


# Private draft-KV blocks past the shared pool (EAGLE's copy-on-write of a shared last cached block)
NUM_PRIVATE_BLOCKS = 32


class PairRecords(DraftKvRecords):
    """EAGLE's pairs: pair position p holds (token p + 1, target feature f_p), so the last pair of
    a full block depends on the token after the block. For every full block whose last pair it
    wrote, the proposer records the block's prefix key, that next token and f at the block's last
    position: a request reusing the block (prefix-cache hit) with another next token can rewrite
    its own copy of that pair without the target recomputing f (EagleProposer)."""

    def __init__(self, block_size: int):
        super().__init__(block_size)
        self._last: dict[int, tuple[int, int, object]] = {}  # block id -> (prefix key, next token, feature [H])

    def wrote_last_pair(self, state, block: int, block_index: int, next_token: int, feature, keep: bool) -> None:
        key = self._chain_keys(state, block_index + 1, keep)[block_index]
        self._last[int(block)] = (key, int(next_token), feature.detach().clone())

    def last_pair(self, state, block_row, num_cached: int):
        """(next token, feature [H]) recorded for the block ending at num_cached (a multiple of the
        block size) if it holds this request's prefix; None when unknown."""
        i = num_cached // self.block_size - 1
        rec = self._last.get(int(block_row[i]))
        if rec is None or rec[0] != self._chain_keys(state, i + 1)[i]:
            return None
        return rec[1], rec[2]
