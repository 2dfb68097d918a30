//! GGUF block formats as stored, times activations (`quantization="gguf"`):
//! `out[m, n] = x[m, k] · W^T (+ bias)` where the weight rows are the file's own blocks
//! (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; F32, F16, BF16), never inflated. A weight
//! may be several *parts* (q | k | v stored as three tensors, of different types in llama.cpp's
//! mixes); their outputs are the output's columns in order, computed in one parallel call.
//!
//! Activations are quantized per call the way llama.cpp does for these formats' dot products
//! ([`acts`]): blocks of 32 (int8 + f32 scale, and the scaled sum the formats with a minimum
//! need) for the 32-value formats, blocks of 256 (int8 + f32 scale + sums of 16) for the K
//! formats; float parts take the activations as f32. Every block's product is then exact in
//! int32 and scaled once in f32.
//!
//! Batch invariance: every output `out[m, n]` is one call of its format's dot function over
//! weight row `n` and activation row `m` (rows taken up to [`ROWS`] at a time, each row's
//! arithmetic the same whatever the others), and each activation row is quantized on its own.
//! A decode, a 1 + k verification run and a prefill chunk therefore agree bit for bit on the
//! rows they share, which keeps greedy speculative decoding token-for-token exact.
//!
//! Format files: [`q32`] (Q4_0 .. Q8_0; its octets, Q4_0 and Q4_1 repacked), [`kquants`] (Q4_K,
//! Q5_K, Q6_K), [`kquants_x8`] (Q4_K repacked in groups of eight rows), [`float`] (F32, F16,
//! BF16); each has a portable path and an AVX2 path, chosen by [`Path`].

pub mod acts;
mod float;
mod kquants;
mod kquants_x8;
mod q32;

pub use q32::octets;
/// Q4_K in groups of eight rows ([`GgmlType::Q4KR`]).
pub mod row_groups {
    pub use super::kquants_x8::{file_layout, file_row, grouped, repack_rows, GROUP_BLOCK};
}

use crate::dequant::GgmlType;
use crate::paged_attention::AttentionError as KernelError;
use crate::simd::Isa;
use crate::threads;

pub use acts::Acts;

/// Activation rows one dot call handles (each with its own accumulators).
pub const ROWS: usize = 4;

/// `out[i] = dot(weight row at w, activation row m0 + i)` for `i < mc` (`1 <= mc <= ROWS`). `w`
/// points at the row's first block; the row holds `acts.k` values.
pub type DotFn =
    unsafe fn(w: *const u8, acts: &Acts<'_>, m0: usize, mc: usize, out: &mut [f32; ROWS]);

/// `out[i * ldo + r] = dot(weight row r (at w + r * row_bytes), activation row m0 + i)` for
/// `r < rows`, `i < mc`: one call per work item and group of activation rows, so the per-row
/// call and the format's constants are paid once per item, not once per weight row.
pub type RowsFn = unsafe fn(
    w: *const u8,
    row_bytes: usize,
    rows: usize,
    acts: &Acts<'_>,
    m0: usize,
    mc: usize,
    out: *mut f32,
    ldo: usize,
);

/// A [`RowsFn`] looping a format's [`DotFn`] over rows, compiled with the dot function's
/// target features so that it is inlined into the loop.
macro_rules! rows_fn {
    ($dot:expr $(, $feat:literal)?) => {{
        $(#[target_feature(enable = $feat)])?
        #[allow(clippy::too_many_arguments)]
        unsafe fn rows(
            w: *const u8,
            row_bytes: usize,
            rows: usize,
            acts: &$crate::gguf_linear::Acts<'_>,
            m0: usize,
            mc: usize,
            out: *mut f32,
            ldo: usize,
        ) {
            let mut tmp = [0.0f32; $crate::gguf_linear::ROWS];
            for r in 0..rows {
                $dot(w.add(r * row_bytes), acts, m0, mc, &mut tmp);
                for (i, &v) in tmp.iter().enumerate().take(mc) {
                    *out.add(i * ldo + r) = v;
                }
            }
        }
        rows as $crate::gguf_linear::RowsFn
    }};
}
pub(crate) use rows_fn;

/// The code path an instruction set runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
}

impl Path {
    pub fn of(isa: Isa) -> Path {
        #[cfg(target_arch = "x86_64")]
        if matches!(isa, Isa::Avx2 | Isa::Avx512) && Isa::Avx2.is_supported() {
            return Path::Avx2;
        }
        let _ = isa;
        Path::Scalar
    }
}

/// The kernel file that multiplies a type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Family {
    Float,
    Q32,
    KQuant,
}

