//! `GgufDecoder`: the decoder layers of a Llama-family model over GGUF weights as stored
//! (`specinfer_kernels::gguf_decoder`), one call per forward, GIL released. Built once per model
//! by `specinfer.models.gguf_decoder` from the weights' raw pointers (the file's memory map,
//! norms and biases as float32 tensors), which the model keeps alive as long as this object;
//! each call passes the step's float32 activations and the layer's paged KV cache by pointer.

use std::sync::Mutex;

use crate::cpu_attention::CpuPagedBatch;
use crate::cpu_linear::parse_isa;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use specinfer_kernels::dequant::GgmlType;
use specinfer_kernels::gguf_decoder::{self as kernel, Dims, Layer, Run, Scratch};
use specinfer_kernels::gguf_linear::{row_bytes, Part};

/// (ggml type id, data pointer, rows) of one stored tensor's rows.
type PartSpec = (u32, usize, usize);
/// input_norm, qkv parts, qkv_bias (0: none), o parts, o_bias (0: none), post_norm, gate_up
/// parts, down parts.
type LayerArgs = (
    usize,
    Vec<PartSpec>,
    usize,
    Vec<PartSpec>,
    usize,
    usize,
    Vec<PartSpec>,
    Vec<PartSpec>,
);

struct Weight {
    parts: Vec<(GgmlType, usize, usize, usize)>, // type, pointer, rows, row bytes
    k: usize,
}

impl Weight {
    fn new(what: &str, parts: &[PartSpec], k: usize, n: usize) -> PyResult<Self> {
        let mut out = Vec::with_capacity(parts.len());
        let mut rows = 0;
        for &(type_id, ptr, r) in parts {
            let ty = GgmlType::from_id(type_id).ok_or_else(|| {
                PyValueError::new_err(format!("{what}: ggml type {type_id} is not supported"))
            })?;
            let rb = row_bytes(ty, k).ok_or_else(|| {
                PyValueError::new_err(format!("{what}: k = {k} is not whole {ty:?} blocks"))
            })?;
            out.push((ty, ptr, r, rb));
            rows += r;
        }
        if rows != n {
            return Err(PyValueError::new_err(format!(
                "{what}: {rows} rows, the model needs {n}"
            )));
        }
        Ok(Weight { parts: out, k })
    }

    /// # Safety
    /// The pointers given at construction are live (the model holds the weights).
    unsafe fn parts(&self) -> Vec<Part<'static>> {
        debug_assert!(self.k > 0);
        self.parts
            .iter()
            .map(|&(ty, ptr, n, rb)| Part {
                ty,
                data: std::slice::from_raw_parts(ptr as *const u8, n * rb),
                n,
            })
            .collect()
    }
}

struct LayerSpec {
    input_norm: usize,
    qkv: Weight,
    qkv_bias: usize,
    o: Weight,
    o_bias: usize,
    post_norm: usize,
    gate_up: Weight,
    down: Weight,
}

#[pyclass(module = "specinfer._core", frozen)]
pub struct GgufDecoder {
    dims: Dims,
    layers: Vec<LayerSpec>,
    scratch: Mutex<Scratch>,
}

impl GgufDecoder {
    /// # Safety
    /// As `Weight::parts`: the model's weights are live.
    unsafe fn layer(&self, i: usize) -> Layer<'static> {
        let (l, d) = (&self.layers[i], &self.dims);
        let f = |ptr: usize, n: usize| std::slice::from_raw_parts(ptr as *const f32, n);
        let qkv_n = (d.num_heads + 2 * d.num_kv_heads) * d.head_dim;
        Layer {
            input_norm: f(l.input_norm, d.hidden),
            qkv: l.qkv.parts(),
            qkv_bias: (l.qkv_bias != 0).then(|| f(l.qkv_bias, qkv_n)),
            o: l.o.parts(),
            o_bias: (l.o_bias != 0).then(|| f(l.o_bias, d.hidden)),
            post_norm: f(l.post_norm, d.hidden),
            gate_up: l.gate_up.parts(),
            down: l.down.parts(),
        }
    }
}

