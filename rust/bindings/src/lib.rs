//! `specinfer._core`: the thin PyO3 layer over the Rust crates, one file per noun:
//! `scheduler_core` (the scheduler: SchedulerCore and its step outputs), `cpu_attention`,
//! `cpu_linear`, `cpu_moe`, `cpu_norm`, `cpu_gguf`, `gguf_decoder` (CPU kernels over torch
//! tensors' memory) and `gguf_dequant` (GGUF block formats to f32).

mod cpu_attention;
mod cpu_gguf;
mod cpu_linear;
mod cpu_moe;
mod cpu_norm;
mod gguf_decoder;
mod gguf_dequant;
mod scheduler_core;

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    scheduler_core::register(m)?;
    cpu_attention::register(m)?;
    cpu_gguf::register(m)?;
    cpu_linear::register(m)?;
    cpu_moe::register(m)?;
    cpu_norm::register(m)?;
    gguf_decoder::register(m)?;
    gguf_dequant::register(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
