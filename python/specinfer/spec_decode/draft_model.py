"""Draft-model proposer: a smaller LM with the target's tokenizer drafts k tokens per request.

Its KV cache lives in the same paged blocks as the target's (same block tables and slots).
Each step it first catches up on every token the target confirmed that it has not yet seen
(prefill chunks of this step, accepted drafts, the recovered/bonus token — or a whole history
after a pause), in one batched forward whose last rows give the first draft; then k - 1
batched single-token forwards give the rest. Positions it writes past the confirmed tokens sit
in the lookahead slots the core reserved; rejected ones are simply overwritten later.
"""
from __future__ import annotations

import numpy as np
import torch

from specinfer.engine.batch import attention_metadata_for_runs
from specinfer.engine.model_runner import ModelRunner
from specinfer.engine.step_sampler import sampling_metadata
from specinfer.sample import probs_from_logits
from specinfer.sample.noise import draw_exponential, exponential_race
from specinfer.spec_decode.proposer import Proposal, ProposalInput


class DraftModelProposer:
    def __init__(self, spec, ctx):
        self.k = spec.num_speculative_tokens
        self.loaded = ctx.load_model(spec.model)
        _check_same_vocabulary(ctx.target, self.loaded, spec.model)
        self.kv_models = [self.loaded.model]
        self.num_lookahead_tokens = self.k
        self.block_size = ctx.block_size
        self.device = ctx.device
        self.default_generator = ctx.default_generator
        self.make_runner = ctx.make_runner
        self.runner: ModelRunner | None = None
        self.num_seen: dict[int, int] = {}  # core id -> tokens whose draft KV is written

    def bind_kv_caches(self, kv_caches_per_model, backend) -> None:
        self.runner = self.make_runner(self.loaded.model, kv_caches_per_model[0], backend)

    def forget(self, core_ids) -> None:
        for i in core_ids:
            self.num_seen.pop(int(i), None)

    def propose(self, inp: ProposalInput) -> Proposal:
        sched = inp.sched
        R = len(inp.states)
        num_computed = np.asarray(sched.num_computed_tokens, dtype=np.int64)
        scheduled = np.asarray(sched.num_scheduled_tokens, dtype=np.int64)
        starts = np.empty(R, np.int64)
        ends = np.empty(R, np.int64)
        for r, st in enumerate(inp.states):
            if st.finished:
                starts[r] = ends[r] = 0
                continue
            starts[r] = self.num_seen.get(st.core_id, num_computed[r])
            # confirmed tokens: through the new token when sampled, else the prefill chunk
            ends[r] = st.num_tokens if inp.sampled[r] else num_computed[r] + scheduled[r]
        live = np.flatnonzero(ends > starts)
        if len(live) == 0:
            return _empty()
        tokens = np.fromiter((t for r in live for t in inp.states[r].tokens_slice(starts[r], ends[r])),
                             dtype=np.int64)
        attn, positions = attention_metadata_for_runs(inp.block_rows[live], starts[live], ends[live] - starts[live],
                                                      self.block_size, self.device)
        hidden, _ = self.runner.forward(torch.from_numpy(tokens).to(self.device),
                                        torch.from_numpy(positions).to(self.device), attn)
        for r in live:
            self.num_seen[inp.states[r].core_id] = int(ends[r])
        drafting = inp.speculate[live] & (inp.max_drafts[live] > 0)
        if not drafting.any():
            return _empty()
        last_rows = (np.cumsum(ends[live] - starts[live]) - 1)[drafting]
        rows = live[drafting]
        logits = self.runner.logits(hidden[torch.from_numpy(last_rows).to(self.device)])
        return self._draft(inp, rows, ends[rows], logits)

    def _draft(self, inp, rows, next_pos, logits) -> Proposal:
        states = [inp.states[r] for r in rows]
        limit = inp.max_drafts[rows]
        meta = sampling_metadata(states, device=self.device)
        want_probs = not meta.all_greedy
        steps = int(limit.max())
        drafted = np.zeros((len(rows), steps), dtype=np.int64)
        probs_out = []
        active = np.arange(len(rows))
        for i in range(steps):
            tok, probs = self._sample(logits, meta, active, want_probs)
            drafted[active, i] = tok.cpu().numpy()
            probs_out.append((active, probs))
            active = active[limit[active] > i + 1]
            if i + 1 == steps or len(active) == 0:
                break
            positions = next_pos[active] + i
            attn, _ = attention_metadata_for_runs(inp.block_rows[rows[active]], positions,
                                                  np.ones(len(active), np.int64), self.block_size, self.device)
            pos_t = torch.from_numpy(positions).to(self.device)
            tok_t = torch.from_numpy(drafted[active, i]).to(self.device)
            hidden, _ = self.runner.forward(tok_t, pos_t, attn)
            logits = self.runner.logits(hidden)
        counts = limit.astype(np.int32)
        cu = np.zeros(len(rows) + 1, np.int32)
        np.cumsum(counts, out=cu[1:])
        flat = np.concatenate([drafted[j, : counts[j]] for j in range(len(rows))])
        q = None
        if want_probs:
            q = _gather_probs(probs_out, len(rows), counts)
        return Proposal(np.asarray([s.core_id for s in states], np.uint64), cu, flat, q)

    def _sample(self, logits, meta, active, want_probs):
        sub = _take_rows(meta, active)
        if not want_probs:
            return logits.argmax(-1), None
        probs = probs_from_logits(logits, sub)  # [A, V], the draft's q for each row
        noise = draw_exponential((~sub.is_greedy).tolist(), probs.shape[1], sub.generators,
                                 self.default_generator, probs.dtype, probs.device)
        tok = torch.where(sub.is_greedy, logits.argmax(-1), exponential_race(probs, noise))
        return tok, probs


def _take_rows(meta, idx):
    if len(idx) == meta.num_rows:
        return meta
    t = torch.from_numpy(idx)
    return type(meta).build(meta.temperature[t], meta.top_k[t], meta.top_p[t], meta.min_p[t],
                            [meta.generators[i] for i in idx])


def _gather_probs(probs_out, n, counts):
    per = [[] for _ in range(n)]
    for active, probs in probs_out:
        for j, a in enumerate(active.tolist()):
            if len(per[a]) < counts[a]:
                per[a].append(probs[j])
    return [torch.stack(p) if p else None for p in per]


def _empty() -> Proposal:
    return Proposal(np.zeros(0, np.uint64), np.zeros(1, np.int32), np.zeros(0, np.int64), None)


def _check_same_vocabulary(target, draft, name) -> None:
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    t_tok, d_tok = target.tokenizer, draft.tokenizer
    same = t_tok.get_vocab_size(with_added_tokens=True) == d_tok.get_vocab_size(with_added_tokens=True)
    if same:
        same = t_tok.get_vocab(with_added_tokens=True) == d_tok.get_vocab(with_added_tokens=True)
    if not same or tv != dv:
        raise ValueError(
            f"speculative.model {name!r}: the draft's vocabulary differs from the target's "
            f"(embedding rows {dv} vs {tv}; tokenizers {'match' if same else 'differ'}); "
            "a draft model must share the target's tokenizer")
