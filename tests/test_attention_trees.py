"""Token-tree attention (docs/trees.md, "Attention") in every backend (torch_ref, cpu_native,
hpu_flat, triton under TRITON_INTERPRET=1) against the dense oracle of tests/tree_batch.py: mixed
batches of prefill chunks, decodes, chain verifications and random trees, MQA and batch-expansion
layouts, GQA and MHA, several block sizes.
"""
import os
import random

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: @triton.jit reads it at decoration

import pytest  # noqa: E402
import torch  # noqa: E402

from specinfer.attention import AttentionMetadata, get_backend  # noqa: E402
from tree_batch import Request, TreeBatch, build, mixed_requests  # noqa: E402


def run(backend, b: TreeBatch) -> torch.Tensor:
    cache = b.cache.clone()
    return backend.forward(b.q, b.k, b.v, cache, backend.prepare(b.meta), b.q.shape[-1] ** -0.5)


CASES = [  # layout, block_size, H, Hkv, D, seed
    ("mqa", 1, 4, 4, 8, 0),  # MHA, one slot per block
    ("mqa", 4, 8, 2, 16, 1),  # GQA 4
    ("mqa", 16, 4, 1, 32, 2),  # MQA heads
    ("expand", 1, 4, 2, 8, 3),
    ("expand", 4, 4, 4, 16, 4),
    ("expand", 16, 8, 1, 32, 5),
]


@pytest.mark.parametrize("layout,block_size,H,hkv,D,seed", CASES)
def test_torch_ref_matches_explicit_masks(layout, block_size, H, hkv, D, seed):
    b = build(mixed_requests(random.Random(seed)), layout, block_size, H, hkv, D, seed)
    torch.testing.assert_close(run(get_backend("torch_ref"), b).double(), b.want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["mqa", "expand"])
def test_chain_shaped_tree_equals_causal_chain(layout):
    """A tree whose parents form a chain is a causal verification run: same oracle, same output."""
    chain = build([Request(9, "prefill", 20), Request(5, "chain", 6)], layout, 4, 4, 2, 8, 3)
    tree = build([Request(9, "prefill", 20), Request(5, "tree", 6, [-1, 0, 1, 2, 3])], layout, 4, 4, 2, 8, 3)
    assert tree.meta.has_tree and not chain.meta.has_tree
    torch.testing.assert_close(tree.want, chain.want, atol=0, rtol=0)
    for name in ("torch_ref", "cpu_native", "hpu_flat"):
        torch.testing.assert_close(run(get_backend(name), tree), run(get_backend(name), chain), atol=1e-6, rtol=1e-6)


def test_oracle_masks_matter():
    """The batches are not causal in disguise: dropping the tree masks changes the output."""
    b = build(mixed_requests(random.Random(7)), "mqa", 4, 4, 2, 8, 7)
    causal = AttentionMetadata(**{**b.meta.__dict__, "tree_mask": None, "tree_start": None})
    out = run(get_backend("torch_ref"), TreeBatch(causal, b.cache, b.q, b.k, b.v, b.want)).double()
    assert (out - b.want).abs().max() > 1e-2


# ---------------------------------------------------------------- cpu_native (the Rust kernel)


def _isas() -> list[str]:
    from specinfer._core import cpu_kernel_isa

    return cpu_kernel_isa()[1]


@pytest.mark.parametrize("layout,block_size,H,hkv,D,seed", CASES)
def test_cpu_native_matches_explicit_masks(layout, block_size, H, hkv, D, seed):
    from specinfer.attention.cpu_native import CpuNativeBackend

    b = build(mixed_requests(random.Random(seed)), layout, block_size, H, hkv, D, seed)
    for isa in _isas():  # the portable path and every SIMD path this CPU has
        for threads in (1, 3):
            out = run(CpuNativeBackend(num_threads=threads, isa=isa), b).double()
            torch.testing.assert_close(out, b.want, atol=2e-5, rtol=2e-5, msg=lambda m: f"{isa} x{threads}: {m}")


