"""The engine: one step = schedule (Rust) -> target forward -> sample/verify -> update (Rust)
-> propose drafts for the next step. Streaming and serving drive it through add_request/step."""
from __future__ import annotations

import itertools
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from specinfer._core import SchedulerCore
from specinfer.attention import get_backend
from specinfer.config import CacheConfig, SchedulerConfig
from specinfer.engine.batch import model_batch_from_schedule
from specinfer.engine.detokenizer import IncrementalDetokenizer
from specinfer.engine.kv_cache import allocate_kv_caches, budget_blocks, bytes_per_block, choose_num_blocks
from specinfer.engine.model_loading import load_any
from specinfer.engine.model_runner import ModelRunner
from specinfer.engine.request_state import RequestState
from specinfer.engine.step_sampler import StepSampler
from specinfer.models.int8_linear import check_quantization
from specinfer.outputs import RequestOutput
from specinfer.platform import resolve_dtype, resolve_platform
from specinfer.sampling_params import SamplingParams
from specinfer.spec_decode.config import SpeculativeConfig
from specinfer.spec_decode.metrics import SpecMetrics
from specinfer.spec_decode.proposer import ProposalInput
from specinfer.spec_decode.registry import proposer_class


@dataclass
class ProposerContext:
    target: object  # LoadedModel
    load_model: object  # callable(path_or_pack) -> LoadedModel with the engine's dtype/device
    block_size: int
    device: torch.device
    default_generator: torch.Generator


