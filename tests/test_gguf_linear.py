"""The GGUF-as-stored GEMM (models/gguf_linear.py over rust/kernels/src/gguf_linear/) against the
`gguf` package's own dequantization of the same bytes, for every block type it keeps:

- each output equals x · dequant(W)^T within the activation quantization's error (activations
  are rounded per block of 32 / 256, as llama.cpp does), on odd shapes, every row count 1..64 and
  a prefill-sized one;
- a row's outputs are the same bits whatever rows share its call (batch invariance), for one
  and two threads;
- weights of several parts (q | k | v of different types) fill their columns; embeddings
  (dequantized rows) equal the package's dequantization exactly; bad input is refused by name.
"""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from specinfer.models.gguf_linear import Q4_0R, Q4_1R, Q4_KR, Q5_0R, GgufWeight, StoredTensor, gguf_linear, row_bytes

QUANTIZABLE = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]  # the package quantizes these
K_TYPES = [T.Q4_K, T.Q5_K, T.Q6_K]  # the package only dequantizes these: random valid blocks
FLOATS = [T.F32, T.F16, T.BF16]


def _random_k_blocks(t, rows: int, cols: int, rng) -> np.ndarray:
    """Random bytes with every f16 scale field set to a small positive value."""
    nb = cols // 256
    per = {T.Q4_K: 144, T.Q5_K: 176, T.Q6_K: 210}[t]
    data = rng.integers(0, 256, size=(rows, nb, per), dtype=np.uint8)
    scale = lambda: np.array([rng.uniform(0.0005, 0.003)], np.float16).view(np.uint8)  # noqa: E731
    for r in range(rows):
        for b in range(nb):
            if t == T.Q6_K:
                data[r, b, 208:210] = scale()
            else:
                data[r, b, 0:2], data[r, b, 2:4] = scale(), scale()
    return data.reshape(rows, nb * per)


