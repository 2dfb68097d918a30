"""GEMM weights kept in a GGUF file's own block formats (`quantization="gguf"`, the default for a
`.gguf` model on CPU): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K (and F32 / F16 / BF16
tensors as they are), read straight from the file's memory map — never inflated, never copied
except the rows of llama-arch Q and K, which llama.cpp stored permuted (a row reorder: the
blocks themselves are copied as they are).

The Rust kernel `specinfer._core.gguf_linear` (rust/kernels/src/gguf_linear/) quantizes each
activation row per block the way llama.cpp does for these formats (blocks of 32 for the 32-value
formats, of 256 for the K formats) and sums every block exactly in int32 (AVX2), one output at
a time from one weight row and one activation row, so a token's outputs do not depend on the
batch it shares a call with: greedy speculative decoding stays token-for-token exact (the
model's attention runs batch-invariant, as under w8a8).

    w = GgufWeight(n, k)                 # filled by load(rows, StoredTensor) row range by range
    y = gguf_linear(x, w, bias)          # same contract as F.linear
    e = w.embedding(ids)                 # rows dequantized (an embedding table)

A weight is a list of parts, one per stored tensor it was filled from: a fused q|k|v weight is
three parts, of different types in llama.cpp's mixes (Q4_K_M keeps some attn_v in Q6_K); one
kernel call computes all their columns.
"""
from __future__ import annotations

import mmap
from dataclasses import dataclass

import numpy as np
import torch

from specinfer._core import gguf_linear as _gguf_linear_kernel
from specinfer._core import gguf_repack as _gguf_repack
from specinfer._core import gguf_rows as _gguf_rows

# ggml type id -> (values, bytes) per block, for the types the kernel multiplies
# (Q4_0R / Q4_1R / Q5_0R: Q4_0 / Q4_1 / Q5_0 rows repacked in octets at load, the kernels' layout
# (rust/kernels/src/gguf_linear/q32_octets.rs); Q4_KR: Q4_K rows repacked in groups of eight
# rows (kquants_x8.rs); not ggml types, named as the data they hold)
Q4_0R, Q4_1R, Q5_0R, Q4_KR = 0x1002, 0x1003, 0x1006, 0x100C
BLOCKS = {0: (1, 4), 1: (1, 2), 30: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
          12: (256, 144), 13: (256, 176), 14: (256, 210), Q4_0R: (32, 18), Q4_1R: (32, 20), Q5_0R: (32, 22), Q4_KR: (256, 144)}
TYPE_NAMES = {0: "F32", 1: "F16", 30: "BF16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 12: "Q4_K",
              13: "Q5_K", 14: "Q6_K", Q4_0R: "Q4_0", Q4_1R: "Q4_1", Q5_0R: "Q5_0", Q4_KR: "Q4_K"}
# the repacked types whose rows are interleaved in groups of this many (a row range must start on
# a group and end on one or at the tensor's end)
ROW_GROUPS = {Q4_KR: 8}


def row_bytes(type_id: int, cols: int) -> int:
    per, nbytes = BLOCKS[type_id]
    if cols % per:
        raise ValueError(f"a row of {cols} values is not a whole number of {TYPE_NAMES[type_id]} blocks ({per})")
    return cols // per * nbytes


