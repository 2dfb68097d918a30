"""llama.cpp as a bench peer, in process through llama-cpp-python, run the way shared/PEERS.md
found to be like for like: `n_threads = n_threads_batch = config.threads`, greedy, the same
prompt token ids as every other method, and no reuse of one prompt's KV by the next.

- batch 1: `Llama.generate` after `reset()` for each prompt (without it llama-cpp-python keeps
  the KV of a shared prefix: prefix caching by another name, off for every method here).
- batch b > 1: llama.cpp's own batched decoding (as its `batched` example): a second context with
  `n_seq_max = b` on the same model, one `llama_decode` per step over every unfinished sequence,
  llama.cpp's greedy sampler on each sequence's logits; the KV memory is cleared before each call.
- mode "prompt_lookup" (batch 1): llama-cpp-python's `LlamaPromptLookupDecoding(num_pred_tokens=k)`
  (its default max_ngram_size 2) as the Llama's `draft_model`: `generate` evaluates the last token
  plus up to k looked-up tokens in one `llama_decode` and keeps them while the greedy samples agree.
  llama-cpp-python then computes logits for every position, the prompt's included (logits_all).
- mode "draft_model": llama.cpp's own speculation through its native binary, in
  llama_cpp_native.py; constructing this class for that mode returns that engine.

Token counts include the EOS token (as specinfer, HF and vLLM count it); with `ignore_eos` every
sequence runs to max_tokens.
"""
from __future__ import annotations

import contextlib
import sys

from specinfer.bench.config import BenchConfig, MethodConfig
from specinfer.bench.peers import PeerUnavailable
from specinfer.bench.peers.gguf_files import import_llama_cpp, resolve_gguf

N_BATCH = 512  # tokens per llama_decode call (PEERS.md: n_batch=512)


@contextlib.contextmanager
def _model_params(llama_cpp, *, use_extra_bufts: bool):
    """`Llama` does not expose llama_model_params.use_extra_bufts (llama-cli's --no-repack: no
    weight repacking, no AMX buffers); off, its default params are patched while it loads."""
    if use_extra_bufts:
        yield
        return
    lib = sys.modules["llama_cpp.llama_cpp"]  # the module llama.py calls llama_model_default_params in
    default = lib.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    lib.llama_model_default_params = params
    try:
        yield
    finally:
        lib.llama_model_default_params = default


