"""Self-distillation data for draft heads: the target's own greedy continuations of prompts, and
the target's hidden states over them (final post-norm states; aux layers' inputs for EAGLE-3).

Heads learn to predict what the target itself would emit next, so training sequences are
prompt + the target's greedy continuation, and only positions inside the continuation are labels.
Prompts come from specinfer's bench prompt sets and from the Python standard library's sources
(chunks of files, sorted by path: deterministic), or are given as token ids (tests).
"""
from __future__ import annotations

import json
import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specinfer.engine.batch import attention_metadata_for_runs
from specinfer.engine.kv_cache import allocate_kv_caches
from specinfer.engine.model_runner import ModelRunner


@dataclass(frozen=True)
class DistillSequence:
    tokens: torch.Tensor  # int64[N] prompt + the target's greedy continuation
    prompt_len: int  # positions >= prompt_len hold the target's own predictions
    final: torch.Tensor  # [N, H] target's post-norm hidden state per position
    aux: torch.Tensor | None  # [N, 3H] inputs of the aux layers (EAGLE-3), or None


def text_prompts(max_prompts: int, stdlib_chunk_chars: int = 600) -> list[str]:
    """The bench prompt sets, then chunks of the standard library's sources, up to max_prompts."""
    out = []
    data = Path(__file__).resolve().parent.parent / "bench" / "data"
    for f in sorted(data.glob("*.jsonl")):
        out += [json.loads(line)["prompt"] for line in f.read_text().splitlines() if line.strip()]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for f in sorted(stdlib.glob("*.py")):
        if len(out) >= max_prompts:
            break
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out += [text[i:i + stdlib_chunk_chars] for i in range(0, min(len(text), 4 * stdlib_chunk_chars),
                                                                stdlib_chunk_chars)]
    return out[:max_prompts]


def continuations(generator, prompts: list, max_tokens: int) -> list[tuple[list[int], int]]:
    """(prompt + greedy continuation token ids, prompt length) per prompt, via the engine."""
    from specinfer.sampling_params import SamplingParams

    outs = generator.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                              use_tqdm=False)
    return [(list(o.prompt_token_ids) + list(o.token_ids), len(o.prompt_token_ids)) for o in outs]


@torch.inference_mode()
def target_states(model, backend, token_ids: list[int], aux_layers: tuple[int, ...] = (), block_size: int = 16,
                  device=torch.device("cpu")) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One dense forward of the target over a whole sequence (its own throwaway paged KV)."""
    n = len(token_ids)
    num_blocks = math.ceil(n / block_size)
    dtype = model.norm.dtype
    runner = ModelRunner(model, allocate_kv_caches(model, num_blocks, block_size, dtype, device), backend, aux_layers)
    rows = np.arange(num_blocks, dtype=np.int32)[None]
    attn, pos = attention_metadata_for_runs(rows, np.zeros(1, np.int64), np.array([n]), block_size, device)
    hidden, _ = runner.forward(torch.tensor(token_ids, device=device), torch.from_numpy(pos).to(device), attn)
    return hidden.float(), (runner.last_aux.float() if aux_layers else None)


def build_sequences(generator, prompts: list, max_tokens: int, aux_layers: tuple[int, ...] = ()) -> list[DistillSequence]:
    engine = generator.engine
    backend = engine.runner.backend
    out = []
    for ids, p in continuations(generator, prompts, max_tokens):
        final, aux = target_states(engine.loaded.model, backend, ids, aux_layers, device=engine.device)
        out.append(DistillSequence(torch.tensor(ids), p, final, aux))
    return out