@dataclass(frozen=True)
class StoredTensor:
    """A 2-D GGUF tensor as stored: `data` uint8 [rows, row_bytes] (a view of the file's memory
    map, or a copy of reordered rows), `cols` values a row, ggml `type_id`."""

    type_id: int
    data: np.ndarray
    cols: int

    def __post_init__(self):
        if self.type_id not in BLOCKS:
            raise ValueError(f"ggml type {self.type_id} cannot be kept as stored (supported: "
                             f"{', '.join(TYPE_NAMES.values())})")
        rb = row_bytes(self.type_id, self.cols)
        if self.data.dtype != np.uint8 or self.data.ndim != 2 or self.data.shape[1] != rb:
            raise ValueError(f"stored {TYPE_NAMES[self.type_id]} tensor: data {self.data.dtype}"
                             f"{list(self.data.shape)} is not uint8 [rows, {rb}]")
        if not self.data.flags.c_contiguous:
            raise ValueError("stored tensor data must be contiguous")

    @classmethod
    def from_bytes(cls, data: np.ndarray, type_id: int, shape: tuple[int, int]) -> StoredTensor:
        rows, cols = shape
        return cls(type_id, np.ascontiguousarray(data).view(np.uint8).reshape(rows, row_bytes(type_id, cols)), cols)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.data.shape[0], self.cols))

    @property
    def type_name(self) -> str:
        return TYPE_NAMES[self.type_id]

    def take_rows(self, order) -> StoredTensor:
        """The rows in `order` (a copy of their blocks)."""
        return StoredTensor(self.type_id, np.ascontiguousarray(self.data[np.asarray(order)]), self.cols)

    def rows(self, start: int, stop: int) -> StoredTensor:
        group = ROW_GROUPS.get(self.type_id, 1)
        if start % group or (stop % group and stop != self.data.shape[0]):
            raise ValueError(f"rows {start}:{stop} of a {TYPE_NAMES[self.type_id]} tensor repacked in groups of "
                             f"{group} rows: a range must start and end on a group (or at the last row)")
        return StoredTensor(self.type_id, self.data[start:stop], self.cols)

    def kernel_layout(self) -> StoredTensor:
        """The tensor in the kernels' layout (a copy of the same size; every other type as it is,
        no copy): Q4_0, Q4_1 and Q5_0 rows of >= 256 values repacked in octets (1.4-2.7x the file
        layout's decode speed on AVX2, the notebook's "GGUF: ... Q4_1 in octets ..."), Q4_K rows in
        groups of eight rows (1.8x at one activation row, 1.5-1.7x at 4-16: "GGUF: Q4_K in groups
        of eight rows")."""
        if not ((self.type_id in (2, 3, 6) and self.cols >= 256) or self.type_id == 12):
            return self
        out = _resident_buffer(self.data.shape)
        type_id = _gguf_repack(self.data.ctypes.data, self.data.nbytes, self.type_id, self.data.shape[0],
                               self.cols, out.ctypes.data)
        _release_file_pages(self.data)
        return StoredTensor(type_id, out, self.cols)


def _resident_buffer(shape: tuple[int, int]) -> np.ndarray:
    """uint8 memory for a repacked copy, in small pages (first touched by the repack's threads):
    numpy's allocator asks for transparent huge pages on large arrays, and on this project's VMs
    the first touch of each 2 MB page (zeroed, and compacted for where memory is fragmented) made
    a Qwen2.5-1.5B build 3.8 s instead of 1.7 s; huge pages did not speed the decode (1.02x,
    notebook "GGUF: Q4_K in groups of eight rows"). (MAP_POPULATE, mapping it all in one call,
    was slower than the repack's two threads touching it.)"""
    nbytes = int(np.prod(shape))
    if nbytes == 0 or not hasattr(mmap, "MAP_ANONYMOUS"):
        return np.empty(shape, dtype=np.uint8)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buf, dtype=np.uint8).reshape(shape)  # the array keeps the mapping alive