class LLMEngine:
    def __init__(self, model, *, dtype="auto", device="auto", max_model_len=None, block_size=16,
                 num_kv_blocks=None, max_num_seqs=256, max_num_batched_tokens=2048,
                 enable_prefix_caching=True, seed=0, speculative=None, quantization=None):
        cache_cfg = CacheConfig(block_size=block_size, num_kv_blocks=num_kv_blocks,
                                enable_prefix_caching=enable_prefix_caching)
        sched_cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                    max_model_len=max_model_len)
        self.spec = SpeculativeConfig.from_any(speculative)
        self.platform = resolve_platform(device)
        self.dtype = resolve_dtype(dtype, self.platform)
        self.quantization = check_quantization(quantization)  # weights of target and draft; KV stays dtype
        self.device = self.platform.device
        self.default_generator = torch.Generator(device="cpu").manual_seed(int(seed))

        def load(path):
            return load_any(path, dtype=self.dtype, device=self.device, platform=self.platform,
                            quantization=self.quantization)

        self.loaded = load(model)
        self.tokenizer = self.loaded.tokenizer
        self.vocab_size = self.loaded.config.vocab_size
        self.proposer = None
        if self.spec is not None:
            ctx = ProposerContext(self.loaded, load, cache_cfg.block_size, self.device, self.default_generator)
            self.proposer = proposer_class(self.spec.method)(self.spec, ctx)
        kv_models = [self.loaded.model] + (self.proposer.kv_models if self.proposer else [])
        self.block_size = cache_cfg.block_size
        budget = dict(block_bytes=bytes_per_block(kv_models, self.block_size, self.dtype),
                      available_bytes=self.platform.available_memory_bytes(),
                      memory_fraction=cache_cfg.kv_cache_memory_fraction, max_bytes=cache_cfg.kv_cache_max_bytes)
        self.max_model_len = self._max_model_len(sched_cfg.max_model_len, kv_models, cache_cfg, budget)
        self.num_kv_blocks = choose_num_blocks(
            cache_cfg.num_kv_blocks, block_size=self.block_size, max_model_len=self.max_model_len, **budget)
        backend = get_backend(self.platform.attention_backend)
        caches = [allocate_kv_caches(m, self.num_kv_blocks, self.block_size, self.dtype, self.device)
                  for m in kv_models]
        self.runner = ModelRunner(self.loaded.model, caches[0], backend)
        lookahead = 0
        if self.proposer is not None:
            self.proposer.bind_kv_caches(caches[1:], backend)
            lookahead = self.proposer.num_lookahead_tokens
        self.core = SchedulerCore(
            self.num_kv_blocks, self.block_size, sched_cfg.max_num_seqs, sched_cfg.max_num_batched_tokens,
            self.max_model_len, cache_cfg.enable_prefix_caching, lookahead,
            self.spec is not None and self.spec.scorer == "batch_expansion")
        if hasattr(self.proposer, "bind_core"):
            self.proposer.bind_core(self.core)
        self.step_sampler = StepSampler(self.spec, self.default_generator, self.loaded.eos_token_ids)
        self.metrics = SpecMetrics(self.spec.num_speculative_tokens if self.spec else 0)
        self.num_mixed_steps = 0  # steps where prefill chunks and verification runs shared a forward
        self._requests: dict[int, RequestState] = {}
        self._by_name: dict[str, int] = {}
        self._draft_probs: dict[int, torch.Tensor] = {}
        self._ids = itertools.count()

    # ------------------------------------------------------------------ requests
    def _max_model_len(self, requested, kv_models, cache_cfg, budget) -> int:
        limit = min(m.config.max_position_embeddings for m in [self.loaded.model, *kv_models[1:]])
        if requested is None:
            # the model's own limit, capped (with a warning) to what the KV pool can hold
            blocks = cache_cfg.num_kv_blocks or budget_blocks(**budget)
            fits = blocks * cache_cfg.block_size
            if fits < limit:
                warnings.warn(f"max_model_len capped at {fits} tokens (the model allows {limit}): that is what "
                              f"{blocks} KV blocks of {cache_cfg.block_size} tokens hold; set max_model_len or "
                              "num_kv_blocks to choose", stacklevel=4)
                return int(fits)
            return int(limit)
        if requested > limit:
            raise ValueError(f"max_model_len={requested} exceeds the model's max_position_embeddings ({limit})")
        return int(requested)

    def validate(self, prompt, params: SamplingParams) -> list[int]:
        """Tokenize and check one request; raises ValueError naming the field. No side effects."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams (got {type(params).__name__})")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            ids = self.encode(prompt)
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            ids = [int(t) for t in prompt]
            if any(t < 0 or t >= self.vocab_size for t in ids):
                bad = next(t for t in ids if t < 0 or t >= self.vocab_size)
                raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        else:
            raise ValueError(f"prompt must be a str or a list of token ids (got {type(prompt).__name__})")
        if not ids:
            raise ValueError("prompt is empty (no tokens)")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len={self.max_model_len} leaves no room "
                             "to generate")
        if params.stop_token_ids and any(t >= self.vocab_size for t in params.stop_token_ids):
            raise ValueError(f"SamplingParams.stop_token_ids holds ids outside the vocabulary [0, {self.vocab_size})")
        return ids

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids  # the loader makes encode add BOS iff the model wants it

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    prompt_token_ids: list[int] | None = None) -> None:
        params = params or SamplingParams()
        if request_id in self._by_name:
            raise ValueError(f"request_id {request_id!r} is already in use")
        ids = prompt_token_ids if prompt_token_ids is not None else self.validate(prompt, params)
        core_id = next(self._ids)
        eos = self.loaded.eos_token_ids
        stop_ids = list(params.stop_token_ids or ()) + list(eos[1:])
        self.core.add_request(core_id, np.asarray(ids, dtype=np.int64), params.max_tokens, params.min_tokens,
                              eos[0] if eos else -1, params.ignore_eos, stop_ids)
        gen = torch.Generator(device="cpu").manual_seed(params.seed) if params.seed is not None else None
        st = RequestState(request_id, core_id, prompt if isinstance(prompt, str) else None, list(ids), params,
                          IncrementalDetokenizer(self.tokenizer, params.stop), gen,
                          logprobs=[] if params.logprobs is not None else None)
        self._requests[core_id] = st
        self._by_name[request_id] = core_id

    def abort(self, request_id: str) -> RequestOutput | None:
        core_id = self._by_name.pop(request_id, None)
        if core_id is None:
            return None
        self.core.abort_request(core_id)
        st = self._requests.pop(core_id)
        st.finish("abort")
        self._forget([core_id])
        return st.to_output()

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def spec_metrics(self) -> dict:
        return self.metrics.as_dict()

    def reset_metrics(self) -> None:
        """Start the engine-level speculation metrics afresh (e.g. after a warm-up run)."""
        self.metrics = SpecMetrics(self.metrics.k)
        self.num_mixed_steps = 0

    # ------------------------------------------------------------------ the step
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """Run one step; return outputs of the requests it touched (only finished ones when
        final_only, which spares building cumulative outputs for every running request)."""
        t0 = time.perf_counter()
        sched = self.core.schedule()
        if len(sched.preempted_req_ids):
            self._forget(sched.preempted_req_ids.tolist(), keep_states=True)
        R = len(sched.req_ids)
        if R == 0:
            return []
        states = [self._requests[i] for i in sched.req_ids.tolist()]
        for st, cached in zip(states, sched.num_cached_tokens.tolist()):
            st.num_cached_tokens = max(st.num_cached_tokens, cached)
        if sched.num_verify_requests and sched.num_prefill_requests:
            self.num_mixed_steps += 1
        batch = model_batch_from_schedule(sched, self.block_size, self.device)
        hidden, _ = self.runner.forward(batch.input_ids, batch.positions, batch.attn)
        logits = self.runner.logits(hidden[batch.logits_indices])
        t1 = time.perf_counter()
        emitted = self.step_sampler(logits, sched, states, self._draft_probs)
        t2 = time.perf_counter()
        self._record_spec(sched, states, emitted)
        upd = self.core.update(emitted.token_ids, emitted.cu_num_emitted)
        outputs = self._apply_update(sched, states, emitted, upd, final_only)
        t3 = time.perf_counter()
        if self.proposer is not None:
            self._propose(sched, states, emitted, hidden)
        t4 = time.perf_counter()
        m = self.metrics
        m.score_s += t1 - t0
        m.verify_s += t2 - t1
        m.propose_s += t4 - t3
        m.total_s += t4 - t0
        m.num_steps += 1
        return outputs

    def _record_spec(self, sched, states, emitted) -> None:
        if not emitted.num_draft_tokens.any():
            return
        self.metrics.record(emitted.num_draft_tokens, emitted.num_accepted)
        for st, d, a in zip(states, emitted.num_draft_tokens.tolist(), emitted.num_accepted.tolist()):
            if d:
                st.num_drafts += 1
                st.num_draft_tokens += d
                st.num_accepted_tokens += a

    def _apply_update(self, sched, states, emitted, upd, final_only) -> list[RequestOutput]:
        row_of = {cid: r for r, cid in enumerate(sched.req_ids.tolist())}
        touched = []
        cu = upd.cu_num_new
        new = upd.new_token_ids
        for j, cid in enumerate(upd.req_ids.tolist()):
            st = self._requests[cid]
            toks = new[cu[j]:cu[j + 1]].tolist()
            lps = emitted.logprobs[row_of[cid]]
            if st.append(toks, lps):  # a stop string matched
                self.core.finish_request(cid)
            touched.append(cid)
        for cid, reason, tok in zip(upd.finished_req_ids.tolist(), upd.finish_reasons, upd.stop_token.tolist()):
            st = self._requests[cid]
            if not st.finished:
                st.finish(reason, tok if tok >= 0 else None)
            if cid not in touched:
                touched.append(cid)
        outputs = []
        done = []
        for cid in touched:
            st = self._requests[cid]
            if st.finished:
                done.append(cid)
            if st.finished or not final_only:
                outputs.append(st.to_output())
        for cid in done:
            st = self._requests.pop(cid)
            self._by_name.pop(st.request_id, None)
        if done:
            self._forget(done)
        return outputs

    def _forget(self, core_ids, keep_states: bool = False) -> None:
        for cid in core_ids:
            self._draft_probs.pop(cid, None)
        if self.proposer is not None:
            self.proposer.forget(core_ids)

    def _propose(self, sched, states, emitted, hidden) -> None:
        R = len(states)
        alive = np.array([not st.finished for st in states])
        sampled = (np.diff(emitted.cu_num_emitted) > 0) & alive
        disabled = (self.spec.disable_by_batch_size is not None
                    and self.core.num_running() >= self.spec.disable_by_batch_size)
        for st in states:  # drafts verified this step are spent; unscheduled requests keep theirs
            self._draft_probs.pop(st.core_id, None)
        if disabled:
            return
        k = self.spec.num_speculative_tokens
        max_drafts = np.zeros(R, dtype=np.int64)
        for r, st in enumerate(states):
            out_left = st.params.max_tokens - len(st.output_token_ids) - 1
            len_left = self.max_model_len - st.num_tokens - 1
            max_drafts[r] = max(0, min(k, out_left, len_left))
        speculate = sampled & np.array([st.params.speculate for st in states]) & (max_drafts > 0)
        rows = _request_block_rows(sched)
        inp = ProposalInput(sched, states, sampled, speculate, max_drafts, rows, hidden)
        prop = self.proposer.propose(inp)
        if len(prop.core_ids) == 0:
            return
        self.core.set_draft_tokens(prop.core_ids, prop.cu_num_draft, prop.draft_token_ids)
        if prop.draft_probs is not None:
            for cid, q in zip(prop.core_ids.tolist(), prop.draft_probs):
                if q is not None:
                    self._draft_probs[cid] = q


def _request_block_rows(sched) -> np.ndarray:
    """int32[R, W]: each request's block-table row (its first query sequence's row)."""
    seq_req = np.asarray(sched.seq_req_indices)
    first = np.searchsorted(seq_req, np.arange(len(sched.req_ids)))
    return np.asarray(sched.block_table)[first]
