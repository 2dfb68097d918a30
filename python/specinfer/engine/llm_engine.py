"""The engine: one step = schedule (Rust) -> target forward -> sample/verify -> update (Rust)
-> propose drafts for the next step. Streaming and serving drive it through add_request/step.

A step is a transaction: any exception (BaseException: Ctrl-C too) between schedule() and
update() cancels the step in the core (core.cancel_step) and is re-raised; every request then
stands where it stood before the step, so a retry replays it exactly (randomness is
counter-based, see specinfer.sample.random_streams). Once update() has committed, the Python
states take the same tokens with Ctrl-C held back (executor/interrupts.py); if the proposer
fails afterwards, the step's outputs are kept for the next step() call and the proposer forgets
the step's requests (it rebuilds its state from their confirmed tokens). The engine is one
thread's at a time: step(), add_request() and abort() take one lock.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import threading
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from specinfer._core import SchedulerCore
from specinfer.config import EngineConfig, options_doc
from specinfer.attention.batch_metadata import model_batch_from_schedule
from specinfer.engine.detokenizer import IncrementalDetokenizer
from specinfer.engine.kv_budget import activation_bytes, budget_blocks, bytes_per_block, choose_num_blocks
from specinfer.loader.model_loading import resolve_quantization
from specinfer.engine.propose_step import StepProposing
from specinfer.engine.request_state import RequestState
from specinfer.engine.step_grammar import StepGrammar
from specinfer.engine.step_sampler import StepSampler
from specinfer.engine.step_transaction import StepTransaction
from specinfer.structured.grammar import GrammarCompiler
from specinfer.executor import check_parallel_support, make_executor, shutdown_executor_on_error
from specinfer.models.int8_linear import check_quantization
from specinfer.outputs import RequestOutput
from specinfer.platform import EngineLimits, resolve_dtype, resolve_platform
from specinfer.sampling_params import SamplingParams, is_int
from specinfer.spec_decode.metrics import SpecMetrics
from specinfer.spec_decode.policy import GoodputPolicy
from specinfer.spec_decode.ngram_first import NgramFirstProposer
from specinfer.spec_decode.registry import proposer_class


def _head_checkpoint(path):
    """A draft head's checkpoint directory, or a clear error (a named head is not one here)."""
    if isinstance(path, (str, os.PathLike)) and not os.path.exists(path):
        raise ValueError(f"speculative.model {str(path)!r} is not a checkpoint directory. A named head (trained once "
                         "on this machine, e.g. 'smollm2-135m-eagle') is resolved by Generator and the CLI; to "
                         "build an LLMEngine yourself, pass the directory that "
                         "specinfer.training.trained_heads.resolve_head(name, method, target) returns")
    return path


@dataclass
class ProposerContext:
    target: object  # LoadedModel
    load_model: object  # callable(path_or_pack) -> LoadedModel with the engine's dtype/device
    block_size: int
    device: torch.device
    max_num_batched_tokens: int  # the most tokens a proposer's catch-up forward may take per step
    make_runner: object  # callable(model, kv_caches, backend) -> ModelRunner: the platform's runner
    # callable(model, kv_caches, backend) -> an eager runner passing model kwargs (exit_layer) through;
    # over every rank of the model's group under tensor parallelism
    make_eager_runner: object = None
    # callable(method, path) -> the draft head's handle (executor/head_handle.py): loaded over the
    # target, sharded over the target's ranks under tensor parallelism
    load_head: object = None
    # callable(path, **options) -> an engine of its own over another model (a draft with another
    # tokenizer runs one: spec_decode/cross_vocab.py); proposers never import the engine
    make_engine: object = None


