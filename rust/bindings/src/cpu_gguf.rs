//! `gguf_linear` and `gguf_rows`: GGUF weights as stored (`specinfer_kernels::gguf_linear`,
//! `dequant::gather_rows`) over raw memory, GIL released. The caller,
//! `specinfer.models.gguf_linear`, passes the weight parts' bytes (numpy views of the file's
//! memory map, or copies of permuted rows) and contiguous float32 activations / outputs; this
//! layer derives every length from the shapes it is given and the kernel re-checks them.

use crate::cpu_linear::parse_isa;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use specinfer_kernels::dequant::{self, GgmlType};
use specinfer_kernels::gguf_linear::{self as kernel, Part};

fn ggml_type(type_id: u32) -> PyResult<GgmlType> {
    GgmlType::from_id(type_id)
        .ok_or_else(|| PyValueError::new_err(format!("ggml type {type_id} is not supported here")))
}

/// out[m, n] = x[m, k] · W^T (+ bias[n]), W the rows of `parts` in order, each part
/// `(type_id, data_ptr, n_rows)` holding n_rows rows of k values in its stored blocks;
/// bias_ptr 0: none.
#[pyfunction]
#[pyo3(signature = (x_ptr, m, k, parts, out_ptr, bias_ptr, num_threads, isa=None))]
#[allow(clippy::too_many_arguments)]
pub fn gguf_linear(
    py: Python<'_>,
    x_ptr: usize,
    m: usize,
    k: usize,
    parts: Vec<(u32, usize, usize)>,
    out_ptr: usize,
    bias_ptr: usize,
    num_threads: usize,
    isa: Option<&str>,
) -> PyResult<()> {
    let isa = parse_isa(isa)?;
    let mut typed = Vec::with_capacity(parts.len());
    let mut n = 0;
    for &(type_id, ptr, rows) in &parts {
        let ty = ggml_type(type_id)?;
        let rb = kernel::row_bytes(ty, k).ok_or_else(|| {
            PyValueError::new_err(format!("{ty:?}: k = {k} is not a whole number of blocks"))
        })?;
        typed.push((ty, ptr, rows, rb));
        n += rows;
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    py.detach(|| {
        // SAFETY: the Python caller passes live buffers: each part's rows * row_bytes bytes,
        // x f32[m * k], bias f32[n] (or 0), out f32[m * n] aliasing none of them.
        let (x, bias, out, parts) = unsafe {
            (
                std::slice::from_raw_parts(x_ptr as *const f32, m * k),
                (bias_ptr != 0).then(|| std::slice::from_raw_parts(bias_ptr as *const f32, n)),
                std::slice::from_raw_parts_mut(out_ptr as *mut f32, m * n),
                typed
                    .iter()
                    .map(|&(ty, ptr, rows, rb)| Part {
                        ty,
                        data: std::slice::from_raw_parts(ptr as *const u8, rows * rb),
                        n: rows,
                    })
                    .collect::<Vec<_>>(),
            )
        };
        kernel::gguf_linear(isa, num_threads, x, m, k, &parts, bias, out)
    })
    .map_err(|e| PyValueError::new_err(e.to_string()))
}

/// out[len(ids), cols] (f32) = rows `ids` (i64[num_ids] at ids_ptr) of the table at src_ptr
/// (src_len bytes of rows of `cols` values of ggml type `type_id`).
#[pyfunction]
#[pyo3(signature = (src_ptr, src_len, type_id, cols, ids_ptr, num_ids, out_ptr))]
#[allow(clippy::too_many_arguments)]
pub fn gguf_rows(
    py: Python<'_>,
    src_ptr: usize,
    src_len: usize,
    type_id: u32,
    cols: usize,
    ids_ptr: usize,
    num_ids: usize,
    out_ptr: usize,
) -> PyResult<()> {
    let t = ggml_type(type_id)?;
    if num_ids == 0 {
        return Ok(());
    }
    py.detach(|| {
        // SAFETY: live buffers of these lengths from the Python caller; out aliases neither input.
        let (src, ids, out) = unsafe {
            (
                std::slice::from_raw_parts(src_ptr as *const u8, src_len),
                std::slice::from_raw_parts(ids_ptr as *const i64, num_ids),
                std::slice::from_raw_parts_mut(out_ptr as *mut f32, num_ids * cols),
            )
        };
        dequant::gather_rows(t, src, cols, ids, out)
    })
    .map_err(PyValueError::new_err)
}

/// The kernels' own layout of `rows` rows of `cols` values of ggml type `type_id` (`src`,
/// `src_len` bytes) written to `dst` (as many bytes): -> the layout's type id. Q4_0, Q4_1 and
/// Q5_0 rows of at least 256 values become octets (`gguf_linear::octets`), Q4_K rows groups of
/// eight rows (`gguf_linear::row_groups`); other types have none (error).
#[pyfunction]
pub fn gguf_repack(
    py: Python<'_>,
    src_ptr: usize,
    src_len: usize,
    type_id: u32,
    rows: usize,
    cols: usize,
    dst_ptr: usize,
) -> PyResult<u32> {
    let ty = ggml_type(type_id)?;
    let id = match ty {
        GgmlType::Q4_0 if cols >= 256 => dequant::Q4_0R_ID,
        GgmlType::Q4_1 if cols >= 256 => dequant::Q4_1R_ID,
        GgmlType::Q5_0 if cols >= 256 => dequant::Q5_0R_ID,
        GgmlType::Q4K => dequant::Q4_KR_ID,
        _ => {
            return Err(PyValueError::new_err(format!(
                "ggml type {type_id} with {cols} values a row has no repacked layout"
            )))
        }
    };
    if src_len == 0 {
        return Ok(id);
    }
    py.detach(|| {
        // SAFETY: live, non-overlapping buffers of src_len bytes each from the Python caller.
        let (src, dst) = unsafe {
            (
                std::slice::from_raw_parts(src_ptr as *const u8, src_len),
                std::slice::from_raw_parts_mut(dst_ptr as *mut u8, src_len),
            )
        };
        if kernel::row_groups::grouped(ty).is_some() {
            kernel::row_groups::repack_rows(ty, src, rows, cols, dst)
        } else {
            kernel::octets::repack_rows(ty, src, rows, cols, dst)
        }
    })
    .map_err(PyValueError::new_err)?;
    Ok(id)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(gguf_linear, m)?)?;
    m.add_function(wrap_pyfunction!(gguf_repack, m)?)?;
    m.add_function(wrap_pyfunction!(gguf_rows, m)?)
}
