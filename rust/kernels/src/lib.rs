//! CPU kernels for specinfer, in pure Rust (no Python: the bindings crate wraps them).
//!
//! - [`paged_attention`]: causal attention of a whole mixed batch (prefill chunks, decodes,
//!   1 + k verification runs) straight over the paged KV block pool, with the KV store of the
//!   batch's new keys/values fused in front; per layer a sliding window and a logit soft-cap
//!   ([`paged_attention_with`]).
//! - [`few_rows_linear`]: linear layers at few activation rows (decodes, verification runs,
//!   small batches), streaming the weights with prefetch; its entry points are
//!   [`int8_linear`] (weight-only int8 with per-group f32 scales, e.g. GGUF Q8_0's blocks of
//!   32) and [`dense_linear`] (bf16 or f32 weights). Activations f32.
//! - [`w8a8_linear`]: int8 weights in the tiled layout of [`int8_pack`] times activations
//!   quantized per group of 32 (Q8_0 x Q8_0), exact int32 group dots (AVX-512 VNNI, AVX2,
//!   scalar: bit-identical), every row count.
//! - [`dequant`]: GGUF block formats (Q4_0 .. Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16) to f32, rows in
//!   parallel, bit-identical to the `gguf` package's dequantizers.
//! - [`gguf_decoder`]: a Llama-family decoder layer over GGUF weights in two calls (the
//!   attention half and the MLP's down projection), bit-identical to the unfused layer.
//! - [`moe`]: a sparse mixture-of-experts MLP over few tokens in one call (every active
//!   expert's gate|up and down GEMMs through the few-rows kernel, each token's weighted sum in
//!   ascending expert order).
//! - [`rms_norm`]: RMSNorm over rows in one pass (f32 arithmetic, one rounding for bf16).
//! - [`simd`]: the vector primitives (dot, axpy, scale) for AVX-512, AVX2+FMA and a portable
//!   fallback, chosen at run time ([`simd::Isa::detect`]).
//! - [`elem`]: the element types the cache may hold (f32, bf16) and their f32 conversions.
//! - [`threads`]: the threads the kernels run on (a spinning team per size; rayon for rows).

pub mod dense_linear;
pub mod dequant;
pub mod elem;
pub mod few_rows_linear;
pub mod gated_act;
pub mod gguf_decoder;
pub mod gguf_linear;
pub mod int8_linear;
pub mod int8_pack;
pub mod moe;
pub mod paged_attention;
pub mod panel_linear;
pub mod panel_linear_bf16;
pub mod rms_norm;
pub mod simd;
pub mod threads;
pub mod w8a8_linear;

pub use dense_linear::{dense_linear, DenseElem};
pub use elem::{Bf16, Elem};
pub use int8_linear::{int8_linear, quantize, Int8Weight};
pub use paged_attention::{
    paged_attention, paged_attention_with, store_kv, AttentionError, AttentionOptions, BatchLayout,
    HeadGeometry, StridedHeads,
};
pub use panel_linear::{num_panels, panel_linear, panel_pack, PANEL};
pub use panel_linear_bf16::{num_pairs, panel_linear_bf16, panel_pack_pairs};
pub use rms_norm::rms_norm;
pub use simd::Isa;
pub use w8a8_linear::{check_packed, w8a8_linear, PackedInt8};
