"""What the host-cost benches share (host_overhead.py, overlap_standin.py): a one-layer, 32-wide
random Llama whose forward is ~0.1 ms (the model's compute taken out of the step) and prompts that
repeat a phrase of 8 tokens (prompt lookup always finds a match)."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

TINY_LLAMA = dict(scale=2.0, layers=1, hidden=32, heads=2, kv_heads=1)


def build_tiny_llama(path: Path, **kw) -> None:
    from tiny_models import build_tiny_model

    build_tiny_model(path, "llama", **TINY_LLAMA, **kw)


def repetitive_prompts(batch: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(batch):
        phrase = torch.randint(3, 256, (8,), generator=g).tolist()
        prompts.append((phrase * (length // 8 + 1))[:length])
    return prompts


def add_workload_arguments(ap, repeats: int) -> None:
    """The host benches' workload flags: --batch, --prompt-len, --new-tokens, --k, --repeats."""
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=repeats)