class LlamaCppEngine:
    def __new__(cls, cfg: BenchConfig, method: MethodConfig, *args, **kwargs):
        if method.mode == "draft_model":  # llama.cpp's draft-model speculation: the native binary
            from specinfer.bench.peers.llama_cpp_native import LlamaCppNativeEngine

            return LlamaCppNativeEngine(cfg, method, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, cfg: BenchConfig, method: MethodConfig, eos_token_ids, max_model_len: int, log=lambda m: None):
        self.llama_cpp = import_llama_cpp()  # first: a missing llama_cpp is reported before any file is made
        self.mode = method.mode
        model = method.model or cfg.model
        gguf_type = method.gguf_type or "f32"
        if method.model and method.model.endswith(".gguf"):
            gguf_type = "pack"  # an explicit file runs as it is
        self.path = resolve_gguf(model, gguf_type, convert_script=cfg.llama_cpp_convert, threads=cfg.threads, log=log)
        self.eos = set(eos_token_ids)
        self.threads = cfg.threads
        self.max_model_len = max_model_len
        extra = {}
        if method.mode == "prompt_lookup":
            try:
                from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
            except ImportError as e:
                raise PeerUnavailable(f"llama_cpp has no LlamaPromptLookupDecoding ({e})") from None
            extra["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=method.num_speculative_tokens)
        try:
            with _model_params(self.llama_cpp, use_extra_bufts=cfg.llama_cpp_extra_buffers):
                self.llm = self.llama_cpp.Llama(model_path=self.path, n_threads=cfg.threads,
                                                n_threads_batch=cfg.threads, n_ctx=max_model_len, n_batch=N_BATCH,
                                                n_ubatch=N_BATCH, seed=0, verbose=False, **extra)
        except (ValueError, RuntimeError) as e:  # llama.cpp refused the file or the context
            raise PeerUnavailable(f"llama.cpp could not load {self.path}: {e}") from None
        self._batched = {}  # batch size -> (context, llama_batch, sampler)
        for b in cfg.batch_sizes:  # made now, so that no timed run pays for a context
            if b > 1 and self.mode == "plain":
                self._context_for(b)
        self.last_token_ids: list[list[int]] = []

    def run(self, prompts: list[list[int]], cfg: BenchConfig, seed: int = 0) -> tuple[int, None]:
        if cfg.temperature > 0:
            raise PeerUnavailable("the llama.cpp peer runs greedy decoding only (config.temperature > 0)")
        if len(prompts) == 1:
            outs = [self._generate_one(prompts[0], cfg)]
        elif self.mode != "plain":
            raise PeerUnavailable(f"llama.cpp mode {self.mode!r} runs batch 1 only (got {len(prompts)} prompts)")
        else:
            outs = self._generate_batched(prompts, cfg)
        self.last_token_ids = outs
        return sum(len(o) for o in outs), None

    def _done(self, out: list[int], cfg: BenchConfig) -> bool:
        return len(out) >= cfg.max_tokens or (not cfg.ignore_eos and bool(out) and out[-1] in self.eos)

    def _generate_one(self, prompt: list[int], cfg: BenchConfig) -> list[int]:
        self.llm.reset()
        out: list[int] = []
        for token in self.llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                                       reset=False):
            out.append(int(token))
            if self._done(out, cfg):
                break
        return out

    def _context_for(self, b: int):
        if b not in self._batched:
            lc = self.llama_cpp
            params = type(self.llm.context_params).from_buffer_copy(self.llm.context_params)
            params.n_seq_max = b
            params.kv_unified = False  # each sequence its own KV stream of max_model_len cells
            params.n_ctx = b * -(-self.max_model_len // 256) * 256  # llama.cpp pads each stream to 256 cells
            params.n_batch = params.n_ubatch = max(N_BATCH, b)
            ctx = lc.llama_init_from_model(self.llm._model.model, params)
            if ctx is None:
                raise PeerUnavailable(f"llama.cpp could not make a context for batch {b}")
            batch = lc.llama_batch_init(max(N_BATCH, b), 0, 1)
            sampler = lc.llama_sampler_init_greedy()
            self._batched[b] = (ctx, batch, sampler)
        return self._batched[b]

    def _decode(self, ctx, batch, entries) -> None:
        """entries: (token, position, sequence, wants logits) in batch order."""
        lc = self.llama_cpp
        batch.n_tokens = len(entries)
        for i, (tok, pos, seq, want) in enumerate(entries):
            batch.token[i] = tok
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = 1 if want else 0
        rc = lc.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _generate_batched(self, prompts: list[list[int]], cfg: BenchConfig) -> list[list[int]]:
        lc = self.llama_cpp
        ctx, batch, sampler = self._context_for(len(prompts))
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        outs: list[list[int]] = [[] for _ in prompts]
        # prefill: every prompt's tokens, packed into llama_decode calls of at most N_BATCH tokens;
        # the last token of each prompt asks for logits and gives that sequence its first token
        flat = [(tok, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, tok in enumerate(p)]
        for start in range(0, len(flat), N_BATCH):
            chunk = flat[start:start + N_BATCH]
            self._decode(ctx, batch, chunk)
            for i, (_, _, s, want) in enumerate(chunk):
                if want:
                    outs[s].append(int(lc.llama_sampler_sample(sampler, ctx, i)))
        # decode: one token per unfinished sequence per step
        while True:
            live = [s for s, o in enumerate(outs) if not self._done(o, cfg)]
            if not live:
                return outs
            self._decode(ctx, batch, [(outs[s][-1], len(prompts[s]) + len(outs[s]) - 1, s, True) for s in live])
            for i, s in enumerate(live):
                outs[s].append(int(lc.llama_sampler_sample(sampler, ctx, i)))

    def close(self):
        lc = getattr(self, "llama_cpp", None)
        for ctx, batch, sampler in getattr(self, "_batched", {}).values():
            lc.llama_sampler_free(sampler)
            lc.llama_batch_free(batch)
            lc.llama_free(ctx)
        self._batched = {}
        if getattr(self, "llm", None) is not None:
            self.llm.close()
            self.llm = None

