"""specinfer.loader.gguf_file reads what the `gguf` package's GGUFReader reads (every metadata
value type, arrays of strings and numbers, tensor names, shapes, types and bytes), on a file
written here with every value type and on the SmolLM2 pack's file; damaged files are refused."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from specinfer.loader.gguf_file import GGUFFile


def reader_view(path):
    r = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    tensors = [(t.name, tuple(int(d) for d in t.shape), int(t.tensor_type),
                np.ascontiguousarray(t.data).reshape(-1).view(np.uint8).tobytes()) for t in r.tensors]
    return fields, tensors


def ours(path):
    f = GGUFFile(path)
    return f.fields, [(t.name, t.shape, t.tensor_type, t.data.tobytes()) for t in f.tensors]


def check_same(path):
    want_fields, want_tensors = reader_view(path)
    got_fields, got_tensors = ours(path)
    assert set(got_fields) == set(want_fields)
    for k, v in want_fields.items():
        assert got_fields[k] == pytest.approx(v) if isinstance(v, float) else got_fields[k] == v, k
    assert got_tensors == want_tensors


def test_every_value_type_and_tensor_type(tmp_path):
    path = str(tmp_path / "all.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -3000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -7)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2 ** 40)
    w.add_int64("t.i64", -(2 ** 40))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.strs", ["a", "", "Ġthe", "✓" * 3])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal(7).astype(np.float16))
    q = gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    check_same(path)
    f = GGUFFile(path)
    assert f.fields["t.strs"] == ["a", "", "Ġthe", "✓✓✓"] and f.fields["t.bool"] is True
    assert [t.shape for t in f.tensors] == [(5, 3), (7,), (64, 2)]  # innermost first, as stored


def test_the_smollm2_pack_reads_the_same():
    from specinfer.packs import resolve_pack

    check_same(resolve_pack("smollm2-135m"))


@pytest.mark.parametrize("cut", [3, 20, 400, -100])
def test_damaged_files_are_refused(tmp_path, cut):
    from specinfer.packs import resolve_pack

    with open(resolve_pack("smollm2-135m"), "rb") as f:
        src = f.read(4_000_000)
    path = tmp_path / "cut.gguf"
    path.write_bytes(src[:cut] if cut > 0 else src[:cut])  # header cut, or tensor data missing
    with pytest.raises(ValueError, match="truncated|magic|past the end"):
        GGUFFile(str(path))
    (tmp_path / "bad.gguf").write_bytes(b"GGUX" + src[4:1000])
    with pytest.raises(ValueError, match="magic"):
        GGUFFile(str(tmp_path / "bad.gguf"))


def test_absurd_counts_are_refused_before_any_loop_trusts_them(tmp_path):
    import struct

    for n_tensors, n_kv in ((2**62, 0), (0, 2**62), (2**40, 2**40)):
        path = tmp_path / "counts.gguf"
        path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + b"\0" * 64)
        with pytest.raises(ValueError, match="cannot hold"):
            GGUFFile(str(path))
    # an array whose element count the file cannot back
    key = b"k"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
                     + struct.pack("<IIQ", 9, 4, 2**61) + b"\0" * 16)
    with pytest.raises(ValueError, match="claims"):
        GGUFFile(str(path))
