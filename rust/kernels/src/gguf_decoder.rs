//! The decoder layers of a Llama-family model over GGUF weights as stored, a whole forward in
//! one call ([`forward`]), so that a small model's forward is not the ~100 µs of Python and
//! torch dispatch per layer it was (SmolLM2-135M: ~3 ms of a 16 ms decode step). Per layer:
//!
//! - [`attention_half`]: h = rmsnorm(x); qkv = h·Wqkv^T (+ bias); rotate q and k (rope, the
//!   rotate-half form); store k, v in the paged cache and attend; x += attn·Wo^T (+ bias);
//!   gate_up = rmsnorm(x)·Wgate_up^T.
//! - [`mlp`]: act = silu(gate) * up ([`crate::gated_act::silu_mul`], which the unfused layers of
//!   a GGUF model call too); x += act·Wdown^T.
//!
//! Every step is the kernel the unfused path calls ([`crate::rms_norm`],
//! [`crate::gguf_linear::gguf_linear`], [`crate::store_kv`], [`crate::paged_attention_with`]) or
//! the same IEEE operations in the same order (rope: `x * cos + roll(x, D/2) * sin_signed` as two
//! products and a sum; residual adds), so a token's bits equal the unfused forward's.

use crate::dequant::GgmlType;
use crate::gguf_linear::{gguf_linear, row_bytes, Part};
use crate::paged_attention::{
    paged_attention_with, store_kv, AttentionOptions, BatchLayout, HeadGeometry, StridedHeads,
};
use crate::simd::Isa;

/// One layer's weights: GEMM weights as the parts of their stored tensors, norms and biases f32.
pub struct Layer<'a> {
    pub input_norm: &'a [f32],
    pub qkv: Vec<Part<'a>>,
    pub qkv_bias: Option<&'a [f32]>,
    pub o: Vec<Part<'a>>,
    pub o_bias: Option<&'a [f32]>,
    pub post_norm: &'a [f32],
    pub gate_up: Vec<Part<'a>>,
    pub down: Vec<Part<'a>>,
}

/// The model's shape and constants.
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    pub hidden: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub eps: f32,
    pub scale: f32,
}

impl Dims {
    fn qkv_width(&self) -> usize {
        (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
    }
}

/// Reused buffers (grown to the largest batch seen).
#[derive(Default)]
pub struct Scratch {
    h: Vec<f32>,
    qkv: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    act: Vec<f32>,
    gate_up: Vec<f32>,
}

fn sized(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n {
        v.resize(n, 0.0);
    }
    &mut v[..n]
}

/// Threads, ISA choices and the paged cache of one call.
pub struct Run<'a> {
    pub gemm_isa: Isa,
    pub attn_isa: Isa,
    pub num_threads: usize,
    pub layout: &'a BatchLayout,
    pub num_blocks: usize,
    pub block_size: usize,
}

/// Rotate the first `heads` heads of every row of `qkv` ([t, width], head_dim d) in place:
/// out[i] = x[i] * cos[i] + x[(i + d/2) % d] * sin[i], cos / sin [t, d] per token (the
/// model's `rope_factors`: (cos | cos) and (-sin | sin)).
fn rope(qkv: &mut [f32], t: usize, width: usize, heads: usize, d: usize, cos: &[f32], sin: &[f32]) {
    let half = d / 2;
    let mut tmp = vec![0.0f32; d];
    for ti in 0..t {
        let (c, s) = (&cos[ti * d..(ti + 1) * d], &sin[ti * d..(ti + 1) * d]);
        for h in 0..heads {
            let x = &mut qkv[ti * width + h * d..ti * width + (h + 1) * d];
            for i in 0..d {
                let a = x[i] * c[i];
                let b = x[(i + half) % d] * s[i];
                tmp[i] = a + b;
            }
            x.copy_from_slice(&tmp);
        }
    }
}