fn family(ty: GgmlType) -> Family {
    match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => Family::Float,
        GgmlType::Q4_0
        | GgmlType::Q4_1
        | GgmlType::Q5_0
        | GgmlType::Q5_1
        | GgmlType::Q8_0
        | GgmlType::Q4_0R
        | GgmlType::Q4_1R
        | GgmlType::Q5_0R => Family::Q32,
        GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K | GgmlType::Q4KR => Family::KQuant,
    }
}

/// The dot function of type `ty` on `path`; None for a type this kernel does not multiply.
pub fn dot_fn(ty: GgmlType, path: Path) -> Option<DotFn> {
    match family(ty) {
        Family::Float => float::select(ty, path),
        Family::Q32 => q32::select(ty, path),
        Family::KQuant => kquants::select(ty, path),
    }
}

/// The rows function of type `ty` on `path`.
pub fn rows_fn_of(ty: GgmlType, path: Path) -> Option<RowsFn> {
    match family(ty) {
        Family::Float => float::select_rows(ty, path),
        Family::Q32 => q32::select_rows(ty, path),
        Family::KQuant => kquants::select_rows(ty, path),
    }
}

/// Which activation forms a type's dot function reads.
pub fn needs(ty: GgmlType) -> acts::Forms {
    match family(ty) {
        Family::Float => acts::Forms::F32,
        // the octets read the quants in pair order too
        Family::Q32 if matches!(ty, GgmlType::Q4_0R | GgmlType::Q4_1R | GgmlType::Q5_0R) => {
            acts::Forms::Q8 | acts::Forms::Q8P
        }
        Family::Q32 => acts::Forms::Q8,
        Family::KQuant => acts::Forms::Q8K,
    }
}

/// Bytes of one row of `k` values of type `ty`; None when `k` is not a whole number of blocks.
pub fn row_bytes(ty: GgmlType, k: usize) -> Option<usize> {
    let (per, bytes) = ty.block();
    (k % per == 0).then_some(k / per * bytes)
}

/// One stored tensor (or a row range of one): `n` rows of type `ty`, `data` their blocks back
/// to back (`n * row_bytes(ty, k)` bytes).
#[derive(Clone, Copy, Debug)]
pub struct Part<'a> {
    pub ty: GgmlType,
    pub data: &'a [u8],
    pub n: usize,
}

fn err<T>(field: &'static str, message: impl Into<String>) -> Result<T, KernelError> {
    Err(KernelError {
        field,
        message: message.into(),
    })
}

