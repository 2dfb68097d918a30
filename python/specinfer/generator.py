"""The user-facing API: `Generator(model).generate(prompts, params)`.

A Generator may be shared by threads: steps are serialized by the engine's lock, every step's
outputs are routed to the mailbox of the call that owns each request, and each call takes only
its own requests' outputs (one thread's generate() never swallows another's results). A call
waiting for its outputs either steps the engine itself or, while another thread steps, blocks on
the lock; it never spins. If a step fails, the call that ran it aborts its own requests and
re-raises; the other calls' requests go on (the step was cancelled, see LLMEngine).
"""
from __future__ import annotations

import dataclasses
import threading
import weakref
from collections import deque
from collections.abc import Iterator, Sequence

from specinfer.engine.llm_engine import LLMEngine
from specinfer.outputs import RequestOutput
from specinfer.sampling_params import SamplingParams


def _resolve_named_head(speculative, model):
    """A named head in speculative.model (trained once on this machine by a fixed recipe, then
    cached: specinfer/training/trained_heads.py) becomes its checkpoint directory, training it
    first where it is absent; anything else is returned as given."""
    from specinfer.spec_decode.config import SpeculativeConfig

    spec = SpeculativeConfig.from_any(speculative)
    if spec is None or not isinstance(spec.model, str):
        return speculative
    from specinfer.training.trained_heads import is_trained_head_name, resolve_head

    if not is_trained_head_name(spec.model):
        return speculative
    return dataclasses.replace(spec, model=resolve_head(spec.model, spec.method, model))


