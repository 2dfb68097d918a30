//! `rms_norm`: the one-pass RMSNorm kernel (`specinfer_kernels::rms_norm`) over torch tensors'
//! memory, GIL released. The caller, `specinfer.models.rms_norm`, asserts the memory contract
//! (CPU, contiguous, float32 or bfloat16 for x, weight and out alike, shapes) before passing
//! `data_ptr()`s; this layer derives every buffer's length from the shapes it is given.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use specinfer_kernels::{self as kernels, Bf16, Elem};

fn run<E: Elem>(
    x: usize,
    w: usize,
    out: usize,
    rows: usize,
    dim: usize,
    eps: f32,
    threads: usize,
) -> Result<(), String> {
    // SAFETY: the Python caller passes live, contiguous buffers of these shapes and this element
    // type; out aliases neither input.
    let (x, w, out) = unsafe {
        (
            std::slice::from_raw_parts(x as *const E, rows * dim),
            std::slice::from_raw_parts(w as *const E, dim),
            std::slice::from_raw_parts_mut(out as *mut E, rows * dim),
        )
    };
    kernels::rms_norm(threads, x, w, dim, eps, out)
}

/// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight for `rows` rows of `dim`; dtype "float32"
/// or "bfloat16".
#[pyfunction]
#[pyo3(signature = (x_ptr, rows, dim, weight_ptr, eps, out_ptr, dtype, num_threads))]
#[allow(clippy::too_many_arguments)]
pub fn rms_norm(
    py: Python<'_>,
    x_ptr: usize,
    rows: usize,
    dim: usize,
    weight_ptr: usize,
    eps: f32,
    out_ptr: usize,
    dtype: &str,
    num_threads: usize,
) -> PyResult<()> {
    if rows == 0 {
        return Ok(());
    }
    let result = match dtype {
        "float32" => {
            py.detach(|| run::<f32>(x_ptr, weight_ptr, out_ptr, rows, dim, eps, num_threads))
        }
        "bfloat16" => {
            py.detach(|| run::<Bf16>(x_ptr, weight_ptr, out_ptr, rows, dim, eps, num_threads))
        }
        other => {
            return Err(PyValueError::new_err(format!(
                "dtype: {other:?} is not float32 or bfloat16"
            )))
        }
    };
    result.map_err(PyValueError::new_err)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(rms_norm, m)?)
}
