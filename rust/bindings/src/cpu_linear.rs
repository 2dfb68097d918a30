//! `int8_linear` and `dense_linear`: the few-rows linear kernels (`specinfer_kernels::int8_linear`,
//! `dense_linear`) over torch tensors' memory, GIL released. The callers,
//! `specinfer.models.int8_linear` and `specinfer.models.few_rows_linear`, assert
//! the memory contract (CPU, dtypes, contiguity, shapes) before passing `data_ptr()`s; this layer
//! derives every buffer's length from the shapes it is given and the kernel re-checks them.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use specinfer_kernels::{self as kernels, Bf16, Int8Weight, Isa};

/// out[m, n] = x[m, k] · (q[n, k] * scales[n, k / group])^T (+ bias[n]); bias_ptr 0: none.
#[pyfunction]
#[pyo3(signature = (x_ptr, m, k, q_ptr, scales_ptr, n, group, out_ptr, bias_ptr, num_threads, isa=None))]
#[allow(clippy::too_many_arguments)]
pub fn int8_linear(
    py: Python<'_>,
    x_ptr: usize,
    m: usize,
    k: usize,
    q_ptr: usize,
    scales_ptr: usize,
    n: usize,
    group: usize,
    out_ptr: usize,
    bias_ptr: usize,
    num_threads: usize,
    isa: Option<&str>,
) -> PyResult<()> {
    let isa = parse_isa(isa)?;
    if group == 0 || k % group != 0 {
        return Err(PyValueError::new_err(format!(
            "group: {group} does not divide k = {k}"
        )));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    py.detach(|| {
        // SAFETY: the Python caller passes live, contiguous buffers of these shapes and dtypes
        // (f32 x/scales/bias/out, i8 q); out aliases none of the inputs.
        let (x, q, scales, bias, out) = unsafe {
            (
                std::slice::from_raw_parts(x_ptr as *const f32, m * k),
                std::slice::from_raw_parts(q_ptr as *const i8, n * k),
                std::slice::from_raw_parts(scales_ptr as *const f32, n * (k / group)),
                (bias_ptr != 0).then(|| std::slice::from_raw_parts(bias_ptr as *const f32, n)),
                std::slice::from_raw_parts_mut(out_ptr as *mut f32, m * n),
            )
        };
        kernels::int8_linear(
            isa,
            num_threads,
            x,
            m,
            Int8Weight {
                q,
                scales,
                n,
                k,
                group,
            },
            bias,
            out,
        )
    })
    .map_err(|e| PyValueError::new_err(e.to_string()))
}

fn parse_isa(isa: Option<&str>) -> PyResult<Isa> {
    match isa {
        None => Ok(Isa::detect()),
        Some(name) => Isa::from_name(name).ok_or_else(|| {
            PyValueError::new_err(format!("isa: unknown {name:?} (scalar, avx2, avx512)"))
        }),
    }
}

/// out[m, n] (f32) = x[m, k] (f32) · w[n, k]^T (+ bias[n], f32); w "bfloat16" or "float32";
/// bias_ptr 0: none.
#[pyfunction]
#[pyo3(signature = (x_ptr, m, k, w_ptr, w_dtype, n, out_ptr, bias_ptr, num_threads, isa=None))]
#[allow(clippy::too_many_arguments)]
pub fn dense_linear(
    py: Python<'_>,
    x_ptr: usize,
    m: usize,
    k: usize,
    w_ptr: usize,
    w_dtype: &str,
    n: usize,
    out_ptr: usize,
    bias_ptr: usize,
    num_threads: usize,
    isa: Option<&str>,
) -> PyResult<()> {
    let isa = parse_isa(isa)?;
    let bf16 = match w_dtype {
        "bfloat16" => true,
        "float32" => false,
        other => {
            return Err(PyValueError::new_err(format!(
                "w_dtype: {other:?} is not bfloat16 or float32"
            )))
        }
    };
    if m == 0 || n == 0 {
        return Ok(());
    }
    py.detach(|| {
        // SAFETY: the Python caller passes live, contiguous buffers of these shapes and dtypes
        // (f32 x/bias/out, w of w_dtype); out aliases none of the inputs.
        let (x, bias, out) = unsafe {
            (
                std::slice::from_raw_parts(x_ptr as *const f32, m * k),
                (bias_ptr != 0).then(|| std::slice::from_raw_parts(bias_ptr as *const f32, n)),
                std::slice::from_raw_parts_mut(out_ptr as *mut f32, m * n),
            )
        };
        if bf16 {
            // SAFETY: as above, w holds n * k bf16 values
            let w = unsafe { std::slice::from_raw_parts(w_ptr as *const Bf16, n * k) };
            kernels::dense_linear(isa, num_threads, x, m, w, n, k, bias, out)
        } else {
            // SAFETY: as above, w holds n * k f32 values
            let w = unsafe { std::slice::from_raw_parts(w_ptr as *const f32, n * k) };
            kernels::dense_linear(isa, num_threads, x, m, w, n, k, bias, out)
        }
    })
    .map_err(|e| PyValueError::new_err(e.to_string()))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(int8_linear, m)?)?;
    m.add_function(wrap_pyfunction!(dense_linear, m)?)
}
