"""The proposer protocol: what every speculative method gets from the engine each step
(`ProposalInput`) and what it gives back (`Proposal`).

Row r of every per-request array is the r-th request scheduled in this step (scheduler order).
Positions: request r's query tokens this step sat at positions
`num_computed[r] .. num_computed[r] + num_scheduled[r] - 1`; the last `num_rows[r]` of them have
logits rows, which verified `num_draft[r]` drafts, of which the first `num_accepted[r]` were
accepted. The target's hidden state at position
i is "confirmed" when token i is confirmed (not a rejected draft): its successor token i + 1 is
then known (a prompt token, an accepted draft, or the token emitted this step).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch


@dataclass(frozen=True)
class TargetHidden:
    """Hidden states from the target forward that already ran this step (never an extra one)."""

    final: torch.Tensor  # [T, hidden] post-final-norm hidden state of every query token (batch order)
    # [T, A * hidden] inputs of the target's layers `aux_layers` (pre-norm residual stream),
    # concatenated in that order; None unless the proposer asked for them (EAGLE-3)
    aux: torch.Tensor | None = None


@dataclass(frozen=True)
class ProposalInput:
    """What happened in this step, for the requests that may get drafts for the next one."""

    requests: list  # [R] RequestState (tokens so far, params, generator, core_id, finished)
    num_computed: np.ndarray  # int64[R] positions with target KV before this step (prefix hits included)
    num_scheduled: np.ndarray  # int64[R] query tokens this step (prefill chunk, decode, or 1 + drafts)
    num_draft: np.ndarray  # int64[R] drafts verified this step
    num_accepted: np.ndarray  # int64[R] of those, accepted
    # int64[R] logits rows of r this step: 0 for a prefill chunk, 1 for a decode or final chunk, 1 + k
    # for a verification, k for a split proposal's part (verified without a bonus row)
    num_rows: np.ndarray
    sampled: np.ndarray  # bool[R] request got tokens this step and is still running
    max_drafts: np.ndarray  # int64[R] draft budget for the next step (0: propose nothing for r)
    # bool[R] requests whose proposer state must follow this step's confirmed tokens (speculating and
    # alive; every alive one for proposers that see every step)
    catch_up: np.ndarray
    block_rows: np.ndarray  # int32[R, W] each request's block table row
    hidden: TargetHidden | None  # None for a proposer that does not read it (reads_target_hidden)
    # (int64[E] the tokens each request got this step, int32[R + 1] their offsets), the states'
    # newest tokens (a finished request's are cut at its stop token there)
    emitted: tuple | None = None

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @cached_property  # (a frozen dataclass: cached_property writes the instance's __dict__ itself)
    def core_ids(self) -> np.ndarray:  # uint64[R]
        return np.fromiter((s.core_id for s in self.requests), dtype=np.uint64, count=len(self.requests))

    @property
    def token_start(self) -> np.ndarray:  # int64[R + 1] request r's query tokens are rows [start[r], start[r+1])
        out = np.zeros(len(self.requests) + 1, dtype=np.int64)
        np.cumsum(self.num_scheduled, out=out[1:])
        return out

    @property
    def num_confirmed(self) -> np.ndarray:
        """int64[R] positions whose target hidden state is now confirmed: a chunk's every position;
        of a run with logits rows, those up to the row of the first rejection (the row that produced
        the newest token), and never past the run (a split proposal fully accepted has no bonus row)."""
        rows_before = self.num_scheduled - self.num_rows  # query positions without a logits row
        return self.num_computed + rows_before + np.minimum(self.num_accepted + 1, self.num_rows)

    @property
    def sampled_rows(self) -> np.ndarray:
        """int64[R] batch row of the position whose logits produced r's newest token (meaningful
        where sampled): the hidden state h_t that MLP speculator and Medusa heads read."""
        return self.token_start[:-1] + self.num_scheduled - self.num_rows + np.minimum(self.num_accepted,
                                                                                       self.num_rows - 1)

    def last_tokens(self, rows: np.ndarray) -> np.ndarray:  # int64[len(rows)] newest token of each request
        return np.fromiter((self.requests[r].token_at(self.requests[r].num_tokens - 1) for r in rows),
                           dtype=np.int64, count=len(rows))


class _Deterministic:
    """Marks a pending proposal whose drafts are deterministic (q = one-hot) although its request
    samples: a token tree of top-k children, possibly cut by the budget to a chain-shaped prefix
    that the chain verifier then checks. Slicing keeps the mark (a split proposal's rest)."""

    def __getitem__(self, _):
        return self

    def __repr__(self) -> str:
        return "DETERMINISTIC"


DETERMINISTIC = _Deterministic()


@dataclass(frozen=True)
class Proposal:
    core_ids: np.ndarray  # uint64[P] requests that got a (possibly empty) proposal
    cu_num_draft: np.ndarray  # int32[P + 1]
    draft_token_ids: np.ndarray  # int64[N]
    # per request Tensor[k_i, V] (the draft's q), or None: every draft is deterministic (q = one-hot),
    # which keeps rejection sampling lossless (model-free proposers and argmax heads). For a tree, row i
    # is the distribution node i was independently sampled from (SpecInfer MSS); None: deterministic
    # top-k children (verified with the one-hot variant)
    draft_probs: list | None
    # int32[N] token trees (docs/trees.md): parent of each draft among its request's drafts (-1: a
    # child of the request's last token); parents come before children, siblings in candidate order.
    # None: every proposal is a chain
    draft_parents: np.ndarray | None = None

    @classmethod
    def empty(cls) -> "Proposal":
        return cls(np.zeros(0, np.uint64), np.zeros(1, np.int32), np.zeros(0, np.int64), None)

    @classmethod
    def from_drafts(cls, core_ids: np.ndarray, drafts: np.ndarray, counts: np.ndarray) -> "Proposal":
        """drafts int64[P, K] (row j's first counts[j] tokens are its drafts); deterministic drafts."""
        counts = np.asarray(counts, dtype=np.int32)
        cu = np.zeros(len(counts) + 1, np.int32)
        np.cumsum(counts, out=cu[1:])
        keep = np.arange(drafts.shape[1])[None, :] < counts[:, None]
        return cls(np.asarray(core_ids, np.uint64), cu, drafts[keep].astype(np.int64), None)


class Proposer:
    """What every proposer is, declared rather than probed: the engine reads these attributes
    and calls these methods on any proposer; a subclass overrides what it uses."""

    num_lookahead_tokens: int = 0  # KV slots past the last query token the core must reserve
    kv_models: list = []  # models that keep a KV cache over the shared block tables (never mutated here)
    aux_layers: tuple = ()  # target layers whose inputs the proposer reads (TargetHidden.aux)
    sees_every_step: bool = False  # takes in every step's target states, drafting or not (EAGLE's draft KV)
    # proposes inside the Rust core from the tokens alone (n-gram lookup): where no policy, grammar
    # or pause shapes the budgets, the step hands it the scheduled requests and skips
    # ProposalInput (propose_in_core)
    drafts_in_core: bool = False
    reads_target_hidden: bool = True  # reads ProposalInput.hidden (else it is None)
    launches_proposals: bool = False  # launch_proposal() launches its forwards (else it returns None)

    def bind_kv_caches(self, kv_caches_per_model: list, backend) -> None:
        """The KV caches of `kv_models`, once allocated."""

    def bind_target_kv_caches(self, target_kv_caches: list) -> None:
        """The target's own KV caches, for a proposer that shares them (layer_skip)."""

    def bind_core(self, core) -> None:
        """The Rust core, for a proposer that proposes there (n-gram lookup)."""

    def propose(self, inp: ProposalInput) -> Proposal:
        raise NotImplementedError

    def launch_proposal(self, inp: ProposalInput, launch):
        """propose() with the forwards launched where the target's run and the tokens left there
        (spec_decode/launched_proposal.py) -> LaunchedProposal, or None: this proposer (or this
        input) proposes on the host, through propose()."""
        return None

    def propose_in_core(self, core_ids, k: int, budgets=None) -> int:
        """drafts_in_core proposers: set the drafts of the given requests in the core (those ready
        to decode, without a proposal; at most k, the platform's cap, each one's own limit and, where
        given, budgets[i]: a policy's choice); -> draft tokens set."""
        raise NotImplementedError

    def forget(self, core_ids) -> None:
        """Requests preempted or finished: drop whatever the proposer keeps for them."""