class Generator:
    """Offline batched generation (and streaming) over one target model, optionally speculative.

    `model` is an HF directory, a `.gguf` file, or a model-pack name such as "smollm2-135m".
    `speculative` is a SpeculativeConfig or a dict of its fields, e.g.
    {"method": "ngram", "num_speculative_tokens": 4}.
    `device` is "auto", "cpu", "cuda[:N]", "hpu", "hpu-emulated" (the Gaudi path on CPU) or a
    specinfer.platform.Platform. `attention_backend` overrides the platform's choice: "cpu_native"
    (the Rust kernel, CPU default), "torch_ref", "triton" (CUDA; on CPU only with TRITON_INTERPRET=1)
    or "hpu_flat". `gpu_memory_utilization` (CUDA only) is the share of the device's total memory
    the engine may fill, weights included.
    `max_logprobs` caps SamplingParams.logprobs (vLLM's default, 20); a larger request is refused.
    `quantization="auto"` (the default) runs a `.gguf` model on CPU as stored (`"gguf"`: every GEMM
    weight and the embedding in the file's own block formats, Q4_0 .. Q8_0 and Q4_K .. Q6_K, read
    from its memory map and multiplied by the Rust kernels of models/gguf_linear.py, activations
    quantized per block as llama.cpp does; attention batch-invariant so greedy speculation stays
    exact), and anything else dense; a `dtype=` or `quantization=None` dequantizes a GGUF file.
    `quantization="int8"` keeps GEMM weights int8 (CPU; GGUF Q8_0 as stored, other weights
    quantized per 32 inputs) and runs them through the int8 kernel; `quantization="w8a8"` also
    rounds the activations to int8 per group of 32 (as llama.cpp does for Q8_0): faster from a few
    rows on; its attention runs batch-invariant so greedy speculation stays exact (models/int8_linear.py).
    `batch_invariant=True` (CPU, float32 / bfloat16 / w8a8 weights): every token's logits are the
    same bits whatever else its step holds (a decode, a verification run, a prefill chunk, other
    requests), so speculative output equals non-speculative output bit for bit, logprobs
    included, not only up to float noise: GEMMs through the few-rows kernel (faster decodes,
    ~1.5x slower prefill) and attention in its batch-invariant mode.
    `tensor_parallel_size=N` shards the target over N ranks through torch.distributed (worker
    processes this one spawns, or the ranks of a torchrun launch; docs/tensor_parallel.md); a
    draft model is sharded over speculative["draft_tensor_parallel_size"] ranks (a divisor of N,
    default N). A worker silent for `distributed_timeout_s` during a step fails the Generator.
    `overlap_steps=True` (the default) overlaps the host with the device: each step's output work
    (detokenizing, stop strings, outputs, metrics) runs while the next step's forward computes, on
    the device where launches are asynchronous (CUDA, Gaudi) or on a worker thread standing in for
    it (CPU); `False` runs the serial loop (for debugging; the outputs are the same).
    Call `close()` (or use `with Generator(...) as gen:`) to stop the workers; they also stop
    when this process exits.
    """

    def __init__(self, model, *, dtype="auto", device="auto", max_model_len=None, block_size=16,
                 num_kv_blocks=None, max_num_seqs=256, max_num_batched_tokens=2048,
                 enable_prefix_caching=True, seed=0, speculative=None, max_logprobs=20,
                 attention_backend=None, gpu_memory_utilization=0.9, quantization="auto",
                 tensor_parallel_size=1, distributed_timeout_s=120.0, batch_invariant=False,
                 overlap_steps=True):
        speculative = _resolve_named_head(speculative, model)
        self.engine = LLMEngine(
            model, dtype=dtype, device=device, max_model_len=max_model_len, block_size=block_size,
            num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching, seed=seed, speculative=speculative,
            max_logprobs=max_logprobs, attention_backend=attention_backend,
            gpu_memory_utilization=gpu_memory_utilization, quantization=quantization,
            tensor_parallel_size=tensor_parallel_size, distributed_timeout_s=distributed_timeout_s,
            batch_invariant=batch_invariant, overlap_steps=overlap_steps)
        # a Generator dropped without close() still stops its tensor-parallel workers
        weakref.finalize(self, self.engine.close)
        self._counter = 0
        self._mailboxes: dict[str, deque[RequestOutput]] = {}  # request name -> undelivered outputs
        self._mail_lock = threading.Lock()

    def close(self) -> None:
        """Stop the engine's executor (tensor-parallel workers); the Generator is unusable after."""
        self.engine.close()

    def __enter__(self) -> "Generator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def _add_all(self, prompts, sampling_params, stream: bool) -> list[list[str]]:
        """Queue every prompt's samples; -> the engine request names of each prompt (n of them)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            params = [SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
        # validate everything before any work starts: one bad prompt refuses the whole call
        token_ids = [self.engine.validate(p, sp if sp.n == 1 else sp.sample_params(0)) for p, sp in zip(prompts, params)]
        groups, names = [], []
        with self.engine.lock:
            try:
                for p, sp, ids in zip(prompts, params, token_ids):
                    base = f"req-{self._counter}"
                    self._counter += 1
                    group = [base] if sp.n == 1 else [f"{base}-{j}" for j in range(sp.n)]
                    groups.append(group)
                    for j, name in enumerate(group):
                        with self._mail_lock:
                            self._mailboxes[name] = deque()
                        names.append(name)
                        # outputs reach the mailbox whoever steps the engine (a server loop may share it)
                        self.engine.add_request(name, p, sp if sp.n == 1 else sp.sample_params(j),
                                                prompt_token_ids=ids, stream=stream, whole_batch=not stream,
                                                share_prompt_with=group[0] if j else None, sink=self._post)
            except BaseException:
                self._abort(names)
                raise
        return groups

    def _abort(self, names) -> None:
        for n in names:
            self.engine.abort(n)
            with self._mail_lock:
                self._mailboxes.pop(n, None)

    def _next_outputs(self, name_set: set[str]) -> list[RequestOutput]:
        """Outputs of the caller's requests: from its mailboxes, else by stepping the engine
        (or waiting, blocked, while another thread steps it)."""
        while True:
            mine = self._collect(name_set)
            if mine:
                return mine
            with self.engine.lock:
                mine = self._collect(name_set)  # delivered while we waited for the lock
                if mine:
                    return mine
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError("the engine stopped with requests unfinished")
                for out in self.engine.step(final_only=True):  # ours went to _post; others' are not ours
                    self._post(out)

    def _post(self, out: RequestOutput) -> None:
        with self._mail_lock:
            box = self._mailboxes.get(out.request_id)
            if box is not None:
                box.append(out)

    def _collect(self, name_set: set[str]) -> list[RequestOutput]:
        with self._mail_lock:
            got = []
            for n in name_set:
                box = self._mailboxes.get(n)
                while box:
                    got.append(box.popleft())
            return got

    def generate(self, prompts: str | Sequence, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in input order, one per prompt (with n > 1, its
        `outputs` holds the n samples)."""
        groups = self._add_all(prompts, sampling_params, stream=False)
        names = [n for g in groups for n in g]
        order = {n: i for i, n in enumerate(names)}
        results: list[RequestOutput | None] = [None] * len(names)
        pending = set(names)
        bar = None
        if use_tqdm and len(names) > 1:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(names), desc="generating", unit="req", leave=False)
        try:
            while pending:
                for out in self._next_outputs(pending):
                    if out.finished:
                        results[order[out.request_id]] = out
                        pending.discard(out.request_id)
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            self._abort(pending)
            raise
        finally:
            with self._mail_lock:
                for n in names:
                    self._mailboxes.pop(n, None)
            if bar is not None:
                bar.close()
        out, k = [], 0
        for g in groups:
            first = results[k]
            if len(g) > 1:
                first = dataclasses.replace(first, samples=results[k:k + len(g)])
            out.append(first)
            k += len(g)
        return out

    def stream(self, prompts: str | Sequence, sampling_params=None) -> Iterator[RequestOutput]:
        """Yield incremental outputs (new_token_ids / new_text set) as steps complete (with n > 1,
        each sample's under its own request_id, `<name>-<j>`)."""
        names = [n for g in self._add_all(prompts, sampling_params, stream=True) for n in g]
        pending = set(names)
        try:
            while pending:
                for out in self._next_outputs(pending):
                    if out.finished:
                        pending.discard(out.request_id)
                    yield out
        finally:
            self._abort(pending)
            with self._mail_lock:
                for n in names:
                    self._mailboxes.pop(n, None)

    def spec_metrics(self) -> dict:
        return self.engine.spec_metrics()

    def reset_metrics(self) -> None:
        self.engine.reset_metrics()
