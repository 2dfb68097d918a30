"""The native CPU attention backend: the Rust paged-attention kernel (rust/kernels) run on the
torch tensors' memory, with the GIL released. Registered as "cpu_native"; the CPU default.

One call per layer stores the batch's new K/V into their slots and attends the whole mixed batch
(prefill chunks, decodes, 1 + k verification runs) straight over the block pool: no gather copy,
no padding, no mask tensor. The kernel threads over (sequence, kv head, query tile) items with
`torch.get_num_threads()` workers unless told otherwise (`num_threads`, or the environment
variable SPECINFER_ATTENTION_THREADS), and uses AVX-512, AVX2+FMA or portable code as the CPU
allows (`isa` forces one; `specinfer._core.cpu_kernel_isa()` says what this CPU has).

Token trees (`meta.tree_mask` / `tree_start`, see attention/metadata.py) go to the kernel with
the layout and are applied inside it; without them the kernel runs its plain causal code.

Per-layer options (attention/backend.py): a sliding window and a logit soft-cap go to the kernel
as two plain parameters of its call (the window narrows the keys each query row visits; the
soft-cap maps each score before the mask); left out, the kernel runs exactly its plain code.

One exception, on CPUs with AMX only (SDPA_ROUTE): over a bfloat16 cache, query runs of at least
SDPA_MIN_QUERY_LEN tokens (long prefill chunks) go to torch's SDPA (as in torch_ref: keys
gathered per sequence), whose AMX bf16 kernel beat this f32-arithmetic kernel 2.5x on a
512-token chunk on an Intel Xeon (measured before the kernel's row path was reworked, 3x faster
since; not re-measured there). Without AMX (AVX-512 BF16 on Zen 5) the kernel is the faster one:
2.1 vs 6.8 ms on a 512-token chunk, 0.83 vs 2.0 ms on 128 tokens at context 384. The kernel
still stores the routed runs' K/V and attends every other run of the batch. Under a sliding
window the routed runs' SDPA masks carry the window; a layer with a soft-cap routes nothing (SDPA
has no score hook): the kernel attends every run.

Memory contract (asserted here, sizes re-checked in Rust): CPU tensors of one dtype (float32 or
bfloat16; q/k/v are cast to the cache's; a float16 cache goes to torch_ref instead), q [T, H, D] and k/v [T, Hkv, D] with unit stride along
D (strided token/head axes are fine: views of the fused qkv tensor), the cache
[2, num_blocks, block_size, Hkv, D] contiguous; the metadata is validated once per forward.
"""
from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specinfer._core import CpuPagedBatch
from specinfer.attention.metadata import AttentionMetadata
from specinfer.platform.cpu_features import has_amx_bf16

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
SDPA_MIN_QUERY_LEN = {torch.bfloat16: 64}  # cache dtype -> query runs at least this long go to SDPA
SDPA_ROUTE = has_amx_bf16()  # whether they do (see the module doc)
THREADS_ENV = "SPECINFER_ATTENTION_THREADS"


@dataclass
class CpuNativePrepared:
    batch: CpuPagedBatch  # the validated layout (slots, runs, block table), shared by every layer
    num_tokens: int  # T
    block_size: int
    meta: AttentionMetadata
    fallback: object = None  # torch_ref's prepared metadata, built on first use (float16 caches)
    split: dict = field(default_factory=dict)  # min query len -> (batch skipping long runs, long runs)
    masked: dict = field(default_factory=dict)  # (min query len, window) -> long runs with their SDPA masks


def _threads_setting() -> int | None:
    value = os.environ.get(THREADS_ENV)
    if not value:
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{THREADS_ENV} must be an integer >= 1 (got {value!r})")
    return n