/// Check the parts against `k` (each a whole number of rows of whole blocks); -> total rows.
pub fn check_parts(parts: &[Part<'_>], k: usize) -> Result<usize, KernelError> {
    let mut n = 0;
    for (i, p) in parts.iter().enumerate() {
        let Some(rb) = row_bytes(p.ty, k) else {
            return err(
                "weight",
                format!(
                    "part {i} ({:?}): k = {k} is not a whole number of {}-value blocks",
                    p.ty,
                    p.ty.block().0
                ),
            );
        };
        if p.data.len() != p.n * rb {
            return err(
                "weight",
                format!(
                    "part {i} ({:?}) has {} bytes, expected {} rows x {rb}",
                    p.ty,
                    p.data.len(),
                    p.n
                ),
            );
        }
        n += p.n;
    }
    Ok(n)
}

/// Rows of one part per work item (a multiple of 4; items are the unit threads take).
fn rows_per_item(n_total: usize, num_threads: usize) -> usize {
    let want = n_total.div_ceil(8 * num_threads.max(1));
    want.clamp(8, 256).next_multiple_of(4)
}

/// The rows a type's layout interleaves (an item of its part starts on a multiple).
fn row_group(ty: GgmlType) -> usize {
    if ty == GgmlType::Q4KR {
        8
    } else {
        1
    }
}

/// The sum of the eight lanes, in one fixed order (the same for every row count).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn hsum(v: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// Weight bytes (times activation rows / 8) from which a call is split over threads: handing
/// work to the team's spinning helpers costs well under a µs (threads.rs), so only calls of a
/// few µs stay on one thread. `SPECINFER_GGUF_PARALLEL_MIN_BYTES` overrides it (the bench's sweep).
const PARALLEL_MIN_BYTES: usize = 32 << 10;

fn parallel_min_bytes() -> usize {
    static V: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *V.get_or_init(|| {
        std::env::var("SPECINFER_GGUF_PARALLEL_MIN_BYTES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(PARALLEL_MIN_BYTES)
    })
}

/// Activation rows per pass over an item's weight rows (its weights stay in cache meanwhile).
const M_BLOCK: usize = 32;

/// out `[m, n]` = x `[m, k]` · W^T (+ bias `[n]`), W the parts' rows in order; x, bias and out
/// row-major contiguous.
#[allow(clippy::too_many_arguments)]
pub fn gguf_linear(
    isa: Isa,
    num_threads: usize,
    x: &[f32],
    m: usize,
    k: usize,
    parts: &[Part<'_>],
    bias: Option<&[f32]>,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let n = check_parts(parts, k)?;
    crate::few_rows_linear::check_io(isa, x, m, k, n, bias, out)?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    let path = Path::of(isa);
    let mut forms = acts::Forms::NONE;
    let mut fns = Vec::with_capacity(parts.len());
    for p in parts {
        let Some(f) = rows_fn_of(p.ty, path) else {
            return err("weight", format!("type {:?} has no dot kernel", p.ty));
        };
        fns.push(f);
        forms = forms | needs(p.ty);
    }
    // small calls on one thread (with rayon's sleeping workers the threshold had to be 2 MB: a
    // decode of SmolLM2-135M on 2 threads was 1.5x slower than on one when every GEMM split)
    let bytes: usize = parts.iter().map(|p| p.data.len()).sum();
    let num_threads = if bytes.saturating_mul(1 + m / 8) < parallel_min_bytes() {
        1
    } else {
        num_threads
    };
    let acts = Acts::new(x, m, k, forms, num_threads);
    // work items: (part, first row, rows, first output column)
    let per = rows_per_item(n, num_threads);
    let mut items = Vec::new();
    let mut col = 0;
    for (pi, p) in parts.iter().enumerate() {
        let per = per.next_multiple_of(row_group(p.ty));
        let mut r = 0;
        while r < p.n {
            let rows = per.min(p.n - r);
            items.push((pi, r, rows, col + r));
            r += rows;
        }
        col += p.n;
    }
    let out_ptr = threads::DisjointOut(out.as_mut_ptr());
    let run = |&(pi, r0, rows, c0): &(usize, usize, usize, usize)| {
        let p = &parts[pi];
        let rb = row_bytes(p.ty, k).unwrap_or(0);
        let f = fns[pi];
        // SAFETY: rows r0 .. r0 + rows of the part lie within p.data (checked); items write
        // disjoint output columns c0 .. c0 + rows.
        unsafe {
            let w = p.data.as_ptr().add(r0 * rb);
            let mut mb = 0;
            while mb < m {
                let me = (mb + M_BLOCK).min(m);
                let mut m0 = mb;
                while m0 < me {
                    let mc = (me - m0).min(ROWS);
                    f(w, rb, rows, &acts, m0, mc, out_ptr.at(m0 * n + c0), n);
                    m0 += mc;
                }
                mb = me;
            }
            if let Some(b) = bias {
                for mi in 0..m {
                    for r in 0..rows {
                        *out_ptr.at(mi * n + c0 + r) += b[c0 + r];
                    }
                }
            }
        }
    };
    threads::for_each_item(num_threads, &items, run);
    Ok(())
}

#[cfg(test)]
mod tests;
