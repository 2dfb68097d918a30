"""Batches of a timed run from prompt token ids (the prompts themselves: specinfer.prompt_sets)."""
from __future__ import annotations


def batches_for(prompt_ids: list[list[int]], batch_size: int, num_prompts: int) -> list[list[list[int]]]:
    """The generate() calls of one timed run. Batch 1: the first `num_prompts` prompts one by
    one. Batch b > 1: one call with b prompts (cycling through the set if it has fewer)."""
    if batch_size == 1:
        return [[p] for p in prompt_ids[:num_prompts]]
    return [[prompt_ids[i % len(prompt_ids)] for i in range(batch_size)]]
