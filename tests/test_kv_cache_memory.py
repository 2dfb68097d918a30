"""A CPU KV pool costs memory as it fills, not when it is allocated (attention/kv_cache.lazy_zeros):
torch.zeros wrote every byte, so SmolLM2's default 4.2 GB pool was resident at start."""
from __future__ import annotations

import sys

import pytest
import torch

from specinfer.attention.kv_cache import lazy_zeros

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status (Linux)")


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lazy_zeros_is_an_ordinary_zero_tensor(dtype):
    t = lazy_zeros((2, 7, 16, 3, 8), dtype)
    assert t.shape == (2, 7, 16, 3, 8) and t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()
    assert t.data_ptr() % 64 == 0
    assert not t.any()
    t[1, 3] = 1.5  # writable, and views of it write through
    assert float(t.sum()) == 1.5 * 16 * 3 * 8


CHILD = """
import json, sys
import torch
from specinfer.attention.kv_cache import lazy_zeros
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:")) * 1024
size = 512 << 20
before = rss()
t = lazy_zeros((size // 4,), torch.float32)
after_alloc = rss()
t[: size // 16].fill_(1.0)
print(json.dumps([before, after_alloc, rss()]))
"""


@linux_only
def test_a_large_pool_is_not_resident_until_written():
    """In a fresh process (a long-lived one may hand back heap memory that is already resident,
    zeroed: correct, but nothing to measure)."""
    import json
    import os
    import subprocess

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
    before, after_alloc, after_write = json.loads(out.stdout.strip().splitlines()[-1])
    size = 512 << 20
    assert after_alloc - before < size // 8, (before, after_alloc)  # torch.zeros: + size
    assert size // 8 < after_write - after_alloc < size // 2, (after_alloc, after_write)  # a quarter written


@linux_only
def test_the_engine_cpu_pool_is_lazy(tiny_dir):
    from specinfer import Generator, SamplingParams

    path, _ = tiny_dir("llama", False)
    before = rss_bytes()
    gen = Generator(str(path), num_kv_blocks=80000, block_size=16, max_model_len=256)  # 655 MB of KV
    pool = sum(c.numel() * c.element_size() for c in gen.engine.runner.kv_caches)
    assert pool > 600 << 20
    assert rss_bytes() - before < pool // 4
    out = gen.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    assert len(out[0].token_ids) == 8
