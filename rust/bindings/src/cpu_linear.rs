//! `int8_linear`, `w8a8_linear` (with `int8_pack`, its weight layout), `dense_linear` and
//! `panel_linear`: the CPU
//! linear kernels (`specinfer_kernels::int8_linear`, `w8a8_linear`, `dense_linear`) over torch tensors' memory, GIL released. The callers,
//! `specinfer.models.int8_linear` and `specinfer.models.few_rows_linear`, assert
//! the memory contract (CPU, dtypes, contiguity, shapes) before passing `data_ptr()`s; this layer
//! derives every buffer's length from the shapes it is given and the kernel re-checks them.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use specinfer_kernels::int8_pack::TILE;
use specinfer_kernels::{self as kernels, Bf16, Int8Weight, Isa, PackedInt8};

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

/// W8A8: out[m, n] = x[m, k] · (q[n, k] * scales[n, k / group])^T (+ bias[n]) over weights packed by
/// `int8_pack` (w_ptr: u8[tiles(n) * 16 * k], scales_ptr: f32[tiles(n) * 16 * k / group]);
/// bias_ptr 0: none.
#[pyfunction]
#[pyo3(signature = (x_ptr, m, k, w_ptr, scales_ptr, n, group, out_ptr, bias_ptr, num_threads, isa=None))]
#[allow(clippy::too_many_arguments)]
pub fn w8a8_linear(
    py: Python<'_>,
    x_ptr: usize,
    m: usize,
    k: usize,
    w_ptr: usize,
    scales_ptr: usize,
    n: usize,
    group: usize,
    out_ptr: usize,
    bias_ptr: usize,
    num_threads: usize,
    isa: Option<&str>,
) -> PyResult<()> {
    let isa = parse_isa(isa)?;
    check_group(k, group)?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    let tiles = n.div_ceil(TILE);
    py.detach(|| {
        // SAFETY: the Python caller passes live, contiguous buffers of these shapes and dtypes
        // (f32 x/scales/bias/out, u8 w); out aliases none of the inputs.
        let (x, w, scales, bias, out) = unsafe {
            (
                std::slice::from_raw_parts(x_ptr as *const f32, m * k),
                std::slice::from_raw_parts(w_ptr as *const u8, tiles * TILE * k),
                std::slice::from_raw_parts(scales_ptr as *const f32, tiles * TILE * (k / group)),
                (bias_ptr != 0).then(|| std::slice::from_raw_parts(bias_ptr as *const f32, n)),
                std::slice::from_raw_parts_mut(out_ptr as *mut f32, m * n),
            )
        };
        let w = PackedInt8 {
            w,
            scales,
            n,
            k,
            group,
        };
        kernels::w8a8_linear(isa, num_threads, x, m, w, bias, out)
    })
    .map_err(|e| PyValueError::new_err(e.to_string()))
}

fn check_group(k: usize, group: usize) -> PyResult<()> {
    if group == 0 || group % 4 != 0 || k % group != 0 {
        return Err(PyValueError::new_err(format!(
            "group: {group} must be a multiple of 4 dividing k = {k}"
        )));
    }
    Ok(())
}

/// Pack (`unpack` false) int8 q[n, k] / scales[n, k / group] into the kernel's layout
/// (packed: u8[tiles(n) * 16 * k], packed_scales: f32[tiles(n) * 16 * k / group]), or unpack
/// (`unpack` true) the other way.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn int8_pack(
    py: Python<'_>,
    q_ptr: usize,
    scales_ptr: usize,
    n: usize,
    k: usize,
    group: usize,
    packed_ptr: usize,
    packed_scales_ptr: usize,
    unpack: bool,
) -> PyResult<()> {
    check_group(k, group)?;
    let tiles = n.div_ceil(TILE);
    let (nq, ns, np, nps) = (
        n * k,
        n * (k / group),
        tiles * TILE * k,
        tiles * TILE * (k / group),
    );
    py.detach(|| {
        // SAFETY: the caller passes live, contiguous, non-overlapping buffers of these sizes.
        unsafe {
            if unpack {
                kernels::int8_pack::unpack(
                    std::slice::from_raw_parts(packed_ptr as *const u8, np),
                    std::slice::from_raw_parts(packed_scales_ptr as *const f32, nps),
                    n,
                    k,
                    group,
                    std::slice::from_raw_parts_mut(q_ptr as *mut i8, nq),
                    std::slice::from_raw_parts_mut(scales_ptr as *mut f32, ns),
                )
            } else {
                kernels::int8_pack::pack(
                    std::slice::from_raw_parts(q_ptr as *const i8, nq),
                    std::slice::from_raw_parts(scales_ptr as *const f32, ns),
                    n,
                    k,
                    group,
                    std::slice::from_raw_parts_mut(packed_ptr as *mut u8, np),
                    std::slice::from_raw_parts_mut(packed_scales_ptr as *mut f32, nps),
                )
            }
        }
    });
    Ok(())
}

pub(crate) fn parse_isa(isa: Option<&str>) -> PyResult<Isa> {
    match isa {
        None => Ok(Isa::detect()),
        Some(name) => Isa::from_name(name).ok_or_else(|| {
            PyValueError::new_err(format!("isa: unknown {name:?} (scalar, avx2, avx512)"))
        }),
    }
}

