//! `moe_experts`: the mixture-of-experts kernel (`specinfer_kernels::moe`) over torch tensors'
//! memory, GIL released. The caller, `specinfer.models.moe`, passes contiguous CPU buffers: x
//! and out f32 `[t, hidden]`, the stacked expert weights (f32 or bf16) `[e, 2 * inter, hidden]`
//! and `[e, hidden, inter]`, the sorted pairs' tokens (int32) and weights (f32) and the experts'
//! offsets (int64 `[e + 1]`); this layer derives every buffer's length from the shapes.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use specinfer_kernels::moe::{moe_experts as kernel, Activation, ExpertWeights, Routing};
use specinfer_kernels::simd::Isa;
use specinfer_kernels::{Bf16, DenseElem};

/// The routed pairs' buffers: (token_ptr, weight_ptr, offsets_ptr, num_pairs).
type Pairs = (usize, usize, usize, usize);

#[allow(clippy::too_many_arguments)]
fn run<W: DenseElem>(
    x: usize,
    t: usize,
    gate_up: usize,
    down: usize,
    e: usize,
    h: usize,
    i: usize,
    act: Activation,
    (token, weight, offsets, pairs): Pairs,
    out: usize,
    threads: usize,
) -> Result<(), String> {
    // SAFETY: the Python caller passes live, contiguous buffers of these shapes and types; out
    // aliases none of the inputs.
    let (x, w, routing_offsets, token, weight, out) = unsafe {
        (
            std::slice::from_raw_parts(x as *const f32, t * h),
            ExpertWeights {
                gate_up: std::slice::from_raw_parts(gate_up as *const W, e * 2 * i * h),
                down: std::slice::from_raw_parts(down as *const W, e * h * i),
                num_experts: e,
                hidden: h,
                inter: i,
            },
            std::slice::from_raw_parts(offsets as *const i64, e + 1),
            std::slice::from_raw_parts(token as *const u32, pairs),
            std::slice::from_raw_parts(weight as *const f32, pairs),
            std::slice::from_raw_parts_mut(out as *mut f32, t * h),
        )
    };
    if routing_offsets.iter().any(|&o| o < 0) {
        return Err("offsets: negative".into());
    }
    let offsets: Vec<usize> = routing_offsets.iter().map(|&o| o as usize).collect();
    let routing = Routing {
        token,
        weight,
        offsets: &offsets,
    };
    kernel(Isa::detect(), threads, x, t, &w, act, &routing, out).map_err(|e| e.to_string())
}

/// out [t, hidden] = the routed experts' gated MLP of x [t, hidden], summed per token.
#[pyfunction]
#[pyo3(signature = (x_ptr, t, gate_up_ptr, down_ptr, w_dtype, num_experts, hidden, inter, activation,
                    token_ptr, weight_ptr, offsets_ptr, num_pairs, out_ptr, num_threads))]
#[allow(clippy::too_many_arguments)]
fn moe_experts(
    py: Python<'_>,
    x_ptr: usize,
    t: usize,
    gate_up_ptr: usize,
    down_ptr: usize,
    w_dtype: &str,
    num_experts: usize,
    hidden: usize,
    inter: usize,
    activation: &str,
    token_ptr: usize,
    weight_ptr: usize,
    offsets_ptr: usize,
    num_pairs: usize,
    out_ptr: usize,
    num_threads: usize,
) -> PyResult<()> {
    let act = match activation {
        "silu" => Activation::Silu,
        "gelu_tanh" => Activation::GeluTanh,
        other => {
            return Err(PyValueError::new_err(format!(
                "activation: {other:?} is not silu or gelu_tanh"
            )))
        }
    };
    let routing = (token_ptr, weight_ptr, offsets_ptr, num_pairs);
    type Run = fn(
        usize,
        usize,
        usize,
        usize,
        usize,
        usize,
        usize,
        Activation,
        Pairs,
        usize,
        usize,
    ) -> Result<(), String>;
    let run: Run = match w_dtype {
        "float32" => run::<f32>,
        "bfloat16" => run::<Bf16>,
        other => {
            return Err(PyValueError::new_err(format!(
                "w_dtype: {other:?} is not bfloat16 or float32"
            )))
        }
    };
    let result = py.detach(|| {
        run(
            x_ptr,
            t,
            gate_up_ptr,
            down_ptr,
            num_experts,
            hidden,
            inter,
            act,
            routing,
            out_ptr,
            num_threads,
        )
    });
    result.map_err(PyValueError::new_err)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(moe_experts, m)?)
}