class LLMEngine:
    """The step loop over one target model (and a proposer): `LLMEngine(model, **options)` or
    `LLMEngine(EngineConfig)`. The options are EngineConfig's (specinfer/config.py):

{options}
    `speculative`: a SpeculativeConfig, a dict of its fields, or None.
    """

    @shutdown_executor_on_error
    def __init__(self, model, **options):
        if isinstance(model, EngineConfig):
            if options:
                raise TypeError(f"LLMEngine(EngineConfig) takes no other options (got {sorted(options)}); "
                                "use config.replace(...)")
            config = model
        else:
            config = EngineConfig.create(model, **options)
        self.config = config
        model_cfg, cache_cfg, sched_cfg = config.model, config.cache, config.scheduler
        if model_cfg.threads is not None:
            torch.set_num_threads(model_cfg.threads)  # process-wide, as the option says
        self.max_logprobs = model_cfg.max_logprobs  # SamplingParams.logprobs above this is refused (vLLM: 20)
        self.cache_config = cache_cfg
        self.spec = config.speculative
        self.parallel = config.parallel
        check_parallel_support(self.parallel, self.spec)
        self.platform = resolve_platform(model_cfg.device)
        attention_backend = self.platform.choose_attention_backend(model_cfg.attention_backend)  # before any load
        dtype = model_cfg.dtype
        self.dtype = resolve_dtype(dtype, self.platform)
        # weights of target and draft ("auto": a .gguf file's tensors as stored on CPU); KV stays dtype
        tp = self.parallel.tensor_parallel_size

        def weights_for(path, setting):
            return resolve_quantization(setting, path, self.platform.device, dtype=dtype, tensor_parallel_size=tp)

        quantization = model_cfg.quantization
        self.quantization = weights_for(model_cfg.model, quantization)
        batch_invariant = model_cfg.batch_invariant
        if batch_invariant:
            if self.parallel.tensor_parallel_size > 1:
                raise ValueError("batch_invariant=True runs with tensor_parallel_size=1 only")
            self.platform.check_batch_invariant(self.dtype, self.quantization)
        self.platform.batch_invariant = self.batch_invariant = batch_invariant  # read by prepare_model
        self.device = self.platform.device
        # seeds for requests without one: drawn in add order from the engine's seed
        self._seed_source = np.random.Generator(np.random.PCG64(int(model_cfg.seed)))

        # the target (sharded over its ranks under tensor parallelism) runs through the executor
        self.executor = make_executor(self.parallel, self.platform)

        # a draft model's or head's weights: the target's quantization unless speculative.quantization says
        # (a draft model: as the target's setting says for its own file, e.g. "auto" keeps a .gguf draft stored)
        draft_setting = quantization
        if self.spec is not None and self.spec.quantization is not None:
            draft_setting = check_quantization(self.spec.quantization)
        if self.spec is not None and self.spec.draft_tensor_parallel_size:
            tp = self.spec.draft_tensor_parallel_size
        draft_quant = self.quantization if draft_setting in ("auto", "gguf") else draft_setting
        # heads keep weight-only int8 under a "w8a8" target (their drafts are verified either way); heads
        # are dense checkpoints, never GGUF
        head_quant = {"w8a8": "int8", "gguf": None}.get(draft_quant, draft_quant)
        if (self.spec is not None and self.spec.quantization is None and self.quantization in (None, "gguf")
                and self.device.type == "cpu" and self.dtype == torch.float32):
            head_quant = "auto"  # a float32 target on CPU: int8 heads where they fit (head_quantization.py)

        def load(path, role="target"):
            quant = self.quantization if role == "target" else weights_for(path, draft_setting)
            return self.executor.load_model(path, role, dtype=self.dtype, quantization=quant)

        self.loaded = load(model_cfg.model)
        self.tokenizer = self.loaded.tokenizer
        self.vocab_size = self.loaded.config.vocab_size
        self.proposer = None
        _check_trees_fit_windows(self.spec, self.loaded.config)
        if self.spec is not None:
            ctx = ProposerContext(self.loaded, lambda path: load(path, "draft"), cache_cfg.block_size, self.device,
                                  sched_cfg.max_num_batched_tokens,
                                  lambda m, kv, be: self.executor.make_runner(m, kv, be, self._limits),
                                  self.executor.make_eager_runner,
                                  lambda method, path: self.executor.load_head(
                                      method, _head_checkpoint(path), self.loaded,
                                      dtype=self.loaded.model.norm.dtype, quantization=head_quant),
                                  lambda path, **options: type(self)(path, **options))
            self.proposer = proposer_class(self.spec.method)(self.spec, ctx)
            if self.spec.ngram_first:  # prompt lookup where the history repeats, the model elsewhere
                self.proposer = NgramFirstProposer(self.proposer, self.spec)
        kv_models = [self.loaded.model] + (self.proposer.kv_models if self.proposer else [])
        self.block_size = cache_cfg.block_size
        k = self.spec.num_draft_slots if self.spec else 0  # drafts verified per request and step
        reserve = activation_bytes([m.config for m in kv_models], sched_cfg.max_num_batched_tokens,
                                   sched_cfg.max_num_seqs * (1 + k), self.dtype)
        budget = dict(block_bytes=bytes_per_block(kv_models, self.block_size, self.dtype),
                      **self.platform.memory_budget(cache_cfg, reserve).as_kwargs())
        self.max_model_len = self._max_model_len(sched_cfg.max_model_len, kv_models, cache_cfg, budget)
        self.num_kv_blocks = choose_num_blocks(
            cache_cfg.num_kv_blocks, block_size=self.block_size, max_model_len=self.max_model_len, **budget)
        self._limits = limits = EngineLimits(sched_cfg.max_num_seqs, sched_cfg.max_num_batched_tokens,
                                             self.max_model_len, self.block_size, k,
                                             self.spec.scorer if self.spec else "mqa",
                                             bool(self.spec and self.spec.drafts_trees))
        backend = self.platform.make_attention_backend(attention_backend, limits)
        num_cache_blocks = self.num_kv_blocks + self.platform.num_null_blocks  # null block: padded rows' K/V
        caches = self.executor.allocate_kv_caches(kv_models, num_cache_blocks, self.block_size, self.dtype,
                                                  attention_backend, limits)
        # aux_layers: the proposer reads these target layers' inputs (EAGLE-3): an eager runner keeps them
        self.runner = self.executor.make_runner(self.loaded.model, caches[0], backend, limits,
                                                tuple(self.proposer.aux_layers if self.proposer else ()))
        lookahead = 0
        if self.proposer is not None:
            self.proposer.bind_kv_caches(caches[1:], backend)
            self.proposer.bind_target_kv_caches(caches[0])  # a proposer sharing the target's KV (layer_skip)
            lookahead = self.proposer.num_lookahead_tokens
        self.core = SchedulerCore(
            self.num_kv_blocks, self.block_size, sched_cfg.max_num_seqs, sched_cfg.max_num_batched_tokens,
            self.max_model_len, cache_cfg.enable_prefix_caching, lookahead,
            self.spec is not None and self.spec.scorer == "batch_expansion",
            sliding_window=kv_sliding_window(kv_models))
        token_buckets = self.platform.token_buckets(limits)
        if token_buckets is not None:  # static shapes: the packer pads every batch to a bucket
            self.core.set_token_padding(list(token_buckets), self.num_kv_blocks)
        self.platform.warmup()  # every runner it made: compile / capture the planned shapes
        if self.proposer is not None:
            self.proposer.bind_core(self.core)
        self.step_sampler = StepSampler(self.spec, self.loaded.eos_token_ids)
        # structured outputs: grammars checked per constraint, masks built while the forward runs
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.loaded.eos_token_ids)
        self.step_grammar = StepGrammar(self.vocab_size)
        self.metrics = SpecMetrics(self.spec.num_speculative_tokens if self.spec else 0)
        # the proposing side of each step: proposer, policy, pending proposals' q (engine/propose_step.py)
        self.proposing = None
        if self.proposer is not None:
            policy = GoodputPolicy(self.spec.num_speculative_tokens) if self.spec.uses_goodput_policy else None
            self.proposing = StepProposing(self.spec, self.proposer, policy, get_core=lambda: self.core,
                                           platform=self.platform, max_model_len=self.max_model_len,
                                           target_runner=self.runner)
        self._no_drafts: dict = {}  # the verifier's draft probabilities without speculation
        # leader core id -> core.add_request arguments of the samples waiting for its prompt's KV
        self._held: dict[int, list[tuple]] = {}
        self.num_mixed_steps = 0  # steps where prefill chunks and verification runs shared a forward
        self._requests: dict[int, RequestState] = {}
        # requests whose sampling reads their token history (grammar, penalties, min_tokens) and those
        # that draw at random (their draws' counters are output positions): a step launched before the
        # states take the previous one's tokens checks these (StepTransaction._launch_next)
        self._history_readers: set[int] = set()
        self._random_ids: set[int] = set()
        self._logprob_ids: set[int] = set()  # requests that want logprobs (not sampled on the device)
        self._by_name: dict[str, int] = {}
        self._sinks: dict[str, object] = {}  # request name -> callable taking its outputs (add_request sink=)
        self._ids = itertools.count()
        self._lock = threading.RLock()  # one thread at a time: step, add_request, abort
        self._undelivered: list[RequestOutput] = []  # outputs of a committed step that then failed
        # the overlapped loop: the last committed step's output work (core ids), done beside the
        # next forward; requests it finished that the core still holds leave after that step
        self.overlap_steps = overlap_steps = sched_cfg.overlap_steps
        self._tail: list[int] | None = None
        self._stopped: list[int] = []
        # where a launch runs the forward on this thread, a worker thread stands in for the device
        on_thread = {"auto": not self.platform.launches_are_async, "on": True, "off": False}[sched_cfg.forward_thread]
        self.executor.run_forwards_on_thread(overlap_steps and on_thread)
        # where launches are asynchronous by themselves (no forward thread: CUDA), a plain step's
        # sampling is queued as device work behind its forward (engine/device_sampling.py)
        self.device_sampling = bool(overlap_steps and self.executor.forward_thread is None
                                    and self.platform.samples_on_device)
        # a plain step scheduled and launched while the previous one ran (step_transaction.py)
        self.schedule_ahead = bool(overlap_steps and sched_cfg.schedule_ahead and self.proposer is None
                                   and (self.executor.forward_thread is not None or self.device_sampling))
        # the next step scheduled and launched right after a step's update, before the Python states
        # take its tokens (StepTransaction._launch_next): with the core's own proposal, or none
        self.launches_next = bool(overlap_steps and sched_cfg.schedule_ahead
                                  and (self.proposer is None or self.proposer.drafts_in_core))
        # the step launched by the previous call, adopted by the next: (sched, states, pending
        # forward, whether its sampling was queued behind the forward)
        self._ahead = None
        # a draft model's forwards launched where the target's run, the step verifying them scheduled
        # before their tokens exist (spec_decode/launched_proposal.py)
        if self.proposing is not None and overlap_steps and self.executor.tensor_parallel_size == 1:
            self.proposing.launch_job = self.executor.launch_job
            self.proposing.history_readers = self._history_readers
        self.num_scheduled_ahead = 0  # plain steps launched before the previous one's tokens (launch_ahead)
        self.num_launched_next = 0  # steps launched by _launch_next (right after the previous update)
        self.last_failed_request_ids: list[str] = []  # requests of the last step that raised

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
        self._check_params(params)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            ids = self.encode(prompt)
            self._check_token_ids(ids, "prompt (tokenized)")
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            ids = self._check_token_ids(prompt, "prompt")
        else:
            raise ValueError(f"prompt must be a str or a list of token ids (got {type(prompt).__name__})")
        return ids

    def _check_params(self, params) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams (got {type(params).__name__})")
        if params.n != 1:
            raise ValueError(f"SamplingParams.n={params.n}: an engine request is one sample; add the n samples as "
                             "requests with params.sample_params(j) (Generator and the server do)")
        if params.stop_token_ids and any(t >= self.vocab_size for t in params.stop_token_ids):
            bad = next(t for t in params.stop_token_ids if t >= self.vocab_size)
            raise ValueError(f"SamplingParams.stop_token_ids holds {bad}, outside the vocabulary "
                             f"[0, {self.vocab_size})")
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs)  # ValueError naming the field
        ids, _ = params.logit_bias_arrays()
        if len(ids) and int(ids.max()) >= self.vocab_size:
            raise ValueError(f"SamplingParams.logit_bias holds token id {int(ids.max())}, outside the vocabulary "
                             f"[0, {self.vocab_size})")
        if params.logprobs is not None and params.logprobs > min(self.max_logprobs, self.vocab_size):
            raise ValueError(f"SamplingParams.logprobs={params.logprobs} exceeds the engine's max_logprobs="
                             f"{self.max_logprobs}" + (f" (vocabulary size {self.vocab_size})"
                                                      if self.vocab_size < self.max_logprobs else "") +
                             "; raise max_logprobs when building the engine")

    def _check_token_ids(self, ids, what: str) -> list[int]:
        """ids -> list[int] in [0, vocab) with room to generate under max_model_len, or ValueError."""
        if isinstance(ids, np.ndarray) and ids.ndim != 1:
            raise ValueError(f"{what} token ids must be a flat list (got an array of shape {ids.shape})")
        if isinstance(ids, np.ndarray) and ids.dtype.kind in "iu":
            ids = ids.tolist()  # plain ints at C speed
        else:
            ids = list(ids)
            if set(map(type, ids)) - {int}:  # the per-token check only where a token is not a plain int
                bad = next((t for t in ids if not is_int(t)), None)
                if bad is not None:
                    raise ValueError(f"{what} token ids must be integers (got {bad!r} of type {type(bad).__name__})")
                ids = [int(t) for t in ids]
        if not ids:
            raise ValueError(f"{what} is empty (no tokens)")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            bad = next(t for t in ids if t < 0 or t >= self.vocab_size)
            raise ValueError(f"{what} token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"{what} has {len(ids)} tokens; max_model_len={self.max_model_len} leaves no room "
                             "to generate")
        return ids

    def encode(self, text: str) -> list[int]:
        # the loader makes encode add BOS iff the model wants it; encode_batch gives the same ids and
        # releases the GIL while it works (a server tokenizes off its event loop)
        return self.tokenizer.encode_batch([text])[0].ids

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    prompt_token_ids: list[int] | None = None, stream: bool = False,
                    whole_batch: bool = False, share_prompt_with: str | None = None, sink=None) -> None:
        """Validate and queue one request. `prompt_token_ids`, when given, is what runs (`prompt` is
        then only echoed back); it is validated like a token-id prompt. Raises ValueError naming the
        field; on any error nothing of the request is left behind. With stream=True,
        step(final_only=True) still returns its intermediate outputs (deltas since its last one).
        whole_batch=True says the caller waits for all its requests together (Generator.generate):
        while every running request says so and none waits, the speculation policy drafts only
        where drafts can shorten the run (spec_decode/policy.py).
        share_prompt_with: the name of a request with the same prompt (sample 0 of n): while its
        prompt is not yet computed, this one waits outside the core, then enters and finds the
        prompt's full blocks in the prefix cache instead of computing them again.
        sink: a callable taking this request's outputs: whichever caller steps the engine (a
        Generator, the server's loop sharing it), they go to the sink and not into the list that
        step() returns (without one, outputs go to whoever stepped)."""
        params = params if params is not None else SamplingParams()
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a str (got {type(request_id).__name__})")
        with self._lock:
            if request_id in self._by_name:
                raise ValueError(f"request_id {request_id!r} is already in use")
            if prompt_token_ids is not None:
                self._check_params(params)
                ids = self._check_token_ids(prompt_token_ids, "prompt_token_ids")
            else:
                ids = self.validate(prompt, params)
            core_id = next(self._ids)
            seed = params.seed if params.seed is not None else int(
                self._seed_source.integers(0, 2**64, dtype=np.uint64))
            # the Python state exists before the core learns of the request: a step never meets a
            # request it cannot map, and a refusal by the core leaves nothing behind
            st = RequestState(request_id, core_id, prompt if isinstance(prompt, str) else None, ids, params,
                              IncrementalDetokenizer(self.tokenizer, params.stop), seed,
                              logprobs=[] if params.logprobs is not None else None, stream=stream,
                              whole_batch=whole_batch)
            if params.structured_outputs is not None:
                st.grammar = self.grammars.matcher(params.structured_outputs)
            if st.grammar is not None or params.penalized or params.min_tokens > 0:
                self._history_readers.add(core_id)
            if params.temperature != 0.0:
                self._random_ids.add(core_id)
            if params.logprobs is not None:
                self._logprob_ids.add(core_id)
            self._requests[core_id] = st
            self._by_name[request_id] = core_id
            if sink is not None:
                self._sinks[request_id] = sink
            eos = list(self.loaded.eos_token_ids)
            # ignore_eos ignores every EOS id of the model; otherwise the first is the core's EOS and
            # the others stop like stop_token_ids do
            stop_ids = list(params.stop_token_ids or ()) + ([] if params.ignore_eos else eos[1:])
            # max_tokens beyond max_model_len is clamped, as vLLM does: the core also stops a request
            # ("length") when prompt + output reach max_model_len
            max_tokens = min(params.max_tokens, self.max_model_len)
            min_tokens = min(params.min_tokens, max_tokens)
            args = (core_id, np.asarray(ids, dtype=np.int64), max_tokens, min_tokens,
                    eos[0] if eos and not params.ignore_eos else -1, params.ignore_eos, stop_ids)
            leader = self._by_name.get(share_prompt_with) if share_prompt_with is not None else None
            lead = self._requests.get(leader) if leader is not None else None
            if (lead is not None and self.cache_config.enable_prefix_caching and not lead.finished
                    and not lead.output_token_ids and lead.prompt_token_ids == ids):
                self._held.setdefault(leader, []).append(args)  # enters once the leader's prompt is in
                return
            try:
                self.core.add_request(*args)
            except BaseException:
                del self._requests[core_id]
                del self._by_name[request_id]
                self._history_readers.discard(core_id)
                self._random_ids.discard(core_id)
                self._logprob_ids.discard(core_id)
                raise

    def abort(self, request_id: str) -> RequestOutput | None:
        with self._lock:
            core_id = self._by_name.pop(request_id, None)
            self._sinks.pop(request_id, None)
            if core_id is None:
                return None
            if not self._drop_held(core_id):
                self.core.abort_request(core_id)
            self._admit_held(core_id)  # its followers go on without it
            st = self._requests.pop(core_id)
            try:
                st.detokenize()  # tokens of a committed step whose output work was still due
            except Exception:  # noqa: BLE001 - the request ends here either way
                pass
            if not st.finished:
                st.finish("abort")
            self._forget([core_id])
            # outputs of a failed step not yet delivered: the aborted request's are void
            self._undelivered = [o for o in self._undelivered if o.request_id != request_id]
            return st.to_output()

    def close(self) -> None:
        """Release the executor (tensor-parallel workers end here); the engine serves no more steps."""
        self.executor.shutdown()

    @property
    def lock(self) -> threading.RLock:
        """Held by step(), add_request() and abort(); hold it to run several calls as one."""
        return self._lock

    def has_unfinished_requests(self) -> bool:
        """Requests still running or waiting, outputs of a failed step not yet delivered, or a
        step scheduled ahead still to commit."""
        # (a due output work's requests are still here)
        return bool(self._requests or self._undelivered or self._ahead is not None)

    def spec_metrics(self) -> dict:
        return self.metrics.as_dict()

    def reset_metrics(self) -> None:
        """Start the engine-level speculation metrics afresh (e.g. after a warm-up run)."""
        self.metrics = SpecMetrics(self.metrics.k)
        self.num_mixed_steps = 0

    # ------------------------------------------------------------------ the step
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """Run one step; return outputs of the requests it touched (only finished ones when
        final_only, which spares building cumulative outputs for every running request), except
        those of requests added with a sink, which go to their sink.

        The overlapped loop (overlap_steps=True, the default) returns a step's outputs from the next
        call: their output work (detokenizing, stop strings, RequestOutputs, metrics) runs while
        that call's forward is on the device. The serial loop returns them from the same call."""
        outputs = self._step(final_only)
        if not self._sinks:
            return outputs
        kept = []
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                kept.append(out)
                continue
            if out.finished:
                del self._sinks[out.request_id]
            sink(out)
        return kept

    def _step(self, final_only: bool) -> list[RequestOutput]:
        """DESIGN §3's step; engine/step_transaction.py says what leaving it by an exception undoes."""
        with self._lock, StepTransaction(self, final_only) as step:
            if step.schedule():  # 1. the core picks this step's runs (Rust)
                step.launch()  # 2. the target forward over the mixed batch, launched
                step.launch_ahead()  # the next plain step behind it, where it can be (zero bubble)
                step.overlap()  # while it runs: the previous step's output work, grammar masks
                step.sample()  # 3. sample / verify once the forward is done
                step.commit()  # 5. update (Rust); the Python states take the same tokens
                step.propose()  # 4. drafts for the next step
        return step.outputs

    def _launch(self, sched, states, then=None, before=None):
        """Pack the batch and launch the target forward (and `then(logits)` behind it, `before(batch)`
        ahead of it); -> executor PendingForward."""
        if sched.num_prefill_requests:  # prefix-cache hits are found when a prompt is scheduled
            for st, cached in zip(states, sched.num_cached_tokens.tolist()):
                st.num_cached_tokens = max(st.num_cached_tokens, cached)
        batch = model_batch_from_schedule(sched, self.block_size, self.device)
        if before is not None:
            return self.executor.launch_model(batch, then, before)
        return self.executor.launch_model(batch) if then is None else self.executor.launch_model(batch, then)

    def _observe_verification(self, states, emitted) -> None:
        """The proposing side sees the verification (its policy chooses the next drafts from it)."""
        if self.proposing is not None and self.proposing.policy is not None and emitted.num_draft_tokens.any():
            self.proposing.observe_verification(states, emitted)

    def _record_spec(self, states, emitted) -> None:
        """The step's speculation counts (engine metrics, each request's own) and, where the policy
        chooses beside the forward (StepProposing.plans_beside_forward), its observation: output work."""
        if not emitted.num_draft_tokens.any():
            return
        if self.proposing is not None and self.proposing.plans_beside_forward:
            live = np.fromiter((st.core_id in self._requests for st in states), bool, len(states))
            if not live.all():  # aborted since the step: the policy forgot them already
                emitted = dataclasses.replace(emitted, num_draft_tokens=emitted.num_draft_tokens * live)
            self._observe_verification(states, emitted)
        cu = emitted.cu_num_emitted
        self.metrics.record(emitted.num_draft_tokens, emitted.num_accepted, cu[1:] - cu[:-1], emitted.num_rows)
        d, a = emitted.num_draft_tokens.tolist(), emitted.num_accepted.tolist()
        for r in np.flatnonzero(emitted.num_draft_tokens).tolist():
            st = states[r]
            st.num_drafts += 1
            st.num_draft_tokens += d[r]
            st.num_accepted_tokens += a[r]

    def _commit_tokens(self, sched, states, emitted, upd) -> "OutputWork":
        """The critical part of giving the Python states the tokens the core committed: the token
        histories the sampler, the policy and the proposer read next, and the finishes the core
        decided (EOS, stop token ids, length). -> the core ids whose output work is due
        (_finish_tail). A request a stop string already ended takes no more tokens."""
        lp = emitted.logprobs
        row_of = ({cid: r for r, cid in enumerate(sched.req_ids.tolist())}
                  if any(x is not None for x in lp) else None)
        touched = OutputWork()
        cu = upd.cu_num_new.tolist()
        new = upd.new_token_ids.tolist()
        for j, cid in enumerate(upd.req_ids.tolist()):
            st = self._requests.get(cid)
            if st is None or st.finished:
                continue
            tokens = new[cu[j]:cu[j + 1]]
            st.append_tokens(tokens, None if row_of is None else lp[row_of[cid]])
            touched.append(cid)
            if st.grammar is not None:
                self._advance_grammar(st, tokens)
        touched.spec = (states, emitted)  # its speculation counts: output work too
        for cid, reason, tok in zip(upd.finished_req_ids.tolist(), upd.finish_reasons, upd.stop_token.tolist()):
            st = self._requests.get(cid)
            if st is None or st.finished:
                continue
            st.finish(reason, tok if tok >= 0 else None)
            st.released_by_core = True
            if cid not in touched:
                touched.append(cid)
        return touched

    def _admit_held(self, leader: int | None = None) -> None:
        """Requests held for a leader's prompt enter the core: the given leader's now, else every
        leader's whose prompt is computed (it has output) or that is gone."""
        for cid in [leader] if leader is not None else list(self._held):
            lead = self._requests.get(cid)
            if cid in self._held and (leader is not None or lead is None or lead.finished or lead.output_token_ids):
                for args in self._held.pop(cid):
                    self.core.add_request(*args)

    def _drop_held(self, core_id: int) -> bool:
        """Remove a held request (aborted before it entered the core); True if it was held."""
        for cid, group in self._held.items():
            for k, args in enumerate(group):
                if args[0] == core_id:
                    del group[k]
                    if not group:
                        del self._held[cid]
                    return True
        return False

    def _advance_grammar(self, st, tokens) -> None:
        """The matcher follows the committed tokens. A token it refuses (masks make that impossible
        unless the grammar library fails) ends the request with finish_reason "error"; EOS taken
        once the grammar is complete ends it (also under ignore_eos: nothing may follow)."""
        g = st.grammar
        if not g.consume(tokens):
            st.finish("error", f"structured output: {g.error}")
        elif g.stopped and any(t in g.eos for t in tokens):
            st.finish("stop", next(t for t in tokens if t in g.eos))

    def _finish_tail(self, touched, final_only: bool, step_pending: bool) -> tuple[list[RequestOutput], Exception | None]:
        """A committed step's output work: detokenize and match stop strings, build the
        RequestOutputs, drop finished requests. A request whose own work fails (say, its
        detokenizer) is finished with reason "error"; the others go on, and the first such error
        is returned to be raised once the step is whole. A request a stop string ended while
        another step holds it (step_pending) leaves the core once that step committed."""
        outputs, error = [], None
        record = getattr(touched, "spec", None)
        if record is not None:  # (once, even if this work is retried)
            touched.spec = None
            self._record_spec(*record)
        for cid in touched or ():
            st = self._requests.get(cid)
            if st is None:
                continue  # aborted meanwhile
            try:
                st.detokenize()
            except Exception as e:  # noqa: BLE001 - contained to this request
                error = error or e
                st.finish("error", repr(e))
            if st.finished or not final_only or st.stream:
                outputs.append(st.to_output())
            if st.finished:
                if step_pending and not st.released_by_core:
                    self._stopped.append(cid)
                else:
                    self._release(cid)
        return outputs, error

    def _end_with_error(self, error) -> list[str]:
        """End the requests a RequestError names (no step pending): finish_reason "error", their
        outputs delivered with the next step() call. -> their request ids."""
        names = []
        for cid in error.core_ids:
            st = self._requests.get(cid)
            if st is None:
                continue
            try:
                st.detokenize()
            except Exception:  # noqa: BLE001 - it ends with an error either way
                pass
            st.finish("error", str(error))
            self._undelivered.append(st.to_output())
            self.core.abort_request(cid)
            st.released_by_core = True
            self._release(cid)
            names.append(st.request_id)
        return names

    def _release_stopped(self) -> None:
        """Requests finished by their output work while a step held them: out of the core now."""
        stopped, self._stopped = self._stopped, []
        for cid in stopped:
            self._release(cid)

    def _release(self, cid: int) -> None:
        st = self._requests.pop(cid, None)
        if st is None:
            return
        if not st.released_by_core:
            self.core.finish_request(cid)
        self._by_name.pop(st.request_id, None)
        self._forget([cid])

    def _forget(self, core_ids) -> None:
        """Requests that finished or were aborted: drop their proposal state."""
        for cid in core_ids:
            self._history_readers.discard(cid)
            self._random_ids.discard(cid)
            self._logprob_ids.discard(cid)
        if self.proposing is not None:
            self.proposing.forget(core_ids)

    @property
    def _draft_probs(self) -> dict:
        """core id -> q of its pending proposal (what the verifier reads)."""
        return self.proposing.draft_probs if self.proposing is not None else self._no_drafts

    @property
    def policy(self):
        """The speculation policy (GoodputPolicy), or None (fixed k, or no speculation)."""
        return self.proposing.policy if self.proposing is not None else None


