"""Proposers whose head reads the target's final hidden state h_t at the sampled position (the
state whose lm_head output produced the newest token x_{t+1}) and drafts x_{t+2}, x_{t+3}, ...
in one go: MLP speculator and Medusa. No KV, nothing kept per request, no extra target forward.

A head is a sequence of stages (`DraftHead`): stage i gives the logits of x_{t+2+i} from a state
and the token drafted before it (Medusa's heads ignore both; the MLP speculator's stages chain).

- Greedy requests draft each stage's argmax (deterministic: q = one-hot).
- Requests with temperature > 0 draw each draft from the stage's distribution after the request's
  own temperature / top-k / top-p / min-p processing (as the target's), by inverse CDF with the
  counter draw ``U(seed, output position, DRAFT)``; those probabilities are the q of lossless
  rejection sampling (`Proposal.draft_probs`).
- With a static `token_tree` every request gets the tree's top-k children instead (see
  `head_tree.py`; deterministic, `draft_probs` None, verified with the one-hot variant; a
  proposal that is a chain, e.g. a tree cut to one node, carries one-hot q rows for sampling
  requests, since the chain verifier needs q).
Typical acceptance works with all of these (it ignores q).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Protocol

import numpy as np
import torch

from specinfer.sample.request_rows import all_greedy, sampling_metadata
from specinfer.sample import probs_from_logits
from specinfer.sample.random_streams import DRAFT, sample_from_weights
from specinfer.spec_decode.head_tree import check_tree, draft_tree
from specinfer.spec_decode.proposer import Proposal, ProposalInput, Proposer
from specinfer.spec_decode.token_tree import StaticTree, is_chain


class DraftHead(Protocol):
    num_stages: int  # tokens the head can draft (Medusa: heads; MLP speculator: n_predict)
    vocab_size: int  # V, the target's vocabulary (width of the stages' logits)
    draft_vocab_size: int  # tokens a stage ranks (Medusa with token_map: V_t; else the target's V)
    reads_parent: bool  # False: stage i's logits depend on neither state nor token (Medusa)

    def start(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """hidden [P, H] (h_t), tokens int64[P] (x_{t+1}) -> state [P, S] entering stage 0."""

    def stage(self, i: int, state: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """state [P, S], tokens int64[P] (the token before) -> (state [P, S] after stage i,
        logits [P, V] over the target's vocabulary; -inf where the head cannot draft)."""


def argmax_choice(i: int, logits: torch.Tensor) -> torch.Tensor:  # [P, V] -> int64[P]
    return logits.argmax(-1)


def draft_chain(head: DraftHead, hidden: torch.Tensor, tokens: torch.Tensor, steps: int,
                choose: Callable[[int, torch.Tensor], torch.Tensor] = argmax_choice) -> torch.Tensor:
    """hidden [P, H] (h_t), tokens int64[P] (x_{t+1}) -> int64[P, steps]: draft i = choose(i,
    stage i's logits), fed to stage i + 1."""
    state, y = head.start(hidden, tokens), tokens
    out = []
    for i in range(steps):
        state, logits = head.stage(i, state, y)
        y = choose(i, logits)
        out.append(y)
    return torch.stack(out, dim=1)


class HiddenStateHeadProposer(Proposer):
    kv_models: list = []
    aux_layers = ()
    num_lookahead_tokens = 0

    def __init__(self, head: DraftHead, k: int, tree: StaticTree | None = None):
        self.head = head
        self.k = k
        self.tree = tree

    @classmethod
    def check_k(cls, k: int, most: int, what: str, model: str) -> None:
        if k > most:
            raise ValueError(f"speculative.num_speculative_tokens={k} exceeds what the {what} at {model!r} predicts "
                             f"({most}); use at most {most}")

    @staticmethod
    def check_tree(tree, head: DraftHead, what: str, model: str) -> None:
        if tree is not None:
            check_tree(tree, head.num_stages, head.draft_vocab_size, what, model)

    def bind_kv_caches(self, kv_caches_per_model, backend) -> None:
        pass

    def forget(self, core_ids) -> None:
        pass

    @torch.inference_mode()
    def propose(self, inp: ProposalInput) -> Proposal:
        rows = np.flatnonzero(inp.max_drafts > 0)
        if len(rows) == 0:
            return Proposal.empty()
        limit = inp.max_drafts[rows]
        final = inp.hidden.final
        hidden = final[torch.from_numpy(inp.sampled_rows[rows]).to(final.device)]  # [P, H]
        tokens = torch.from_numpy(inp.last_tokens(rows)).to(final.device)  # int64[P] x_{t+1}
        states = [inp.requests[r] for r in rows]
        if self.tree is not None:
            return self._propose_tree(inp.core_ids[rows], states, hidden, tokens, limit)
        # draft i decides the request's output position len(output) + i
        steps = int(limit.max())
        meta = None if all_greedy(states) else sampling_metadata(
            states, device=final.device, positions=[len(s.output_token_ids) for s in states])
        if meta is None or meta.all_greedy:
            drafts = draft_chain(self.head, hidden, tokens, steps)
            return Proposal.from_drafts(inp.core_ids[rows], drafts.cpu().numpy(), limit)
        drafts, probs = self._sample_chain(hidden, tokens, steps, meta)
        prop = Proposal.from_drafts(inp.core_ids[rows], drafts.cpu().numpy(), limit)
        greedy = meta.is_greedy.tolist()
        q = [None if greedy[j] else probs[j, :n] for j, n in enumerate(limit.tolist())]
        return dataclasses.replace(prop, draft_probs=q)

    def _sample_chain(self, hidden, tokens, steps, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """-> drafts int64[P, steps], q [P, steps, V]: greedy rows take the argmax (q one-hot), the
        others a draw from the processed distribution with U(seed, position + i, DRAFT)."""
        u = meta.streams.uniform(DRAFT, steps, hidden.device)  # float64[P, steps]
        greedy = meta.is_greedy
        probs = []

        def choose(i, logits):  # logits [P, V]
            p = probs_from_logits(logits, meta)  # [P, V] q, one-hot on greedy rows
            probs.append(p)
            return torch.where(greedy, logits.argmax(-1), sample_from_weights(p, u[:, i]))

        drafts = draft_chain(self.head, hidden, tokens, steps, choose)
        return drafts, torch.stack(probs, dim=1)

    def _propose_tree(self, core_ids, states, hidden, tokens, limit) -> Proposal:
        """Every request gets the tree's first min(N, limit) nodes (still a tree), without q. A
        request whose nodes form a chain is verified as a chain, which needs q when it samples:
        its deterministic drafts get q = one-hot rows."""
        nodes = draft_tree(self.head, hidden, tokens, self.tree).cpu().numpy()  # int64[P, N]
        counts = np.minimum(limit, self.tree.num_nodes).astype(np.int32)
        prop = Proposal.from_drafts(core_ids, nodes, counts)
        per_request = [self.tree.parents[:n] for n in counts]
        q = [torch.nn.functional.one_hot(torch.from_numpy(nodes[j, :n]), self.head.vocab_size).float()
             if is_chain(per_request[j]) and st.params.temperature != 0.0 else None
             for j, (st, n) in enumerate(zip(states, counts.tolist()))]
        return dataclasses.replace(prop, draft_probs=None if all(x is None for x in q) else q,
                                   draft_parents=np.concatenate(per_request).astype(np.int32))


def checkpoint_dir(model: str) -> Path:
    path = Path(model)
    if not path.is_dir():
        raise FileNotFoundError(f"speculative.model {model!r} is not a directory holding a head checkpoint")
    return path
