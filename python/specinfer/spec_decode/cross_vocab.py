"""A draft model with another tokenizer (`method="draft_model"` when the vocabularies differ).

The draft runs in an engine of its own (its own KV pool, prefix cache, chunked prefill and
preemption), batched across requests. Each step, for every request that may draft:
1. its text so far, decoded from the target's tokens, is tokenized with the draft's tokenizer
   (the draft's prefix cache holds every full block of the previous step's context, so only the
   tail is computed again);
2. the draft continues it greedily for k of its own tokens (all requests in one batch);
3. the continuation's text is tokenized with the target's tokenizer at the boundary: the last
   target token(s) are re-encoded together with the continuation and the proposal is what
   follows them, when the re-encoding keeps them unchanged (a merge across the boundary gives no
   proposal that step). The target's tokenization is the one verified.

Lossless at any temperature: the drafts are a deterministic function of the context (greedy
draft, fixed tokenization), i.e. q is one-hot, and rejection sampling with a one-hot q keeps the
target's law (tests/test_cross_vocab_draft.py checks it with a chi-square test). Chains only (a
token tree would need the draft's branching mapped across vocabularies).
"""
from __future__ import annotations

import numpy as np

from specinfer.sampling_params import SamplingParams
from specinfer.spec_decode.proposer import Proposal, ProposalInput, Proposer

BOUNDARY_TOKENS = (2, 1)  # target tokens re-encoded with the continuation, tried in this order
WINDOW = 8  # draft context tokens decoded before the continuation, for its exact text


class CrossVocabDraftProposer(Proposer):
    kv_models: list = []  # the draft's KV lives in its own engine
    num_lookahead_tokens = 0
    aux_layers = ()

    def __init__(self, spec, ctx, draft_path: str):
        if spec.token_tree is not None:
            raise ValueError("speculative.token_tree: a draft model with another tokenizer drafts chains only")
        self.k = spec.num_speculative_tokens
        self.target_tok = ctx.target.tokenizer
        self.engine = ctx.make_engine(draft_path, dtype=ctx.target.model.norm.dtype, device=ctx.device,
                                      block_size=ctx.block_size, max_num_batched_tokens=ctx.max_num_batched_tokens,
                                      overlap_steps=False, seed=0)
        self.draft_tok = self.engine.tokenizer
        self._names = 0
        self.num_boundary_misses = 0  # proposals dropped: the re-encoding changed the boundary

    def bind_kv_caches(self, kv_caches_per_model, backend) -> None:
        pass

    def propose(self, inp: ProposalInput) -> Proposal:
        rows = np.flatnonzero(inp.max_drafts > 0)
        if len(rows) == 0:
            return Proposal.empty()
        eng = self.engine
        names, contexts = {}, {}
        with eng.lock:
            for r in rows.tolist():
                st = inp.requests[r]
                text = self.target_tok.decode(st.prompt_token_ids + st.output_token_ids, skip_special_tokens=False)
                ids = eng.encode(text)[-(eng.max_model_len - self.k - 1):]
                name = f"x{self._names}"
                self._names += 1
                k = int(min(self.k, inp.max_drafts[r]))
                eng.add_request(name, None, SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True),
                                prompt_token_ids=ids)
                names[name] = r
                contexts[r] = ids[-WINDOW:]
            drafted = {}
            while len(drafted) < len(names):
                for out in eng.step(final_only=True):
                    if out.finished and out.request_id in names:
                        drafted[names[out.request_id]] = out.token_ids
        cu, tokens = [0], []
        for r in rows.tolist():
            toks = self._to_target(inp.requests[r], contexts[r], drafted.get(r, []), int(inp.max_drafts[r]))
            tokens.extend(toks)
            cu.append(len(tokens))
        return Proposal(inp.core_ids[rows], np.asarray(cu, np.int32), np.asarray(tokens, np.int64), None)

    def _to_target(self, st, context, draft_ids, k: int) -> list[int]:
        """The draft's continuation as target tokens after the request's last ones (<= k).
        Its text is what decoding it after the context's last draft tokens adds (a decoder may
        join tokens with spaces or merge bytes across them)."""
        if not draft_ids:
            return []
        before = self.draft_tok.decode(list(context), skip_special_tokens=False)
        after = self.draft_tok.decode(list(context) + list(draft_ids), skip_special_tokens=False)
        if not after.startswith(before):
            self.num_boundary_misses += 1
            return []
        cont = after[len(before):]
        full = st.prompt_token_ids + st.output_token_ids
        for n in BOUNDARY_TOKENS:
            tail = full[-n:]
            if len(tail) < n:
                continue
            tail_text = self.target_tok.decode(tail, skip_special_tokens=False)
            enc = self.target_tok.encode(tail_text + cont, add_special_tokens=False).ids
            if enc[:n] == tail:
                return enc[n:n + k]
        self.num_boundary_misses += 1
        return []

    def forget(self, core_ids) -> None:
        pass  # the draft engine's requests live one step

    def close(self) -> None:
        self.engine.close()