if LLMEngine.__doc__:  # (None under python -OO)
    LLMEngine.__doc__ = LLMEngine.__doc__.format(options=options_doc("    "))


def kv_sliding_window(kv_models) -> int | None:
    """The window W within which every later query of every KV user attends, so that the core
    gives back each request's KV blocks below num_computed_tokens - W + 1 (SchedulerCore's
    sliding_window), or None: keep every block. `kv_models` are the target and the models a
    proposer keeps KV for over the same block tables.

    W is the target's window where every one of its layers slides (Mistral) and no proposer keeps
    KV of its own. A model without `config.all_layers_slide` (a head) counts as full attention.
    A proposer's own KV rules it out even where its model slides too: a draft model catches up
    from behind the target's computed tokens (the accepted drafts it recomputes, the history after
    a pause or a prefix-cache hit), so its queries sit below the line the core frees at and would
    read (and write) blocks given back. Proposers without KV of their own (n-gram, suffix, heads
    on the target's states, layer-skip on the target's KV) query at num_computed_tokens or later."""
    cfg = getattr(kv_models[0], "config", None)
    if not getattr(cfg, "all_layers_slide", False) or len(kv_models) > 1:
        return None
    return cfg.min_window


def _check_trees_fit_windows(spec, cfg) -> None:
    """A tree node sees its ancestors whatever a sliding window says (attention/backend.py): exact
    only while every tree is shallower than the model's narrowest window."""
    window = cfg.min_window
    if spec is None or window is None or not spec.drafts_trees:
        return
    depth = spec.num_speculative_tokens
    if spec.token_tree is not None:
        depth = max(depth, spec.token_tree.max_depth)
    if depth >= window:
        raise ValueError(f"speculative: token trees up to {depth} deep need a sliding window wider than that; "
                         f"this model's narrowest window is {window} (use fewer speculative tokens or chains)")


class OutputWork(list):
    """A committed step's output work: the core ids whose outputs are due, and (spec) the
    step's (states, emitted) whose speculation counts are recorded with it."""

    __slots__ = ("spec",)

    def __init__(self, *args):
        super().__init__(*args)
        self.spec = None
