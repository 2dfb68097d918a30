"""The user-facing API: `Generator(model).generate(prompts, params)`."""
from __future__ import annotations

from collections.abc import Iterator, Sequence

from specinfer.engine.llm_engine import LLMEngine
from specinfer.outputs import RequestOutput
from specinfer.sampling_params import SamplingParams


class Generator:
    """Offline batched generation (and streaming) over one target model, optionally speculative.

    `model` is an HF directory, a `.gguf` file, or a model-pack name such as "smollm2-135m".
    `speculative` is a SpeculativeConfig or a dict of its fields, e.g.
    {"method": "ngram", "num_speculative_tokens": 4}.
    `quantization="int8"` keeps GEMM weights int8 (CPU; GGUF Q8_0 as stored, other weights
    quantized per 32 inputs) and runs them through the int8 kernel.
    """

    def __init__(self, model, *, dtype="auto", device="auto", max_model_len=None, block_size=16,
                 num_kv_blocks=None, max_num_seqs=256, max_num_batched_tokens=2048,
                 enable_prefix_caching=True, seed=0, speculative=None, quantization=None):
        self.engine = LLMEngine(
            model, dtype=dtype, device=device, max_model_len=max_model_len, block_size=block_size,
            num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching, seed=seed, speculative=speculative,
            quantization=quantization)
        self._counter = 0

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def _add_all(self, prompts, sampling_params) -> list[str]:
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
        token_ids = [self.engine.validate(p, sp) for p, sp in zip(prompts, params)]
        names = []
        for p, sp, ids in zip(prompts, params, token_ids):
            name = f"req-{self._counter}"
            self._counter += 1
            self.engine.add_request(name, p, sp, prompt_token_ids=ids)
            names.append(name)
        return names

    def generate(self, prompts: str | Sequence, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in input order."""
        names = self._add_all(prompts, sampling_params)
        order = {n: i for i, n in enumerate(names)}
        results: list[RequestOutput | None] = [None] * len(names)
        bar = None
        if use_tqdm and len(names) > 1:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(names), desc="generating", unit="req", leave=False)
        try:
            while any(r is None for r in results):
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError("the engine stopped with requests unfinished")
                for out in self.engine.step(final_only=True):
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for n, r in zip(names, results):
                if r is None:
                    self.engine.abort(n)
            raise
        finally:
            if bar is not None:
                bar.close()
        return results

    def stream(self, prompts: str | Sequence, sampling_params=None) -> Iterator[RequestOutput]:
        """Yield incremental outputs (new_token_ids / new_text set) as steps complete."""
        names = self._add_all(prompts, sampling_params)
        pending = set(names)
        try:
            while pending:
                for out in self.engine.step():
                    if out.request_id in pending:
                        if out.finished:
                            pending.discard(out.request_id)
                        yield out
        finally:
            for n in pending:
                self.engine.abort(n)

    def spec_metrics(self) -> dict:
        return self.engine.spec_metrics()

    def reset_metrics(self) -> None:
        self.engine.reset_metrics()