def _stored(t, rows: int, cols: int, seed: int = 0) -> tuple[StoredTensor, np.ndarray]:
    """(the stored tensor, the gguf package's float32 values of it)."""
    rng = np.random.default_rng(seed)
    if t in K_TYPES:
        data = _random_k_blocks(t, rows, cols, rng)
    elif t in QUANTIZABLE:
        data = gguf_quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.1, t)
    elif t == T.F32:
        data = rng.standard_normal((rows, cols)).astype(np.float32).view(np.uint8)
    elif t == T.F16:
        data = rng.standard_normal((rows, cols)).astype(np.float16).view(np.uint8)
    else:  # BF16: the top halves of float32 values
        f = rng.standard_normal((rows, cols)).astype(np.float32)
        data = (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    data = np.ascontiguousarray(data).reshape(rows, row_bytes(int(t), cols))
    ref = gguf_dequantize(data, t).astype(np.float32).reshape(rows, cols)
    return StoredTensor(int(t), data, cols), ref


def _weight(*parts: StoredTensor) -> GgufWeight:
    n = sum(p.shape[0] for p in parts)
    w = GgufWeight(n, parts[0].cols)
    at = 0
    for p in parts:
        w.load(slice(at, at + p.shape[0]), p)
        at += p.shape[0]
    return w


@pytest.mark.parametrize("t", QUANTIZABLE + K_TYPES + FLOATS, ids=lambda t: t.name)
def test_every_block_type_equals_the_gguf_dequantized_product(t):
    rows, cols = 45, 768  # odd row count; three super-blocks of 256
    st, ref = _stored(t, rows, cols, seed=int(t))
    w = _weight(st)
    torch.manual_seed(int(t))
    M = 80  # 1..64 below, and a prefill-sized call
    x = torch.randn(M, cols)
    bias = torch.randn(rows)
    got = gguf_linear(x, w, bias)
    want = x.double() @ torch.from_numpy(ref).double().T + bias.double()
    mag = x.double().abs() @ torch.from_numpy(ref).double().abs().T
    # float weights: float32 rounding only; quantized: activations rounded to 8 bits per block
    tol = 1e-5 if t in FLOATS else 0.02
    err = (got.double() - want).abs()
    assert (err <= tol * mag + 1e-5).all(), f"{t.name}: worst {float((err / (mag + 1e-9)).max()):.3g} of the magnitude"
    if t not in FLOATS:  # and typically much closer than the bound: a sanity check on the bound itself
        assert float((err / mag).median()) < 2e-3
    for m in list(range(1, 65)) + [M]:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            try:
                part = gguf_linear(x[:m], w, bias)
            finally:
                torch.set_num_threads(1)
            assert torch.equal(part, got[:m]), f"{t.name}: {m} rows on {threads} threads differ from the {M}-row call"


def test_parts_of_different_types_fill_their_columns():
    cols = 512
    parts = [_stored(t, n, cols, seed=i) for i, (t, n) in enumerate([(T.Q4_K, 24), (T.Q6_K, 8), (T.Q8_0, 8)])]
    w = _weight(*(p for p, _ in parts))
    x = torch.randn(5, cols)
    got = gguf_linear(x, w)
    at = 0
    for p, _ in parts:
        alone = gguf_linear(x, _weight(p))
        assert torch.equal(got[:, at:at + p.shape[0]], alone)
        at += p.shape[0]
    assert w.type_names == ["Q4_K", "Q6_K", "Q8_0"]
    assert w.nbytes == sum(p.data.nbytes for p, _ in parts)


@pytest.mark.parametrize("t", [T.Q4_1, T.Q4_K, T.Q6_K, T.Q8_0, T.F16], ids=lambda t: t.name)
def test_embedding_rows_are_the_gguf_dequantization(t):
    st, ref = _stored(t, 300, 256, seed=3)
    w = _weight(st)
    ids = torch.tensor([0, 299, 17, 17, 5])
    assert torch.equal(w.embedding(ids), torch.from_numpy(ref)[ids])
    two = _weight(st.rows(0, 100), st.rows(100, 300))  # a table of two parts
    assert torch.equal(two.embedding(ids), torch.from_numpy(ref)[ids])
    assert torch.equal(w.dequantize(slice(10, 20)), torch.from_numpy(ref)[10:20])


@pytest.mark.parametrize("t,repacked,cols", [(T.Q4_1, Q4_1R, 576), (T.Q4_0, Q4_0R, 576), (T.Q5_0, Q5_0R, 576),
                                             (T.Q4_K, Q4_KR, 512)], ids=["Q4_1", "Q4_0", "Q5_0", "Q4_K"])
def test_q4_rows_are_held_in_the_kernels_layout(tmp_path, t, repacked, cols):
    """Q4_0 / Q4_1 / Q5_0 rows of >= 256 values are repacked once at load into the kernel's octets, Q4_K
    rows into groups of eight rows (45 rows: five groups and five rows as stored): the same
    bytes rearranged (named as before, as large), products and embeddings equal to the package's
    dequantization above; a file map's pages of the source are released, its bytes intact.
    Shorter Q4_0 / Q4_1 / Q5_0 rows stay views of the file."""
    import mmap

    st, ref = _stored(t, 45, cols, seed=5)
    path = tmp_path / "q4_1.bin"
    path.write_bytes(st.data.tobytes())
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = np.frombuffer(memoryview(mapped), dtype=np.uint8).reshape(st.data.shape)
    w = _weight(StoredTensor(int(t), view, cols))
    ((_, p),) = w.parts
    assert p.type_id == repacked and p.type_name == t.name and w.type_names == [t.name]
    assert p.data.nbytes == view.nbytes and not np.shares_memory(p.data, view)
    assert not np.array_equal(p.data, view)  # rearranged
    assert np.array_equal(view, st.data)  # the map's pages released, the file's bytes as they were
    assert torch.equal(w.dequantize(), torch.from_numpy(ref))
    ids = torch.tensor([44, 0, 7, 8, 39, 40])  # a group's ends, the rows after the groups
    assert torch.equal(w.embedding(ids), torch.from_numpy(ref)[ids])
    x = torch.randn(3, cols)
    ref64 = torch.from_numpy(ref).double()
    err = (gguf_linear(x, w).double() - x.double() @ ref64.T).abs()
    assert (err <= 0.02 * (x.double().abs() @ ref64.abs().T) + 1e-5).all()
    if t == T.Q4_K:
        # a row range of the groups: whole groups (or up to the end), else refused by name
        half = w.row_slice(16, 45)
        assert torch.equal(half.dequantize(), torch.from_numpy(ref)[16:45])
        assert torch.equal(gguf_linear(x, half), gguf_linear(x, w)[:, 16:45])
        with pytest.raises(ValueError, match="groups of 8 rows"):
            w.row_slice(4, 16)
        return
    short, _ = _stored(t, 8, 224)
    ((_, q),) = _weight(short).parts
    assert q.type_id == int(t) and np.shares_memory(q.data, short.data)


def test_stored_rows_are_views_of_the_bytes_not_copies():
    st, _ = _stored(T.Q5_1, 64, 256)  # (Q4_0 / Q4_1 / Q5_0 are repacked: the test above)
    w = _weight(st.rows(0, 32), st.rows(32, 64))
    assert all(np.shares_memory(p.data, st.data) for _, p in w.parts)


def test_bad_input_is_refused_by_name():
    st, _ = _stored(T.Q4_K, 4, 256)
    w = GgufWeight(8, 256)
    with pytest.raises(ValueError, match="as stored"):
        w.load(None, torch.zeros(8, 256))
    with pytest.raises(ValueError, match="does not fill rows"):
        w.load(slice(0, 8), st)
    w.load(slice(0, 4), st)
    with pytest.raises(RuntimeError, match="never loaded"):
        gguf_linear(torch.zeros(1, 256), w)
    with pytest.raises(ValueError, match="whole number"):
        StoredTensor.from_bytes(np.zeros(144, np.uint8), int(T.Q4_K), (1, 128))
    with pytest.raises(ValueError, match="cannot be kept as stored"):
        StoredTensor(int(T.Q2_K), np.zeros((1, 84), np.uint8), 256)
