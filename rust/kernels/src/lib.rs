//! CPU kernels for specinfer, in pure Rust (no Python: the bindings crate wraps them).
//!
//! - [`paged_attention`]: causal attention of a whole mixed batch (prefill chunks, decodes,
//!   1 + k verification runs) straight over the paged KV block pool, with the KV store of the
//!   batch's new keys/values fused in front.
//! - [`simd`]: the vector primitives (dot, axpy, scale) for AVX-512, AVX2+FMA and a portable
//!   fallback, chosen at run time ([`simd::Isa::detect`]).
//! - [`elem`]: the element types the cache may hold (f32, bf16) and their f32 conversions.
//! - [`threads`]: the rayon pool the kernels run on, sized per call.

pub mod elem;
pub mod paged_attention;
pub mod simd;
pub mod threads;

pub use elem::{Bf16, Elem};
pub use paged_attention::{
    paged_attention, store_kv, AttentionError, BatchLayout, HeadGeometry, StridedHeads,
};
pub use simd::Isa;