/// Whether the float dtype name given as `field` is "bfloat16" (else "float32"; anything else
/// refused).
fn is_bf16(field: &str, dtype: &str) -> PyResult<bool> {
    match dtype {
        "bfloat16" => Ok(true),
        "float32" => Ok(false),
        other => Err(PyValueError::new_err(format!(
            "{field}: {other:?} is not bfloat16 or float32"
        ))),
    }
}

/// x `[m, k]`, bias `[n]` (bias_ptr 0: none) and out `[m, n]`, all f32, of a float linear call.
///
/// # Safety
/// The pointers address live, contiguous f32 buffers of those sizes; out aliases no input.
unsafe fn float_io<'a>(
    x_ptr: usize,
    m: usize,
    k: usize,
    n: usize,
    bias_ptr: usize,
    out_ptr: usize,
) -> (&'a [f32], Option<&'a [f32]>, &'a mut [f32]) {
    (
        std::slice::from_raw_parts(x_ptr as *const f32, m * k),
        (bias_ptr != 0).then(|| std::slice::from_raw_parts(bias_ptr as *const f32, n)),
        std::slice::from_raw_parts_mut(out_ptr as *mut f32, m * n),
    )
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
    let bf16 = is_bf16("w_dtype", w_dtype)?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    py.detach(|| {
        // SAFETY: the Python caller passes live, contiguous f32 x/bias/out buffers of these
        // shapes; out aliases none of the inputs.
        let (x, bias, out) = unsafe { float_io(x_ptr, m, k, n, bias_ptr, out_ptr) };
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

/// out[m, n] = x[m, k] · w^T (+ bias[n], f32): w "float32" packed in panels
/// `[ceil(n / 64), k, 64]` (`kernels::panel_pack`'s layout) or "bfloat16" in paired panels
/// `[ceil(n / 64), ceil(k / 2), 64, 2]` (`kernels::panel_pack_pairs`'s, x then rounded to bf16);
/// x and out of `io_dtype`: "float32", or "bfloat16" with bf16 weights (out rounded once from the
/// f32 result); bias_ptr 0: none. Every output element is the same k-ordered chain whatever m
/// (batch-invariant).
#[pyfunction]
#[pyo3(signature = (x_ptr, m, k, w_ptr, w_dtype, n, out_ptr, bias_ptr, num_threads, isa=None, io_dtype="float32"))]
#[allow(clippy::too_many_arguments)]
pub fn panel_linear(
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
    io_dtype: &str,
) -> PyResult<()> {
    let isa = parse_isa(isa)?;
    let bf16 = is_bf16("w_dtype", w_dtype)?;
    let bf16_io = is_bf16("io_dtype", io_dtype)?;
    if bf16_io && !bf16 {
        return Err(PyValueError::new_err(
            "panel_linear: io_dtype bfloat16 needs bfloat16 weights",
        ));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if bf16 && !w_ptr.is_multiple_of(4) {
        return Err(PyValueError::new_err(
            "panel_linear: bf16 paired panels must be 4-byte aligned",
        ));
    }
    let bias = (bias_ptr != 0).then(|| {
        // SAFETY: the Python caller passes a live, contiguous f32 bias of n elements
        unsafe { std::slice::from_raw_parts(bias_ptr as *const f32, n) }
    });
    py.detach(|| {
        if bf16 {
            let len = kernels::num_panels(n) * kernels::num_pairs(k) * kernels::PANEL;
            // SAFETY: the caller passes live, contiguous buffers of these shapes and dtypes (w the
            // paired panels, two bf16 per u32, 4-byte aligned); out aliases none of the inputs.
            unsafe {
                let w = std::slice::from_raw_parts(w_ptr as *const u32, len);
                if bf16_io {
                    let x = std::slice::from_raw_parts(x_ptr as *const Bf16, m * k);
                    let out = std::slice::from_raw_parts_mut(out_ptr as *mut Bf16, m * n);
                    kernels::panel_linear_bf16(isa, num_threads, x, m, w, n, k, bias, out)
                } else {
                    let x = std::slice::from_raw_parts(x_ptr as *const f32, m * k);
                    let out = std::slice::from_raw_parts_mut(out_ptr as *mut f32, m * n);
                    kernels::panel_linear_bf16(isa, num_threads, x, m, w, n, k, bias, out)
                }
            }
        } else {
            // SAFETY: as above (f32 x, out and panels)
            let (x, bias, out) = unsafe { float_io(x_ptr, m, k, n, bias_ptr, out_ptr) };
            let len = kernels::num_panels(n) * k * kernels::PANEL;
            // SAFETY: as above, w holds the packed panels of f32 values
            let w = unsafe { std::slice::from_raw_parts(w_ptr as *const f32, len) };
            kernels::panel_linear(isa, num_threads, x, m, w, n, k, bias, out)
        }
    })
    .map_err(|e| PyValueError::new_err(e.to_string()))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(int8_linear, m)?)?;
    m.add_function(wrap_pyfunction!(w8a8_linear, m)?)?;
    m.add_function(wrap_pyfunction!(int8_pack, m)?)?;
    m.add_function(wrap_pyfunction!(dense_linear, m)?)?;
    m.add_function(wrap_pyfunction!(panel_linear, m)?)
}
