"""A GGUF file's metadata and tensor index, read in one pass over its header, with each tensor's
data a view of one read-only memory map of the file.

The `gguf` package's GGUFReader builds a numpy view for every part of every metadata field (a
tokenizer's 150k vocabulary strings and merges: ~300k views, 4.4 s for SmolLM2's file, more for
Qwen's); the loader needs the values, so this reads them with struct from the mapped bytes. The
format (GGUF v2 and v3, little-endian): magic "GGUF", version u32, tensor count u64, metadata
count u64; each metadata entry a key string (u64 length + UTF-8), a value type u32 and the value
(arrays: element type u32, count u64, elements); then per tensor its name, dimension count u32,
dimensions u64 (innermost first), ggml type u32 and data offset u64; the data starts at the next
multiple of `general.alignment` (default 32). Type ids and block sizes come from `gguf`.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
          12: "<f8"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # as stored: innermost dimension first
    tensor_type: int  # ggml type id (gguf.GGMLQuantizationType)
    data: np.ndarray  # uint8 view of the tensor's bytes in the file's memory map

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class GGUFFile:
    """`fields`: metadata key -> value (int, float, bool, str, or a list of them); `tensors`."""

    def __init__(self, path: str):
        from gguf.constants import GGML_QUANT_SIZES

        with open(path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:  # an empty file
                raise ValueError(f"empty file ({e})") from e
        buf = memoryview(self._map)
        self._buf, self._pos = buf, 0
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError(f"bad magic {bytes(buf[:4])!r} (not a GGUF file)")
        self._pos = 4
        self.version = self._scalar("<I")
        if self.version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {self.version}")
        n_tensors, n_kv = self._scalar("<Q"), self._scalar("<Q")
        # counts checked against what the file can hold (a key/value takes >= 12 bytes, a tensor
        # description >= 24) before any loop trusts them
        room = len(buf) - self._pos
        if n_kv * 12 > room or n_tensors * 24 > room:
            raise ValueError(f"the header claims {n_tensors} tensors and {n_kv} metadata keys; a file of "
                             f"{len(buf)} bytes cannot hold them (truncated or corrupted)")
        self.fields: dict[str, object] = {}
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = self._value(self._scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._scalar("<I")
            if n_dims > 8:
                raise ValueError(f"tensor {name!r} claims {n_dims} dimensions (corrupted)")
            dims = tuple(self._scalar("<Q") for _ in range(n_dims))
            infos.append((name, dims, self._scalar("<I"), self._scalar("<Q")))
        align = int(self.fields.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        whole = np.frombuffer(buf, dtype=np.uint8)
        self.tensors: list[GGUFTensor] = []
        for name, dims, kind, offset in infos:
            n = 1
            for d in dims:
                n *= d
            if kind not in GGML_QUANT_SIZES:
                raise ValueError(f"tensor {name!r} has unknown ggml type {kind}")
            per, nbytes = GGML_QUANT_SIZES[kind]
            if n % per:
                raise ValueError(f"tensor {name!r}: {n} values are not whole blocks of {per}")
            lo = start + offset
            hi = lo + n // per * nbytes
            if hi > len(buf):
                raise ValueError(f"tensor {name!r} data runs past the end of the file (truncated)")
            self.tensors.append(GGUFTensor(name, dims, kind, whole[lo:hi]))

    def _scalar(self, fmt: str):
        try:
            v = struct.unpack_from(fmt, self._buf, self._pos)[0]
        except struct.error as e:
            raise ValueError(f"the header runs past the end of the file (truncated: {e})") from e
        self._pos += struct.calcsize(fmt)
        return v

    def _string(self) -> str:
        n = self._scalar("<Q")
        end = self._pos + n
        if end > len(self._buf):
            raise ValueError("a metadata string runs past the end of the file (truncated)")
        s = str(self._buf[self._pos:end], "utf-8", errors="replace")
        self._pos = end
        return s

    def _value(self, kind: int):
        if kind == _STRING:
            return self._string()
        if kind in _SCALARS:
            return self._scalar(_SCALARS[kind])
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF metadata value type {kind}")
        elem, count = self._scalar("<I"), self._scalar("<Q")
        if count > len(self._buf) - self._pos:  # every element takes at least one byte
            raise ValueError(f"a metadata array claims {count} elements; the file cannot hold them "
                             "(truncated or corrupted)")
        if elem == _STRING:  # a vocabulary or merges: the loop that must be tight
            buf, pos, size, out = self._buf, self._pos, len(self._buf), []
            unpack = _U64.unpack_from
            for _ in range(count):
                n = unpack(buf, pos)[0]
                pos += 8
                if pos + n > size:
                    raise ValueError("a metadata string runs past the end of the file (truncated)")
                out.append(str(buf[pos:pos + n], "utf-8", errors="replace"))
                pos += n
            self._pos = pos
            return out
        if elem in _NUMPY:
            dt = np.dtype(_NUMPY[elem])
            end = self._pos + count * dt.itemsize
            if end > len(self._buf):
                raise ValueError("a metadata array runs past the end of the file (truncated)")
            out = np.frombuffer(self._buf[self._pos:end], dtype=dt).tolist()
            self._pos = end
            return out
        return [self._value(elem) for _ in range(count)]  # arrays of arrays
