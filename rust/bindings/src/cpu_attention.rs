//! `CpuPagedBatch`: the CPU paged-attention kernel (`specinfer_kernels`) over torch tensors'
//! memory. Built once per forward from the batch's metadata (validated here, once); its
//! `forward` runs per layer on raw `data_ptr()`s and strides, with the GIL released.
//!
//! The one caller is `specinfer.attention.cpu_native`, which asserts the memory contract
//! (device, dtype, contiguity, sizes) before passing pointers; this layer re-checks every size
//! it can (shapes against the batch, block ids and slots against the cache) and derives each
//! buffer's length from shape and strides, so a wrong size is a ValueError, not a wild write.

use numpy::{AllowTypeChange, PyArrayLike1, PyArrayLike2};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use specinfer_kernels::{
    self as kernels, AttentionError, AttentionOptions, BatchLayout, Bf16, Elem, HeadGeometry, Isa,
    StridedHeads,
};

fn to_py(e: AttentionError) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// (data_ptr, token stride, head stride) of a `[T, heads, head_dim]` tensor, in elements.
type Strided = (usize, usize, usize);

/// # Safety
/// `ptr` must address a live buffer covering the view's extent (the Python caller's contract).
unsafe fn view<'a, E>(
    s: Strided,
    num_tokens: usize,
    heads: usize,
    head_dim: usize,
) -> StridedHeads<'a, E> {
    let (ptr, token_stride, head_stride) = s;
    let len = StridedHeads::<E>::extent(num_tokens, heads, head_dim, token_stride, head_stride);
    let data = if len == 0 {
        &[][..]
    } else {
        std::slice::from_raw_parts(ptr as *const E, len)
    };
    StridedHeads {
        data,
        num_tokens,
        num_heads: heads,
        head_dim,
        token_stride,
        head_stride,
    }
}

#[pyclass(module = "specinfer._core", frozen)]
pub struct CpuPagedBatch {
    pub(crate) layout: BatchLayout,
}

#[pymethods]
impl CpuPagedBatch {
    /// skip: per sequence, whether `forward` leaves its output rows to the caller (its K/V is
    /// still stored). tree_mask int64[T] / tree_start int32[S]: token-tree masks (both or
    /// neither; see `specinfer.attention.metadata`). batch_invariant: each query row computed
    /// alike in any run (AVX-512; `BatchLayout::set_batch_invariant`).
    #[new]
    #[pyo3(signature = (slot_mapping, query_start_loc, seq_lens, block_table, block_size, skip=None, tree_mask=None, tree_start=None, batch_invariant=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        slot_mapping: PyArrayLike1<'_, i64, AllowTypeChange>,
        query_start_loc: PyArrayLike1<'_, i32, AllowTypeChange>,
        seq_lens: PyArrayLike1<'_, i32, AllowTypeChange>,
        block_table: PyArrayLike2<'_, i32, AllowTypeChange>,
        block_size: usize,
        skip: Option<Vec<bool>>,
        tree_mask: Option<PyArrayLike1<'_, i64, AllowTypeChange>>,
        tree_start: Option<PyArrayLike1<'_, i32, AllowTypeChange>>,
        batch_invariant: bool,
    ) -> PyResult<Self> {
        let table = block_table.as_array();
        let width = table.ncols();
        let mut layout = BatchLayout::new(
            slot_mapping.as_array().to_vec(),
            query_start_loc.as_array().to_vec(),
            seq_lens.as_array().to_vec(),
            table.iter().copied().collect(),
            width,
            block_size,
        )
        .map_err(to_py)?;
        if let Some(skip) = skip {
            layout.skip_attention(skip).map_err(to_py)?;
        }
        layout.set_batch_invariant(batch_invariant);
        match (tree_mask, tree_start) {
            (None, None) => {}
            (Some(mask), Some(start)) => layout
                .set_tree_masks(mask.as_array().to_vec(), start.as_array().to_vec())
                .map_err(to_py)?,
            _ => {
                return Err(PyValueError::new_err(
                    "tree_mask, tree_start: give both or neither",
                ))
            }
        }
        Ok(CpuPagedBatch { layout })
    }

    #[getter]
    fn batch_invariant(&self) -> bool {
        self.layout.batch_invariant()
    }

    #[getter]
    fn num_tokens(&self) -> usize {
        self.layout.num_tokens()
    }

    /// Store k/v (`[T, Hkv, D]`) at the batch's slots of the cache (`[2, NB, BS, Hkv, D]`,
    /// contiguous), then attend q (`[T, H, D]`) into out (`[T, H, D]`, contiguous). dtype:
    /// "float32" or "bfloat16", the same for every tensor. isa None: the best this CPU has.
    /// window: sliding window W >= 1 (a query at position p sees keys p - W < j <= p; tree
    /// tokens by their logical position); softcap: scores s become c * tanh(s / c); None: off.
    #[pyo3(signature = (dtype, out_ptr, q, k, v, cache_ptr, num_heads, num_kv_heads, head_dim, num_blocks, block_size, scale, num_threads, isa=None, window=None, softcap=None))]
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        py: Python<'_>,
        dtype: &str,
        out_ptr: usize,
        q: Strided,
        k: Strided,
        v: Strided,
        cache_ptr: usize,
        num_heads: usize,
        num_kv_heads: usize,
        head_dim: usize,
        num_blocks: usize,
        block_size: usize,
        scale: f32,
        num_threads: usize,
        isa: Option<&str>,
        window: Option<usize>,
        softcap: Option<f32>,
    ) -> PyResult<()> {
        let isa = match isa {
            None => Isa::detect(),
            Some(name) => Isa::from_name(name).ok_or_else(|| {
                PyValueError::new_err(format!("isa: unknown {name:?} (scalar, avx2, avx512)"))
            })?,
        };
        let geo = HeadGeometry {
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            num_blocks,
        };
        let call = Call {
            layout: &self.layout,
            geo,
            out_ptr,
            q,
            k,
            v,
            cache_ptr,
            scale,
            opts: AttentionOptions { window, softcap },
            num_threads,
            isa,
        };
        match dtype {
            "float32" => py.detach(|| unsafe { call.run::<f32>() }),
            "bfloat16" => py.detach(|| unsafe { call.run::<Bf16>() }),
            other => Err(AttentionError {
                field: "dtype",
                message: format!("{other:?} is not float32 or bfloat16"),
            }),
        }
        .map_err(to_py)
    }
}

