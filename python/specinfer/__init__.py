"""specinfer: fast, lossless speculative decoding with a Rust scheduling core.

    from specinfer import Generator, SamplingParams
    gen = Generator("smollm2-135m", speculative={"method": "ngram", "num_speculative_tokens": 4})
    out = gen.generate(["def fib(n):"], SamplingParams(max_tokens=64, temperature=0))
"""
from __future__ import annotations

__version__ = "0.1.0"

# Public names resolve lazily so that `import specinfer.sample` (or the Rust core alone) does not
# pay for, or depend on, the whole engine being importable.
_EXPORTS = {
    "Generator": "specinfer.generator",
    "SamplingParams": "specinfer.sampling_params",
    "StructuredOutputsParams": "specinfer.structured.params",
    "RequestOutput": "specinfer.outputs",
    "SpeculativeConfig": "specinfer.spec_decode.config",
    "LLMEngine": "specinfer.engine.llm_engine",
    "EngineConfig": "specinfer.config",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'specinfer' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
