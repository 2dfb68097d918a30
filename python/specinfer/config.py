"""Engine configuration: one frozen `EngineConfig`, built once and passed down.

    config = EngineConfig.create("smollm2-135m", max_num_seqs=32, speculative={"method": "ngram"})
    engine = LLMEngine(config)        # or LLMEngine(model, **options), Generator(model, **options)

It holds five frozen sections, each validated at construction (ValueError naming the option):
`model` (ModelConfig: weights, dtype, device, kernels, seeds), `cache` (CacheConfig: the paged
KV pool), `scheduler` (SchedulerConfig: the step's budgets and loop), `parallel`
(ParallelConfig: tensor parallelism) and `speculative` (SpeculativeConfig or None).

**Each engine option is written once**, as a field of its section below, with its default and
its help (`option(...)`). `Generator`, `LLMEngine` and the CLI (`cli/options.py`) derive from
these fields: the keyword arguments they take, the flags the CLI adds (named as vLLM names them
where vLLM has the option), their help, and the Generator's docstring. A new option is one new
field here.
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field

from specinfer.sampling_params import SEED_LIMIT, is_int as _is_int


def option(default, help: str, **cli):
    """A public engine option: a dataclass field whose metadata carries its help and the CLI's
    argparse settings (`type`, `choices`, `metavar`, `aliases`; `none_as`: the word the CLI uses
    for None, e.g. --quantization none; `cli=False`: no flag)."""
    return field(default=default, metadata={"help": help, "cli": cli})


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False (got {value!r})")


@dataclass(frozen=True)
class ModelConfig:
    """What runs: the target's weights, their dtype and format, the device and its kernels."""

    model: object = field(default=None, metadata={"help": "an HF directory, a .gguf file or a pack name"})
    dtype: str = option("auto", "weights and KV cache dtype: auto (the device's default: float32 on CPU), float32, "
                        "bfloat16 or float16", choices=["auto", "float32", "bfloat16", "float16"])
    device: object = option("auto", "auto, cpu, cuda[:N], hpu or hpu-emulated (the Gaudi path on CPU), or a "
                            "specinfer.platform.Platform")
    quantization: str | None = option(
        "auto", "auto: a .gguf model on CPU runs as stored (gguf), anything else dense (a dtype other than auto "
        "dequantizes a GGUF file); gguf: every GGUF tensor in its stored block format (Q4_0..Q8_0, Q4_K..Q6_K), "
        "activations quantized per block as llama.cpp does; none: dense; int8: weight-only int8 GEMMs on CPU "
        "(GGUF Q8_0 kept as stored); w8a8: the same weights times activations rounded to int8 per group of 32",
        choices=["auto", "none", "gguf", "int8", "w8a8"], none_as="none")
    attention_backend: str = option(
        "auto", "attention kernels: cpu_native (Rust, the CPU default), torch_ref, triton (the CUDA default; on CPU "
        "only with TRITON_INTERPRET=1) or hpu_flat (the Gaudi default); auto: the device's own",
        choices=["auto", "cpu_native", "torch_ref", "triton", "hpu_flat"])
    batch_invariant: bool = option(
        False, "every token's logits the same bits whatever its step holds, so speculative output equals "
        "non-speculative output bit for bit, logprobs included (CPU; float32, bfloat16 or w8a8 weights; slower "
        "prefill)")
    max_logprobs: int = option(20, "the most logprobs a request may ask for (as vLLM)", metavar="N")
    seed: int = option(0, "the engine's seed: a request without a seed of its own gets one drawn from it, in the "
                       "order requests arrive; each request's tokens then depend only on its seed",
                       metavar="N")
    threads: int | None = option(None, "CPU threads of torch and the Rust kernels, process-wide "
                                 "(torch.set_num_threads; default: torch's own choice)", type=int, metavar="N")

    def __post_init__(self):
        if self.model is None:
            raise ValueError("model is required: an HF directory, a .gguf file or a pack name")
        _check_bool("batch_invariant", self.batch_invariant)
        if not _is_int(self.max_logprobs) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be an integer >= 0 (got {self.max_logprobs!r})")
        if not _is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"seed must be an integer in [0, 2**64) (got {self.seed!r})")
        if self.threads is not None and (not _is_int(self.threads) or self.threads < 1):
            raise ValueError(f"threads must be an integer >= 1 or None (got {self.threads!r})")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool."""

    block_size: int = option(16, "KV cache block size in tokens", metavar="N")
    num_kv_blocks: int | None = option(None, "KV cache blocks (default: sized from the memory budget; vLLM's "
                                       "--num-gpu-blocks-override)", type=int, metavar="N",
                                       aliases=["--num-gpu-blocks-override"])
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of prompt prefixes seen before")
    gpu_memory_utilization: float = option(0.9, "CUDA: share of the device's total memory the engine may use, "
                                           "weights included", metavar="F")
    kv_cache_memory_fraction: float = 0.25  # of available memory, when num_kv_blocks is None
    kv_cache_max_bytes: int = 4 << 30  # host platforms only

    def __post_init__(self):
        if not _is_int(self.block_size) or self.block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1 (got {self.block_size!r})")
        if self.num_kv_blocks is not None and (not _is_int(self.num_kv_blocks) or self.num_kv_blocks < 1):
            raise ValueError(f"num_kv_blocks must be an integer >= 1 or None (got {self.num_kv_blocks!r})")
        _check_bool("enable_prefix_caching", self.enable_prefix_caching)
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1] (got {self.kv_cache_memory_fraction!r})")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0.0 < u <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1] (got {u!r})")


@dataclass(frozen=True)
class SchedulerConfig:
    """The step: its budgets and how the loop runs."""

    max_num_seqs: int = option(256, "most requests in one step", metavar="N")
    max_num_batched_tokens: int = option(2048, "token budget of one step: prefill chunks + decodes + verification "
                                         "runs", metavar="N")
    max_model_len: int | None = option(None, "longest sequence (prompt + output) in tokens (default: the model's "
                                       "limit, capped to what the KV pool holds)", type=int, metavar="N")
    overlap_steps: bool = option(True, "overlap the host with the device: each step's output work (detokenizing, "
                                 "stop strings, outputs, metrics) runs while the next step's forward computes; off: "
                                 "the serial loop, for debugging (the outputs are the same)")
    schedule_ahead: bool = option(True, "in the overlapped loop, schedule and launch a plain step (no drafts) "
                                  "before the previous one's tokens exist: its input ids are taken from them where "
                                  "the forwards run, so the device never waits for the host between steps; off: each "
                                  "step is scheduled after the previous one's update (the outputs are the same)")
    forward_thread: str = option("auto", "run the target's forwards, and each step's sampling behind them, on a "
                                 "worker thread that stands in for an asynchronous device (overlapped loop only). "
                                 "auto: where launches are not asynchronous by themselves (CPU, emulated Gaudi, a "
                                 "tensor-parallel group's driver); on: on CUDA too (the worker syncs on each step's "
                                 "tokens and fills the next step's input ids on the host); off: forwards launched "
                                 "from the engine's thread, a plain step's sampling queued as device work behind "
                                 "its forward and the next plain step scheduled ahead on the device (CUDA's way)",
                                 choices=("auto", "on", "off"))

    def __post_init__(self):
        if not _is_int(self.max_num_seqs) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1 (got {self.max_num_seqs!r})")
        if not _is_int(self.max_num_batched_tokens) or self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be an integer >= 1 (got {self.max_num_batched_tokens!r})")
        if self.max_model_len is not None and (not _is_int(self.max_model_len) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2 or None (got {self.max_model_len!r})")
        _check_bool("overlap_steps", self.overlap_steps)
        _check_bool("schedule_ahead", self.schedule_ahead)
        if self.forward_thread not in ("auto", "on", "off"):
            raise ValueError(f"forward_thread must be 'auto', 'on' or 'off' (got {self.forward_thread!r})")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism (executor/): the target over tensor_parallel_size ranks, a draft model
    over ranks 0 .. draft_tensor_parallel_size - 1."""

    tensor_parallel_size: int = option(1, "shard the target over N ranks through torch.distributed (worker "
                                       "processes this one spawns, or the ranks of a torchrun launch: "
                                       "docs/tensor_parallel.md)", metavar="N", aliases=["-tp", "--tp"])
    draft_tensor_parallel_size: int | None = None  # speculative.draft_tensor_parallel_size; None: the target's
    distributed_timeout_s: float = option(120.0, "a worker silent this long during a step fails the engine "
                                          "(seconds)", metavar="S")

    def __post_init__(self):
        n = self.tensor_parallel_size
        if not _is_int(n) or n < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1 (got {n!r})")
        d = self.draft_tensor_parallel_size
        if d is not None and (not _is_int(d) or d < 1 or n % d):
            divisors = [i for i in range(1, n + 1) if n % i == 0]
            raise ValueError(f"speculative.draft_tensor_parallel_size must divide tensor_parallel_size={n} "
                             f"(one of {divisors}; got {d!r})")
        t = self.distributed_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ValueError(f"distributed_timeout_s must be a number > 0 (got {t!r})")

    @property
    def draft_size(self) -> int:
        return self.tensor_parallel_size if self.draft_tensor_parallel_size is None else self.draft_tensor_parallel_size


