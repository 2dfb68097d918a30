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

from specinfer.config import EngineConfig, options_doc
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

    `Generator(model, **options)` or `Generator(EngineConfig)`. `model` is an HF directory, a
    `.gguf` file, or a model-pack name such as "smollm2-135m". `speculative` is a
    SpeculativeConfig or a dict of its fields, e.g. {{"method": "ngram", "num_speculative_tokens": 4}};
    its `model` may name a trained head (e.g. "smollm2-135m-eagle": trained once on this machine,
    then cached). The other options are EngineConfig's (specinfer/config.py), the CLI's flags:

{options}

    With `quantization="auto"` a `.gguf` model on CPU runs as stored and its attention
    batch-invariant, so greedy speculation stays exact (as under "w8a8"). `batch_invariant=True`
    runs GEMMs through the few-rows kernel (faster decodes, ~1.5x slower prefill). A draft model
    is sharded over speculative["draft_tensor_parallel_size"] ranks (a divisor of
    tensor_parallel_size, default all of them).
    Call `close()` (or use `with Generator(...) as gen:`) to stop the workers; they also stop
    when this process exits.
    """

    def __init__(self, model, **options):
        config = model if isinstance(model, EngineConfig) else EngineConfig.create(model, **options)
        if isinstance(model, EngineConfig) and options:
            raise TypeError(f"Generator(EngineConfig) takes no other options (got {sorted(options)}); "
                            "use config.replace(...)")
        resolved = _resolve_named_head(config.speculative, config.model.model)
        if resolved is not config.speculative:
            config = dataclasses.replace(config, speculative=resolved)
        self.engine = LLMEngine(config)
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


if Generator.__doc__:  # (None under python -OO)
    Generator.__doc__ = Generator.__doc__.format(options=options_doc("    "))