struct Call<'a> {
    layout: &'a BatchLayout,
    geo: HeadGeometry,
    out_ptr: usize,
    q: Strided,
    k: Strided,
    v: Strided,
    cache_ptr: usize,
    scale: f32,
    opts: AttentionOptions,
    num_threads: usize,
    isa: Isa,
}

impl Call<'_> {
    /// # Safety
    /// The pointers address live buffers of element type E covering the extents their shapes
    /// and strides give; out and the cache alias nothing else.
    unsafe fn run<E: Elem>(&self) -> Result<(), AttentionError> {
        let (t, g) = (self.layout.num_tokens(), self.geo);
        let half = g.cache_half_len();
        let cache = if half == 0 {
            &mut [][..]
        } else {
            std::slice::from_raw_parts_mut(self.cache_ptr as *mut E, 2 * half)
        };
        let k = view::<E>(self.k, t, g.num_kv_heads, g.head_dim);
        let v = view::<E>(self.v, t, g.num_kv_heads, g.head_dim);
        kernels::store_kv(self.layout, &g, k, v, cache)?;
        let q = view::<E>(self.q, t, g.num_heads, g.head_dim);
        let out_len = t * g.num_heads * g.head_dim;
        let out = if out_len == 0 {
            &mut [][..]
        } else {
            std::slice::from_raw_parts_mut(self.out_ptr as *mut E, out_len)
        };
        kernels::paged_attention_with(
            self.isa,
            self.num_threads,
            self.layout,
            &g,
            q,
            cache,
            out,
            self.scale,
            self.opts,
        )
    }
}

/// (the instruction set used by default, every one this CPU supports).
#[pyfunction]
pub fn cpu_kernel_isa() -> (&'static str, Vec<&'static str>) {
    (
        Isa::detect().name(),
        Isa::supported().into_iter().map(Isa::name).collect(),
    )
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<CpuPagedBatch>()?;
    m.add_function(wrap_pyfunction!(cpu_kernel_isa, m)?)?;
    Ok(())
}