SECTIONS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig, "parallel": ParallelConfig}


def engine_options() -> dict[str, tuple[str, dataclasses.Field]]:
    """Every public engine option: name -> (its section, its field), in declaration order."""
    return {f.name: (section, f) for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)
            if "cli" in f.metadata}


OPTION_NAMES = tuple(engine_options())


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    parallel: ParallelConfig = ParallelConfig()
    speculative: object = None  # SpeculativeConfig | None

    @classmethod
    def create(cls, model, *, speculative=None, **options) -> "EngineConfig":
        """The config for `model` with the given options (names as in OPTION_NAMES) and
        `speculative` (a SpeculativeConfig, a dict of its fields, or None). An unknown option is a
        TypeError naming the closest ones; a bad value a ValueError naming the option."""
        from specinfer.spec_decode.config import SpeculativeConfig

        known = engine_options()
        unknown = [name for name in options if name not in known]
        if unknown:
            hints = {n: difflib.get_close_matches(n, known, n=2) for n in unknown}
            said = ", ".join(f"{n!r}" + (f" (did you mean {' or '.join(map(repr, h))}?)" if h else "")
                             for n, h in hints.items())
            raise TypeError(f"unknown engine option {said}; the options are {', '.join(known)}, speculative")
        by_section: dict[str, dict] = {s: {} for s in SECTIONS}
        for name, value in options.items():
            by_section[known[name][0]][name] = value
        spec = SpeculativeConfig.from_any(speculative)
        return cls(model=ModelConfig(model=model, **by_section["model"]),
                   cache=CacheConfig(**by_section["cache"]),
                   scheduler=SchedulerConfig(**by_section["scheduler"]),
                   parallel=ParallelConfig(draft_tensor_parallel_size=spec and spec.draft_tensor_parallel_size,
                                           **by_section["parallel"]),
                   speculative=spec)

    def options(self) -> dict:
        """The flat options this config was made of (EngineConfig.create(cfg.model.model,
        speculative=cfg.speculative, **cfg.options()) == cfg)."""
        return {name: getattr(getattr(self, section), name) for name, (section, _) in engine_options().items()}

    def replace(self, **options) -> "EngineConfig":
        """A copy with some options (and/or `speculative`) changed, validated again."""
        speculative = options.pop("speculative", self.speculative)
        return EngineConfig.create(self.model.model, speculative=speculative, **{**self.options(), **options})


def options_doc(indent: str = "    ") -> str:
    """The options as a docstring section (Generator and LLMEngine append it to theirs)."""
    import textwrap

    lines = []
    for name, (_, f) in engine_options().items():
        text = f"`{name}` (default {f.default!r}): {f.metadata['help']}"
        lines += textwrap.wrap(text, 100, initial_indent=indent, subsequent_indent=indent + "    ")
    return "\n".join(lines)