/// The layer up to the MLP's activation: x ([t, hidden]) takes the attention output; gate_up
/// ([t, 2 * intermediate]) receives the MLP's gate | up projections. `cache` is the layer's
/// paged KV ([2, num_blocks, block_size, kv_heads, head_dim]); `cos` / `sin` [t, head_dim].
#[allow(clippy::too_many_arguments)]
pub fn attention_half(
    dims: &Dims,
    layer: &Layer<'_>,
    run: &Run<'_>,
    x: &mut [f32],
    t: usize,
    cos: &[f32],
    sin: &[f32],
    cache: &mut [f32],
    gate_up: &mut [f32],
    scratch: &mut Scratch,
) -> Result<(), String> {
    let d = dims;
    let (hd, w) = (d.head_dim, d.qkv_width());
    if x.len() != t * d.hidden || gate_up.len() != t * 2 * d.intermediate {
        return Err("gguf_decoder: x or gate_up has the wrong size".into());
    }
    if cos.len() != t * hd || sin.len() != t * hd || hd % 2 != 0 {
        return Err("gguf_decoder: cos / sin must be [t, head_dim] (head_dim even)".into());
    }
    let th = run.num_threads;
    let h = sized(&mut scratch.h, t * d.hidden);
    crate::rms_norm(th, x, layer.input_norm, d.hidden, d.eps, h)?;
    let qkv = sized(&mut scratch.qkv, t * w);
    gguf_linear(
        run.gemm_isa,
        th,
        h,
        t,
        d.hidden,
        &layer.qkv,
        layer.qkv_bias,
        qkv,
    )
    .map_err(|e| e.to_string())?;
    rope(qkv, t, w, d.num_heads + d.num_kv_heads, hd, cos, sin);
    let geo = HeadGeometry {
        num_heads: d.num_heads,
        num_kv_heads: d.num_kv_heads,
        head_dim: hd,
        block_size: run.block_size,
        num_blocks: run.num_blocks,
    };
    if cache.len() != 2 * geo.cache_half_len() {
        return Err("gguf_decoder: the KV cache does not match num_blocks x block_size".into());
    }
    let heads = |first: usize, n: usize| StridedHeads {
        data: &qkv[first * hd..],
        num_tokens: t,
        num_heads: n,
        head_dim: hd,
        token_stride: w,
        head_stride: hd,
    };
    let (kh, vh) = (
        heads(d.num_heads, d.num_kv_heads),
        heads(d.num_heads + d.num_kv_heads, d.num_kv_heads),
    );
    store_kv(run.layout, &geo, kh, vh, cache).map_err(|e| e.to_string())?;
    let attn = sized(&mut scratch.attn, t * d.num_heads * hd);
    let q = heads(0, d.num_heads);
    paged_attention_with(
        run.attn_isa,
        th,
        run.layout,
        &geo,
        q,
        cache,
        attn,
        d.scale,
        AttentionOptions::default(),
    )
    .map_err(|e| e.to_string())?;
    let o = sized(&mut scratch.proj, t * d.hidden);
    gguf_linear(
        run.gemm_isa,
        th,
        attn,
        t,
        d.num_heads * hd,
        &layer.o,
        layer.o_bias,
        o,
    )
    .map_err(|e| e.to_string())?;
    x.iter_mut().zip(o.iter()).for_each(|(a, b)| *a += *b);
    crate::rms_norm(th, x, layer.post_norm, d.hidden, d.eps, h)?;
    gguf_linear(
        run.gemm_isa,
        th,
        h,
        t,
        d.hidden,
        &layer.gate_up,
        None,
        gate_up,
    )
    .map_err(|e| e.to_string())
}

/// x ([t, hidden]) += act · Wdown^T, act = silu(gate) * up of `gate_up` ([t, 2 * intermediate],
/// what [`attention_half`] wrote) by [`crate::gated_act::silu_mul`].
pub fn mlp(
    dims: &Dims,
    layer: &Layer<'_>,
    run: &Run<'_>,
    x: &mut [f32],
    t: usize,
    gate_up: &[f32],
    scratch: &mut Scratch,
) -> Result<(), String> {
    if x.len() != t * dims.hidden || gate_up.len() != t * 2 * dims.intermediate {
        return Err("gguf_decoder: x or gate_up has the wrong size".into());
    }
    let act = sized(&mut scratch.act, t * dims.intermediate);
    crate::gated_act::silu_mul(
        run.gemm_isa,
        run.num_threads,
        gate_up,
        t,
        dims.intermediate,
        act,
    )?;
    let down = sized(&mut scratch.proj, t * dims.hidden);
    gguf_linear(
        run.gemm_isa,
        run.num_threads,
        act,
        t,
        dims.intermediate,
        &layer.down,
        None,
        down,
    )
    .map_err(|e| e.to_string())?;
    x.iter_mut().zip(down.iter()).for_each(|(a, b)| *a += *b);
    Ok(())
}

/// Every layer over x ([t, hidden], in place): layer i's [`attention_half`] over `caches[i]`,
/// then its [`mlp`]. `layer(i)` gives layer i's weights.
#[allow(clippy::too_many_arguments)]
pub fn forward<'w>(
    dims: &Dims,
    num_layers: usize,
    layer: impl Fn(usize) -> Layer<'w>,
    run: &Run<'_>,
    x: &mut [f32],
    t: usize,
    cos: &[f32],
    sin: &[f32],
    caches: &mut [&mut [f32]],
    scratch: &mut Scratch,
) -> Result<(), String> {
    if caches.len() != num_layers {
        return Err(format!(
            "gguf_decoder: {} caches for {num_layers} layers",
            caches.len()
        ));
    }
    let mut gate_up = std::mem::take(&mut scratch.gate_up);
    let gu = sized(&mut gate_up, t * 2 * dims.intermediate);
    let result = (|| {
        for (i, cache) in caches.iter_mut().enumerate() {
            let l = layer(i);
            attention_half(dims, &l, run, x, t, cos, sin, cache, gu, scratch)?;
            mlp(dims, &l, run, x, t, gu, scratch)?;
        }
        Ok(())
    })();
    scratch.gate_up = gate_up;
    result
}

/// Bytes of `n` rows of `k` values of type `ty` (None: k is not whole blocks).
pub fn part_bytes(ty: GgmlType, n: usize, k: usize) -> Option<usize> {
    row_bytes(ty, k).map(|rb| rb * n)
}
