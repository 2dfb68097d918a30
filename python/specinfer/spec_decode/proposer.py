"""The proposer protocol: what every speculative method gives the engine each step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


@dataclass
class ProposalInput:
    """What happened in this step, for the requests that may get drafts for the next one."""

    sched: object  # the Rust SchedulerOutput of this step
    states: list  # RequestState per scheduled request (sched order)
    sampled: np.ndarray  # bool[R] request got tokens this step (and is still running)
    speculate: np.ndarray  # bool[R] request wants drafts for the next step
    max_drafts: np.ndarray  # int64[R] most drafts useful for each request (k, clamped by its limits)
    block_rows: np.ndarray  # int32[R, W] each request's block table row
    target_hidden: torch.Tensor | None  # [T, hidden] target's final hidden states of this step
    catch_up: np.ndarray | None = None  # bool[R] requests whose proposer state must follow their
    # confirmed tokens this step (speculating, alive); None = every alive request


@dataclass
class Proposal:
    core_ids: np.ndarray  # uint64[P] requests that got a (possibly empty) proposal
    cu_num_draft: np.ndarray  # int32[P + 1]
    draft_token_ids: np.ndarray  # int64[N]
    draft_probs: list | None  # per request Tensor[k_i, V] (the draft's q), or None if model-free


class Proposer(Protocol):
    num_lookahead_tokens: int  # KV slots past the last query token the core must reserve
    kv_models: list  # models that keep a KV cache over the shared block tables

    def bind_kv_caches(self, kv_caches_per_model: list, backend) -> None: ...

    def propose(self, inp: ProposalInput) -> Proposal: ...

    def forget(self, core_ids) -> None:
        """Requests preempted or finished: drop whatever the proposer keeps for them."""
