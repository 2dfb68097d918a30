"""Weight-only int8 for draft heads (`speculative={"quantization": "int8"}`, CPU).

On a CPU a head's step streams its GEMM weights from memory (EAGLE-1 for SmolLM2-135M: 8.7 M
weights, 35 MB in float32, read once per draft), so its cost c falls with the bytes per weight.
A head only proposes: the target verifies every draft, so a quantized head changes which tokens
are drafted and how many are accepted, never the output (greedy stays exact, sampling keeps the
target's distribution, with q the quantized head's own probabilities). Each head class has a
`quantize()` that swaps its GEMM weights for Int8Weights (models/int8_linear.py: int8 with a
float32 scale per 32 inputs, the few-rows kernel) and runs them through `any_linear`; embeddings
stay dense (rows are looked up, not streamed). One-way: a quantized head is not saved back.

On CPU with a float32 target, heads are int8 by default ("auto", chosen by the engine): there int8
halves EAGLE's c with the same acceptance (docs/lab/2026-12-notebook.md). "auto" quantizes a head whose every
GEMM takes a multiple of GROUP_SIZE inputs (every real model's) and leaves any other dense.
"""
from __future__ import annotations

from specinfer.models.int8_linear import GROUP_SIZE, int8_linear, quantized

DECODER_GEMMS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")


def quantize_decoder_layer(layer, what: str) -> None:
    """A DecoderLayer's four GEMM weights as int8, run by the int8 kernel."""
    for name in DECODER_GEMMS:
        w = quantized(getattr(layer, name), f"{what}.{name}")
        delattr(layer, name)  # drop the dense parameter
        setattr(layer, name, w)
    layer.linear = int8_linear


def quantize_list(weights: list, what: str) -> list:
    """Each weight of a list as int8, entries that are one tensor (tied stages, a shared lm_head)
    staying one weight."""
    done: dict[int, object] = {}
    return [done.setdefault(id(w), quantized(w, f"{what}[{i}]")) for i, w in enumerate(weights)]


def refuse_saving_quantized(head) -> None:
    if getattr(head, "quantization", None) is not None:
        raise ValueError(f"this {type(head).__name__} was quantized for inference ({head.quantization}); "
                         "save the head before quantizing it")


def int8_fits(head) -> bool:
    """Whether every GEMM weight of the head (`head.gemm_weights()`) can be int8."""
    return all(w.shape[-1] % GROUP_SIZE == 0 for w in head.gemm_weights())


def apply_quantization(head, quantization: str | None) -> None:
    """The head's weights as `quantization` says: None dense, "int8" int8 (a shape that cannot be
    is refused, naming the tensor), "auto" int8 where int8_fits, else dense."""
    if quantization == "auto":
        if int8_fits(head):
            head.quantize("int8")
    elif quantization is not None:
        head.quantize(quantization)