class CpuNativeBackend:
    name = "cpu_native"
    # True: each query row's attention is the same bits in a decode, a verification run or a
    # prefill chunk (AVX-512, head_dim 32/64/128: one kernel path for every run; ~40 % slower on
    # prefill chunks). Set by ModelRunner for quantization="w8a8" models, whose activation
    # rounding would turn float noise between those runs into different greedy tokens.
    batch_invariant = False

    def __init__(self, num_threads: int | None = None, isa: str | None = None):
        if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
            raise ValueError(f"num_threads must be an integer >= 1 or None (got {num_threads!r})")
        self.num_threads = num_threads if num_threads is not None else _threads_setting()
        self.isa = isa

    def prepare(self, meta: AttentionMetadata) -> CpuNativePrepared:
        assert meta.slot_mapping.device.type == "cpu", "cpu_native: metadata must be on the CPU"
        batch = CpuPagedBatch(meta.slot_mapping.numpy(), meta.query_start_loc.numpy(), meta.seq_lens.numpy(),
                              meta.block_table.numpy(), meta.block_size, None, *_tree_arrays(meta),
                              batch_invariant=self.batch_invariant)
        return CpuNativePrepared(batch, meta.num_tokens, meta.block_size, meta)

    def forward(self, q, k, v, kv_cache, prepared: CpuNativePrepared, scale: float, *,
                window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        # q [T, H, D], k/v [T, Hkv, D] (strided views allowed), kv_cache [2, NB, BS, Hkv, D] -> [T, H, D]
        # window: sliding window W (None: full causal); softcap: c in c * tanh(s / c) (None: none)
        if window is not None and (not isinstance(window, numbers.Integral) or isinstance(window, bool) or window < 1):
            raise ValueError(f"cpu_native: window must be an integer >= 1 or None (got {window!r})")
        if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
            raise ValueError(f"cpu_native: softcap must be a finite number > 0 or None (got {softcap!r})")
        T, H, D = q.shape
        Hkv = k.shape[1]
        dtype = kv_cache.dtype
        name = DTYPE_NAMES.get(dtype)
        if name is None:  # e.g. float16: the kernel has no such element type
            return self._torch_ref(q, k, v, kv_cache, prepared, scale, window, softcap)
        assert kv_cache.device.type == "cpu" and kv_cache.is_contiguous(), "cpu_native: kv_cache must be a contiguous CPU tensor"
        assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2 and kv_cache.shape[3:] == (Hkv, D), (
            f"cpu_native: kv_cache shape {tuple(kv_cache.shape)} is not [2, num_blocks, block_size, {Hkv}, {D}]")
        assert kv_cache.shape[2] == prepared.block_size, "cpu_native: kv_cache block_size differs from the batch's"
        assert T == prepared.num_tokens, f"cpu_native: {T} query tokens for a batch of {prepared.num_tokens}"
        assert H % Hkv == 0, f"cpu_native: num_heads {H} is not a multiple of num_kv_heads {Hkv}"
        views = []
        for label, x, heads in (("q", q, H), ("k", k, Hkv), ("v", v, Hkv)):
            if x.dtype != dtype:
                x = x.to(dtype)
            if x.stride(2) != 1:
                x = x.contiguous()
            assert x.device.type == "cpu" and tuple(x.shape) == (T, heads, D), (
                f"cpu_native: {label} shape {tuple(x.shape)} is not [{T}, {heads}, {D}]")
            views.append(x)
        q, k, v = views
        out = torch.empty(T, H, D, dtype=dtype)
        threads = self.num_threads if self.num_threads is not None else torch.get_num_threads()
        batch, long_runs = prepared.batch, ()
        # SDPA: another arithmetic, so never in batch-invariant mode; no soft-cap in SDPA
        min_len = (None if self.batch_invariant or softcap is not None or not SDPA_ROUTE
                   else SDPA_MIN_QUERY_LEN.get(dtype))
        if min_len is not None and prepared.meta.max_query_len >= min_len:
            batch, long_runs = self._split(prepared, min_len, window)
        batch.forward(
            name, out.data_ptr(), (q.data_ptr(), q.stride(0), q.stride(1)), (k.data_ptr(), k.stride(0), k.stride(1)),
            (v.data_ptr(), v.stride(0), v.stride(1)), kv_cache.data_ptr(), H, Hkv, D, kv_cache.shape[1],
            kv_cache.shape[2], float(scale), threads, self.isa, None if window is None else int(window),
            None if softcap is None else float(softcap))
        if long_runs:
            _sdpa_runs(q, kv_cache.view(2, -1, Hkv, D), long_runs, float(scale), H != Hkv, out)
        return out

    @staticmethod
    def _split(prepared: CpuNativePrepared, min_len: int, window: int | None = None):
        """(a batch whose kernel call skips runs of >= min_len tokens, those runs with their SDPA
        masks under the sliding window), once per forward (the masks once per window)."""
        if min_len not in prepared.split:
            meta = prepared.meta
            qsl = meta.query_start_loc.tolist()
            lens = meta.seq_lens.tolist()
            tree = meta.tree_mask.tolist() if meta.has_tree else None
            # tree runs (<= 64 tokens) stay in the kernel, which applies their masks
            skip = [qsl[s + 1] - qsl[s] >= min_len and not (tree and any(tree[qsl[s]:qsl[s + 1]]))
                    for s in range(len(lens))]
            runs = []
            for s in (s for s, long in enumerate(skip) if long):
                L = lens[s]
                pos = torch.arange(L, dtype=torch.int64)
                slots = meta.block_table[s].to(torch.int64)[pos // meta.block_size] * meta.block_size + pos % meta.block_size
                runs.append((qsl[s], qsl[s + 1], slots))
            batch = CpuPagedBatch(meta.slot_mapping.numpy(), meta.query_start_loc.numpy(), meta.seq_lens.numpy(),
                                  meta.block_table.numpy(), meta.block_size, skip, *_tree_arrays(meta),
                                  batch_invariant=prepared.batch.batch_invariant)
            prepared.split[min_len] = (batch, tuple(runs))
        batch, runs = prepared.split[min_len]
        if (min_len, window) not in prepared.masked:
            prepared.masked[min_len, window] = tuple(
                (start, end, slots, _sdpa_mask(end - start, len(slots), window)) for start, end, slots in runs)
        return batch, prepared.masked[min_len, window]

    @staticmethod
    def _torch_ref(q, k, v, kv_cache, prepared: CpuNativePrepared, scale: float, window=None,
                   softcap=None) -> torch.Tensor:
        from specinfer.attention.torch_ref import TorchRefBackend

        ref = TorchRefBackend()
        if prepared.fallback is None:
            prepared.fallback = ref.prepare(prepared.meta)
        return ref.forward(q, k, v, kv_cache, prepared.fallback, scale, window=window, softcap=softcap)


def _sdpa_mask(n: int, L: int, window: int | None) -> torch.Tensor | None:
    """bool [n, L]: query i of a run (at position L - n + i) sees key j; None: plain causal over
    the whole sequence (SDPA's is_causal)."""
    if n == L and window is None:
        return None
    key, query = torch.arange(L).unsqueeze(0), torch.arange(L - n, L).unsqueeze(1)
    mask = key <= query
    if window is not None:
        mask &= query - key < window
    return mask


def _tree_arrays(meta: AttentionMetadata) -> tuple:
    """(tree_mask int64[T], tree_start int32[S]) as numpy for the kernel, or (None, None)."""
    if not meta.has_tree:
        return None, None
    assert meta.tree_start is not None, "cpu_native: tree_mask without tree_start"
    return meta.tree_mask.to(torch.int64).numpy(), meta.tree_start.to(torch.int32).numpy()


def _sdpa_runs(q, kv_flat, runs, scale: float, gqa: bool, out: torch.Tensor) -> None:
    """Long query runs through torch SDPA over their gathered keys (as torch_ref does).
    q [T, H, D], kv_flat [2, slots, Hkv, D]; writes out's rows of each run."""
    for start, end, slots, mask in runs:
        qs = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        kk = kv_flat[0][slots].transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
        vv = kv_flat[1][slots].transpose(0, 1).unsqueeze(0)
        if mask is None:
            o = F.scaled_dot_product_attention(qs, kk, vv, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(qs, kk, vv, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[start:end] = o.squeeze(0).transpose(0, 1)
