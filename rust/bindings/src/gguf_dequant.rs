//! `dequantize_gguf`: GGUF tensor data to f32 (`specinfer_kernels::dequant`) over raw memory, GIL
//! released. The caller, `specinfer.loader.gguf_dequant`, passes the tensor's bytes (a numpy view
//! of the file's memory map) and a contiguous float32 output of rows * cols values.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use specinfer_kernels::dequant::{self, GgmlType};

/// True where the kernel reads ggml type `type_id`.
#[pyfunction]
pub fn gguf_type_supported(type_id: u32) -> bool {
    GgmlType::from_id(type_id).is_some()
}

/// out[rows, cols] (f32) = the `src_len` bytes at `src_ptr`, of ggml type `type_id`.
#[pyfunction]
#[pyo3(signature = (src_ptr, src_len, type_id, rows, cols, out_ptr, num_threads))]
#[allow(clippy::too_many_arguments)]
pub fn dequantize_gguf(
    py: Python<'_>,
    src_ptr: usize,
    src_len: usize,
    type_id: u32,
    rows: usize,
    cols: usize,
    out_ptr: usize,
    num_threads: usize,
) -> PyResult<()> {
    let t = GgmlType::from_id(type_id).ok_or_else(|| {
        PyValueError::new_err(format!("ggml type {type_id} is not supported here"))
    })?;
    if rows * cols == 0 {
        return Ok(());
    }
    // SAFETY: the Python caller passes a live buffer of src_len bytes and a live, contiguous,
    // writable float32 buffer of rows * cols values that does not overlap it.
    let (src, out) = unsafe {
        (
            std::slice::from_raw_parts(src_ptr as *const u8, src_len),
            std::slice::from_raw_parts_mut(out_ptr as *mut f32, rows * cols),
        )
    };
    py.detach(|| dequant::dequantize(t, src, rows, cols, out, num_threads))
        .map_err(PyValueError::new_err)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(gguf_type_supported, m)?)?;
    m.add_function(wrap_pyfunction!(dequantize_gguf, m)?)
}