def _release_file_pages(data: np.ndarray) -> None:
    """Drop the whole pages of `data` from this process's memory when it is a view of a file's
    read-only memory map (a repacked copy replaced it): the process then holds about the file's
    size, not the file plus the copy. Harmless for a file map (the pages come back from the page
    cache if read again); anything else (heap arrays) is left alone."""
    base = data
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    if not isinstance(base, mmap.mmap) or not hasattr(mmap, "MADV_DONTNEED") or data.nbytes == 0:
        return
    start = data.ctypes.data - np.frombuffer(base, dtype=np.uint8, count=1).ctypes.data
    page = mmap.PAGESIZE
    lo, hi = -(-start // page) * page, (start + data.nbytes) // page * page
    if hi > lo:
        base.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


class GgufWeight:
    """A [N, K] GEMM weight held as stored GGUF rows: parts covering rows 0..N in order, each
    filled by `load(rows, StoredTensor)`."""

    dtype = torch.uint8
    device = torch.device("cpu")

    def __init__(self, n: int, k: int):
        self._shape = torch.Size((n, k))
        self._parts: dict[int, StoredTensor] = {}  # first row -> part
        self._kernel_parts = None
        # False for a table only looked up (an untied embedding): its rows stay in the file's
        # layout, which `embedding` reads directly (no repacked copy to build or hold)
        self.for_gemm = True

    @property
    def shape(self) -> torch.Size:
        return self._shape

    @property
    def parts(self) -> list[tuple[int, StoredTensor]]:
        return sorted(self._parts.items())

    @property
    def nbytes(self) -> int:
        return sum(p.data.nbytes for p in self._parts.values())

    @property
    def type_names(self) -> list[str]:
        return [p.type_name for _, p in self.parts]

    def rows_shape(self, rows: slice | None) -> tuple[int, int]:
        n, k = self._shape
        start, stop, _ = (rows or slice(None)).indices(n)
        return (stop - start, k)

    def load(self, rows: slice | None, tensor) -> None:
        if not isinstance(tensor, StoredTensor):
            raise ValueError("quantization='gguf' keeps a GGUF file's tensors as stored; this weight got a "
                             f"{type(tensor).__name__} (load a .gguf file, or use quantization=None / 'int8')")
        n, k = self._shape
        start, stop, _ = (rows or slice(None)).indices(n)
        if tuple(tensor.shape) != (stop - start, k):
            raise ValueError(f"stored tensor {tuple(tensor.shape)} does not fill rows {start}:{stop} of {n} x {k}")
        self._parts[start] = tensor.kernel_layout() if self.for_gemm else tensor
        self._kernel_parts = None

    def _kernel_args(self) -> list[tuple[int, int, int]]:
        if self._kernel_parts is None:
            at = 0
            for start, p in self.parts:
                if start != at:
                    raise RuntimeError(f"GGUF weight {tuple(self._shape)}: rows {at}:{start} were never loaded")
                at += p.data.shape[0]
            if at != self._shape[0]:
                raise RuntimeError(f"GGUF weight {tuple(self._shape)}: rows {at}: were never loaded")
            self._kernel_parts = [(p.type_id, p.data.ctypes.data, p.data.shape[0]) for _, p in self.parts]
        return self._kernel_parts

    def dequantize(self, rows: torch.Tensor | slice | None = None) -> torch.Tensor:  # -> float32[len, K]
        n, k = self._shape
        ids = torch.arange(n) if rows is None else (torch.arange(n)[rows] if isinstance(rows, slice) else rows)
        return self.embedding(ids.reshape(-1))

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:  # int64[T] -> float32[T, K]
        n, k = self._shape
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), k, dtype=torch.float32)
        if ids.numel() == 0:
            return out
        self._kernel_args()  # every row loaded
        parts = self.parts
        if len(parts) == 1:
            p = parts[0][1]
            _gguf_rows(p.data.ctypes.data, p.data.nbytes, p.type_id, k, ids.data_ptr(), ids.numel(), out.data_ptr())
            return out
        for start, p in parts:  # rows of several parts: each part's ids in turn
            stop = start + p.data.shape[0]
            sel = ((ids >= start) & (ids < stop)).nonzero().reshape(-1)
            if sel.numel():
                local = (ids[sel] - start).contiguous()
                part_out = torch.empty(sel.numel(), k, dtype=torch.float32)
                _gguf_rows(p.data.ctypes.data, p.data.nbytes, p.type_id, k, local.data_ptr(), local.numel(),
                           part_out.data_ptr())
                out[sel] = part_out
        if ((ids < 0) | (ids >= n)).any():
            raise ValueError(f"embedding ids outside 0..{n - 1}")
        return out

    def row_slice(self, start: int, stop: int) -> GgufWeight:
        """Rows start:stop as a weight sharing this one's memory (tensor-parallel shards)."""
        n, k = self._shape
        out = GgufWeight(stop - start, k)
        out.for_gemm = self.for_gemm
        for p_start, p in self.parts:
            p_stop = p_start + p.data.shape[0]
            lo, hi = max(start, p_start), min(stop, p_stop)
            if lo < hi:
                out.load(slice(lo - start, hi - start), p.rows(lo - p_start, hi - p_start))
        return out


def gguf_linear(x: torch.Tensor, weight: GgufWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) -> [..., N] in x's dtype; float32 inside. (Called ~120 times a
    decode step: the common case, a contiguous float32 [T, K] input, converts nothing.)"""
    N, K = weight._shape
    if x.shape[-1] != K:
        raise ValueError(f"gguf_linear: x has {x.shape[-1]} features, the weight takes {K}")
    if x.device.type != "cpu":
        raise ValueError("gguf_linear: CPU tensors only")
    x2 = x if x.dim() == 2 else x.reshape(-1, K)
    if x2.dtype != torch.float32:
        x2 = x2.float()
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    M = x2.shape[0]
    out = torch.empty(M, N, dtype=torch.float32)
    b = 0
    if bias is not None:
        if bias.shape != (N,):
            raise ValueError(f"gguf_linear: bias shape {tuple(bias.shape)} is not ({N},)")
        if bias.dtype != torch.float32 or not bias.is_contiguous():
            bias = bias.float().contiguous()
        b = bias.data_ptr()
    _gguf_linear_kernel(x2.data_ptr(), M, K, weight._kernel_parts or weight._kernel_args(), out.data_ptr(), b,
                        torch.get_num_threads())
    if x.dtype != torch.float32:
        out = out.to(x.dtype)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], N)
