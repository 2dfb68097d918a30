//! CPU kernels for specinfer, in pure Rust (no Python: the bindings crate wraps them).
//!
//! - [`paged_attention`]: causal attention of a whole mixed batch (prefill chunks, decodes,
//!   1 + k verification runs) straight over the paged KV block pool, with the KV store of the
//!   batch's new keys/values fused in front.
//! - [`int8_linear`]: weight-only int8 linear (int8 weights with per-group f32 scales, e.g.
//!   GGUF Q8_0's blocks of 32, f32 activations).
//! - [`rms_norm`]: RMSNorm over rows in one pass (f32 arithmetic, one rounding for bf16).
//! - [`simd`]: the vector primitives (dot, axpy, scale) for AVX-512, AVX2+FMA and a portable
//!   fallback, chosen at run time ([`simd::Isa::detect`]).
//! - [`elem`]: the element types the cache may hold (f32, bf16) and their f32 conversions.
//! - [`threads`]: the rayon pool the kernels run on, sized per call.

pub mod elem;
pub mod int8_linear;
pub mod paged_attention;
pub mod rms_norm;
pub mod simd;
pub mod threads;

pub use elem::{Bf16, Elem};
pub use int8_linear::{int8_linear, quantize, Int8Weight};
pub use paged_attention::{
    paged_attention, store_kv, AttentionError, BatchLayout, HeadGeometry, StridedHeads,
};
pub use rms_norm::rms_norm;
pub use simd::Isa;