#[pymethods]
impl GgufDecoder {
    #[new]
    #[pyo3(signature = (hidden, num_heads, num_kv_heads, head_dim, intermediate, eps, scale, layers))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        hidden: usize,
        num_heads: usize,
        num_kv_heads: usize,
        head_dim: usize,
        intermediate: usize,
        eps: f32,
        scale: f32,
        layers: Vec<LayerArgs>,
    ) -> PyResult<Self> {
        if num_kv_heads == 0 || num_heads % num_kv_heads != 0 || head_dim % 2 != 0 {
            return Err(PyValueError::new_err(
                "GgufDecoder: heads or head_dim do not fit",
            ));
        }
        let dims = Dims {
            hidden,
            num_heads,
            num_kv_heads,
            head_dim,
            intermediate,
            eps,
            scale,
        };
        let q = num_heads * head_dim;
        let mut specs = Vec::with_capacity(layers.len());
        for (i, (inorm, qkv, qkv_bias, o, o_bias, pnorm, gate_up, down)) in
            layers.into_iter().enumerate()
        {
            if inorm == 0 || pnorm == 0 {
                return Err(PyValueError::new_err(format!(
                    "layer {i}: a norm weight is missing"
                )));
            }
            specs.push(LayerSpec {
                input_norm: inorm,
                qkv: Weight::new("qkv", &qkv, hidden, q + 2 * num_kv_heads * head_dim)?,
                qkv_bias,
                o: Weight::new("o", &o, q, hidden)?,
                o_bias,
                post_norm: pnorm,
                gate_up: Weight::new("gate_up", &gate_up, hidden, 2 * intermediate)?,
                down: Weight::new("down", &down, intermediate, hidden)?,
            });
        }
        Ok(GgufDecoder {
            dims,
            layers: specs,
            scratch: Mutex::new(Scratch::default()),
        })
    }

    #[getter]
    fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// The whole forward over t tokens: every layer into x (f32[t, hidden], in place), layer i
    /// over its paged cache at `cache_ptrs[i]` (f32[2, num_blocks, block_size, kv_heads,
    /// head_dim]) and the batch's layout; cos / sin f32[t, head_dim] (the model's rope factors).
    #[pyo3(signature = (x_ptr, t, cos_ptr, sin_ptr, batch, cache_ptrs, num_blocks, block_size, num_threads, attn_isa=None))]
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        py: Python<'_>,
        x_ptr: usize,
        t: usize,
        cos_ptr: usize,
        sin_ptr: usize,
        batch: &Bound<'_, CpuPagedBatch>,
        cache_ptrs: Vec<usize>,
        num_blocks: usize,
        block_size: usize,
        num_threads: usize,
        attn_isa: Option<&str>,
    ) -> PyResult<()> {
        let n = self.layers.len();
        if cache_ptrs.len() != n || cache_ptrs.contains(&0) {
            return Err(PyValueError::new_err(format!(
                "GgufDecoder: {} cache pointers for {n} layers",
                cache_ptrs.len()
            )));
        }
        let layout = &batch.get().layout;
        if layout.num_tokens() != t {
            return Err(PyValueError::new_err(format!(
                "GgufDecoder: {t} tokens for a batch of {}",
                layout.num_tokens()
            )));
        }
        let run = Run {
            gemm_isa: parse_isa(None)?,
            attn_isa: parse_isa(attn_isa)?,
            num_threads,
            layout,
            num_blocks,
            block_size,
        };
        let d = self.dims;
        py.detach(|| {
            let mut scratch = self
                .scratch
                .lock()
                .map_err(|_| "GgufDecoder: scratch poisoned".to_string())?;
            let half = 2 * num_blocks * block_size * d.num_kv_heads * d.head_dim;
            // SAFETY: the Python caller passes live, non-aliasing buffers of these sizes (x, cos,
            // sin, one cache per layer); the weights outlive this object.
            unsafe {
                let x = std::slice::from_raw_parts_mut(x_ptr as *mut f32, t * d.hidden);
                let cos = std::slice::from_raw_parts(cos_ptr as *const f32, t * d.head_dim);
                let sin = std::slice::from_raw_parts(sin_ptr as *const f32, t * d.head_dim);
                let mut caches: Vec<&mut [f32]> = cache_ptrs
                    .iter()
                    .map(|&p| std::slice::from_raw_parts_mut(p as *mut f32, half))
                    .collect();
                kernel::forward(
                    &d,
                    n,
                    |i| self.layer(i),
                    &run,
                    x,
                    t,
                    cos,
                    sin,
                    &mut caches,
                    &mut scratch,
                )
            }
        })
        .map_err(PyValueError::new_err)
    }
}

/// out (f32[t, inter] at out_ptr) = silu(gate) * up of gate_up (f32[t, 2 * inter] at
/// gate_up_ptr, rows [gate | up]): the activation of a GGUF model's layers, fused or not.
#[pyfunction]
#[pyo3(signature = (gate_up_ptr, t, inter, out_ptr, num_threads))]
pub fn gguf_silu_mul(
    py: Python<'_>,
    gate_up_ptr: usize,
    t: usize,
    inter: usize,
    out_ptr: usize,
    num_threads: usize,
) -> PyResult<()> {
    let isa = parse_isa(None)?;
    py.detach(|| {
        // SAFETY: live buffers of these lengths from the Python caller; out aliases nothing.
        let (gu, out) = unsafe {
            (
                std::slice::from_raw_parts(gate_up_ptr as *const f32, t * 2 * inter),
                std::slice::from_raw_parts_mut(out_ptr as *mut f32, t * inter),
            )
        };
        specinfer_kernels::gated_act::silu_mul(isa, num_threads, gu, t, inter, out)
    })
    .map_err(PyValueError::new_err)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<GgufDecoder>()?;
    m.add_function(wrap_pyfunction!(gguf_silu_mul, m)?)
}
