"""The things a benchmark times: specinfer Generators and optional peers (bench/peers/: HF
transformers, vLLM, llama.cpp). Each takes a batch of prompts as token ids and returns
the number of generated tokens; specinfer engines also return their speculation metrics for that
batch. After each run, `last_token_ids` holds the generated ids per prompt (greedy agreement)."""
from __future__ import annotations

import math

from specinfer.bench.config import BenchConfig, MethodConfig


class SpecinferEngine:
    def __init__(self, cfg: BenchConfig, method: MethodConfig, max_prompt_len: int, model_limit: int | None = None):
        from specinfer import Generator

        k = method.k or 0
        # a KV pool sized for the batch (a memory budget would take a quarter of free memory)
        max_model_len = max_prompt_len + cfg.max_tokens + k + cfg.block_size
        if model_limit:
            max_model_len = min(max_model_len, model_limit)
        per_request = math.ceil(max_model_len / cfg.block_size) + 1
        max_batch = max(cfg.batch_sizes)
        self.k = k
        self.last_token_ids: list[list[int]] = []
        self.gen = Generator(method.model or cfg.model, dtype=cfg.method_dtype(method), block_size=cfg.block_size,
                             quantization=method.quantization, batch_invariant=method.batch_invariant,
                             overlap_steps=method.overlap_steps,
                             schedule_ahead=method.schedule_ahead, max_model_len=max_model_len,
                             num_kv_blocks=per_request * max_batch + 8, max_num_seqs=max(256, max_batch),
                             max_num_batched_tokens=cfg.max_num_batched_tokens,
                             enable_prefix_caching=cfg.enable_prefix_caching, speculative=method.speculative)

    def run(self, prompts: list[list[int]], cfg: BenchConfig, seed: int = 0) -> tuple[int, dict | None]:
        from specinfer import SamplingParams

        eng = self.gen.engine
        eng.metrics.__init__(self.k)  # per-run metrics: reset the engine's counters
        params = SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature, ignore_eos=cfg.ignore_eos,
                                seed=seed if cfg.temperature > 0 else None)
        outs = self.gen.generate(prompts, params, use_tqdm=False)
        self.last_token_ids = [list(o.token_ids) for o in outs]
        tokens = sum(len(o.token_ids) for o in outs)
        m = eng.metrics
        metrics = self.gen.spec_metrics()  # the time split is kept without speculation too
        if metrics is not None:  # raw counts too, so runs can be pooled exactly
            metrics.update(drafts_at=m.drafts_at.tolist(), accepted_at=m.accepted_at.tolist(),
                           num_emitted_tokens=m.num_emitted_tokens, max_emittable_tokens=m.max_emittable_tokens)
        return tokens, metrics

    def close(self):
        self.gen = None


def make_engine(cfg: BenchConfig, method: MethodConfig, *, max_prompt_len: int, eos_token_ids, model_limit=None,
                log=lambda msg: None):
    if method.engine == "specinfer":
        return SpecinferEngine(cfg, method, max_prompt_len, model_limit)
    if method.engine == "hf":
        from specinfer.bench.peers.hf import HFEngine

        return HFEngine(cfg, method, eos_token_ids)
    if method.engine == "llama_cpp":
        from specinfer.bench.peers.llama_cpp import LlamaCppEngine

        return LlamaCppEngine(cfg, method, eos_token_ids, max_model_len=max_prompt_len + cfg.max_tokens + 16, log=log)
    from specinfer.bench.peers.vllm import VllmEngine

    k = method.k or 0
    return VllmEngine(cfg, method, eos_token_ids, max_model_len=max_prompt_len + cfg.max_tokens + k + 16)
