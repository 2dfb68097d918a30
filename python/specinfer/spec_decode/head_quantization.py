"""Weight-only int8 for draft heads (`speculative={"quantization": "int8"}`, CPU).

On a CPU a head's step streams its GEMM weights from memory (EAGLE-1 for SmolLM2-135M: 8.7 M
weights, 35 MB in float32, read once per draft), so its cost c falls with the bytes per weight.
A head only proposes: the target verifies every draft, so a quantized head changes which tokens
are drafted and how many are accepted, never the output (greedy stays exact, sampling keeps the
target's distribution, with q the quantized head's own probabilities). Each head class has a
`quantize()` that swaps its GEMM weights for Int8Weights (models/int8_linear.py: int8 with a
float32 scale per 32 inputs, the few-rows kernel) and runs them through `any_linear`; embeddings
stay dense (rows are looked up, not streamed). One-way: a quantized head is not saved back.
"""
from __future__ import annotations

from specinfer.models.int8_linear import int8_linear, quantized

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