def test_cpu_native_bf16_keeps_tree_runs_out_of_sdpa(monkeypatch):
    """bf16 sends query runs >= 64 tokens to SDPA (on AMX CPUs); a 63-node tree run (64 tokens)
    must stay in the kernel, which applies its mask, while a long prefill chunk beside it still
    goes to SDPA."""
    from specinfer.attention import cpu_native
    from specinfer.attention.cpu_native import CpuNativeBackend

    monkeypatch.setattr(cpu_native, "SDPA_ROUTE", True)
    rng = random.Random(11)
    reqs = mixed_requests(rng) + [Request(5, "prefill", 70)]
    b = build(reqs, "mqa", 16, 8, 2, 64, 11, dtype=torch.bfloat16)
    assert b.meta.max_query_len >= cpu_native.SDPA_MIN_QUERY_LEN[torch.bfloat16]
    backend = CpuNativeBackend(num_threads=2)
    prepared = backend.prepare(b.meta)
    out = backend.forward(b.q, b.k, b.v, b.cache.clone(), prepared, 64 ** -0.5).double()
    (_, long_runs), = prepared.split.values()
    assert [e - s for s, e, *_ in long_runs] == [70]  # only the prefill chunk went to SDPA
    torch.testing.assert_close(out, b.want, atol=2e-2, rtol=2e-2)


def test_cpu_native_float16_falls_back_to_torch_ref_with_trees():
    from specinfer.attention.cpu_native import CpuNativeBackend

    b = build(mixed_requests(random.Random(12), small=True), "mqa", 4, 4, 2, 16, 12, dtype=torch.float16)
    torch.testing.assert_close(run(CpuNativeBackend(), b).double(), b.want, atol=2e-3, rtol=2e-3)


def test_cpu_native_refuses_bad_tree_metadata():
    from specinfer.attention.cpu_native import CpuNativeBackend

    b = build([Request(0, "tree", 3, [-1, 0])], "mqa", 4, 2, 1, 8, 0)
    bad = AttentionMetadata(**{**b.meta.__dict__, "tree_mask": torch.tensor([1, 3, 4])})  # node 2 misses the root
    with pytest.raises(ValueError, match="tree_mask"):
        CpuNativeBackend().prepare(bad)
    bad = AttentionMetadata(**{**b.meta.__dict__, "tree_start": torch.tensor([9], dtype=torch.int32)})
    with pytest.raises(ValueError, match="tree_start"):
        CpuNativeBackend().prepare(bad)


# ---------------------------------------------------------------- hpu_flat (plain torch)


@pytest.mark.parametrize("path", ["dense", "flat"])
@pytest.mark.parametrize("layout,block_size,H,hkv,D,seed", CASES)
def test_hpu_flat_matches_explicit_masks(path, layout, block_size, H, hkv, D, seed):
    from specinfer.attention.hpu_backend import HpuFlatBackend

    b = build(mixed_requests(random.Random(seed)), layout, block_size, H, hkv, D, seed)
    out = run(HpuFlatBackend(multi_token_path=path), b).double()
    torch.testing.assert_close(out, b.want, atol=2e-5, rtol=2e-5)


# ---------------------------------------------------------------- triton (TRITON_INTERPRET=1 on CPU)

TRITON_CASES = [  # layout, block_size, H, Hkv, D, seed: the interpreter is slow, so fewer and smaller
    ("mqa", 4, 4, 2, 16, 21),  # GQA 2; D 16
    ("mqa", 1, 2, 2, 8, 22),  # MHA, block_size 1, D padded to 16
    ("expand", 16, 8, 1, 16, 23),  # 8 heads packed into one tile
]


@pytest.mark.parametrize("layout,block_size,H,hkv,D,seed", TRITON_CASES)
def test_triton_matches_explicit_masks(layout, block_size, H, hkv, D, seed):
    from specinfer.attention.triton_backend import TritonBackend

    b = build(mixed_requests(random.Random(seed), small=True), layout, block_size, H, hkv, D, seed)
    out = run(TritonBackend(), b).double()
    torch.testing.assert_close(out, b.want, atol=2e-5, rtol=2e-5)


def test_triton_tree_contract_is_asserted():
    from specinfer.kernels.triton import paged_attention

    b = build([Request(2, "tree", 3, [-1, 0])], "mqa", 4, 2, 1, 16, 0)
    m = b.meta
    args = (b.q, b.cache, m.block_table, m.query_start_loc, m.seq_lens, m.max_query_len, 0.25)
    with pytest.raises(AssertionError, match="tree_mask"):
        paged_attention(*args, tree_mask=m.tree_mask.int(), tree_start=m.tree_start)
    with pytest.raises(AssertionError, match="tree_start"):
        paged_attention(*args, tree_mask=m.tree_mask, tree_start=None)
