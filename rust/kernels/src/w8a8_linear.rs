//! W8A8 linear (`quantization="w8a8"`): `out[M, N] = x[M, K] · (q[N, K] * scale)^T (+ bias)`, the weights int8 with one
//! f32 scale per group of `group` consecutive inputs of a row (GGUF Q8_0: 32), packed by
//! [`crate::int8_pack`]. Each call quantizes the activation rows per group the same way (Q8_0's
//! rule, as llama.cpp does for Q8_0 weights), so every group's dot product is exact in i32:
//!
//! ```text
//! out[m, n] = sum over groups g of  float(sum_e q[n, e] * xq[m, e]) * (sw[n, g] * sx[m, g])
//! ```
//!
//! accumulated in f32 with one fused multiply-add per group, groups in order, then `+ bias`.
//! Lanes are output rows, so no horizontal sum: every instruction set (AVX-512 VNNI, AVX2, the
//! portable scalar loop) computes each output with the same operations in the same order, and an
//! output row does not depend on M or on the other rows of the batch. A decode, a 1 + k
//! verification run and a prefill chunk therefore agree bit for bit, which greedy speculative
//! decoding needs to stay exact.
//!
//! Cost per 64 weight bytes and activation row: one `vpdpbusd` (4 inputs x 16 rows, the
//! activation bytes broadcast from memory), plus a convert, a multiply and an FMA per group of 32.
//! The weight-only kernel ([`crate::int8_linear`]) widens every int8 weight to f32 and spends 4
//! FMAs per 64 weights per row: compute-bound from a few rows on.
//!
//! The catch: rounding the activations to a grid makes the layer discontinuous, so the float
//! noise by which other kernels differ between a decode and a verification run (~1e-5) can move
//! an input by one step and grow through the layers; greedy speculative output then drifts from
//! non-speculative output. Models using this kernel run attention in its batch-invariant mode
//! (`BatchLayout::set_batch_invariant`), which removes that noise on AVX-512.

use crate::few_rows_linear::check_io;
use crate::int8_pack::{quantize_rows, tiles, QuantizedRows, TILE};
use crate::paged_attention::AttentionError as KernelError;
use crate::simd::Isa;
use crate::threads;

/// Tiles per work item (32 output rows: few items per call, each a contiguous run of weights).
const ITEM_TILES: usize = 2;
/// Bytes ahead of the read position that the weight stream is prefetched.
/// Bytes ahead of the read position that the weight stream is prefetched (measured over the
/// 120 GEMMs of SmolLM2-135M run cold: 4 KB beat 0, 1, 2 and 8 KB).
const PREFETCH_BYTES: usize = 4096;

/// Packed int8 weights ([`crate::int8_pack`]): `w [tiles(n) * 16 * k]` bytes (q + 128) and
/// `scales [tiles(n) * (k / group) * 16]`.
#[derive(Clone, Copy, Debug)]
pub struct PackedInt8<'a> {
    pub w: &'a [u8],
    pub scales: &'a [f32],
    pub n: usize,
    pub k: usize,
    pub group: usize,
}

fn err<T>(field: &'static str, message: impl Into<String>) -> Result<T, KernelError> {
    Err(KernelError {
        field,
        message: message.into(),
    })
}

/// Check the packed weights' shapes (also used by the bindings before packing into them).
pub fn check_packed(w: &PackedInt8<'_>) -> Result<(), KernelError> {
    if w.group == 0 || w.group % 4 != 0 || w.k % w.group != 0 {
        return err(
            "group",
            format!("{} must be a multiple of 4 dividing k = {}", w.group, w.k),
        );
    }
    if w.w.len() != tiles(w.n) * TILE * w.k {
        return err(
            "weight",
            format!(
                "has {} bytes, expected {} tiles x {TILE} x {}",
                w.w.len(),
                tiles(w.n),
                w.k
            ),
        );
    }
    let num_scales = tiles(w.n) * TILE * (w.k / w.group);
    if w.scales.len() != num_scales {
        return err(
            "scales",
            format!("has {} elements, expected {num_scales}", w.scales.len()),
        );
    }
    Ok(())
}

/// out `[m, n]` = x `[m, k]` · w^T (+ bias `[n]`); x, bias and out row-major contiguous.
pub fn w8a8_linear(
    isa: Isa,
    num_threads: usize,
    x: &[f32],
    m: usize,
    w: PackedInt8<'_>,
    bias: Option<&[f32]>,
    out: &mut [f32],
) -> Result<(), KernelError> {
    check_packed(&w)?;
    check_io(isa, x, m, w.k, w.n, bias, out)?;
    if m == 0 || w.n == 0 {
        return Ok(());
    }
    let xq = quantize_rows(x, m, w.k, w.group);
    let job = Job {
        xq: &xq,
        m,
        w,
        bias,
    };
    let run: unsafe fn(&Job<'_>, usize, OutPtr) = match Path::of(isa) {
        #[cfg(target_arch = "x86_64")]
        Path::Vnni512 => item_vnni512,
        #[cfg(target_arch = "x86_64")]
        Path::Avx2 => item_avx2,
        _ => item_scalar,
    };
    let items: Vec<usize> = (0..tiles(w.n)).step_by(ITEM_TILES).collect();
    let out_ptr = OutPtr(out.as_mut_ptr());
    // SAFETY: `run` matches a supported path; items write disjoint output columns.
    threads::for_each_item(num_threads, &items, |&t0| unsafe { run(&job, t0, out_ptr) });
    Ok(())
}

/// The code path an instruction set runs: AVX-512 needs VNNI (and BW) for `vpdpbusd`, else
/// it takes the AVX2 path.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Path {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Vnni512,
}

impl Path {
    fn of(isa: Isa) -> Path {
        #[cfg(target_arch = "x86_64")]
        {
            let vnni = std::arch::is_x86_feature_detected!("avx512vnni")
                && std::arch::is_x86_feature_detected!("avx512bw");
            match isa {
                Isa::Avx512 if vnni => return Path::Vnni512,
                Isa::Avx512 | Isa::Avx2 if Isa::Avx2.is_supported() => return Path::Avx2,
                _ => {}
            }
        }
        let _ = isa;
        Path::Scalar
    }
}

struct Job<'a> {
    xq: &'a QuantizedRows,
    m: usize,
    w: PackedInt8<'a>,
    bias: Option<&'a [f32]>,
}

#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: items write disjoint columns of out.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// Write `acc` (lanes = output rows n0 ..) + bias to row `mi` of out, rows past n dropped.
#[inline(always)]
unsafe fn store_row(job: &Job<'_>, out: OutPtr, mi: usize, n0: usize, acc: &[f32]) {
    let n = job.w.n;
    for (r, &a) in acc.iter().enumerate().take(n.saturating_sub(n0)) {
        let b = job.bias.map_or(0.0, |b| b[n0 + r]);
        *out.0.add(mi * n + n0 + r) = if job.bias.is_some() { a + b } else { a };
    }
}

/// The portable path: the same per-output arithmetic as the vector paths, one lane at a time.
unsafe fn item_scalar(job: &Job<'_>, t0: usize, out: OutPtr) {
    let (k, g) = (job.w.k, job.w.group);
    let groups = k / g;
    for t in t0..(t0 + ITEM_TILES).min(tiles(job.w.n)) {
        let tile = &job.w.w[t * TILE * k..(t + 1) * TILE * k];
        let sw = &job.w.scales[t * groups * TILE..(t + 1) * groups * TILE];
        for mi in 0..job.m {
            let xq = &job.xq.xq[mi * k..(mi + 1) * k];
            let mut acc = [0.0f32; TILE];
            for (r, a) in acc.iter_mut().enumerate() {
                for gi in 0..groups {
                    let mut dot = job.xq.corr[mi * groups + gi];
                    for e in gi * g..(gi + 1) * g {
                        dot += tile[(e / 4) * 64 + r * 4 + e % 4] as i32 * xq[e] as i32;
                    }
                    let s = sw[gi * TILE + r] * job.xq.sx[mi * groups + gi];
                    *a = (dot as f32).mul_add(s, *a);
                }
            }
            store_row(job, out, mi, t * TILE, &acc);
        }
    }
}

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// AVX-512 VNNI: one tile (one sequential weight stream) against up to 8 activation rows per
/// pass. (Two tiles per pass, two streams, measured 10-20 % slower at 1-5 rows.)
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn item_vnni512(job: &Job<'_>, t0: usize, out: OutPtr) {
    for t in t0..(t0 + ITEM_TILES).min(tiles(job.w.n)) {
        let mut m0 = 0;
        while m0 < job.m {
            let mc = (job.m - m0).min(8);
            match mc {
                8 => vnni_block::<1, 8>(job, t, m0, out),
                7 => vnni_block::<1, 7>(job, t, m0, out),
                6 => vnni_block::<1, 6>(job, t, m0, out),
                5 => vnni_block::<1, 5>(job, t, m0, out),
                4 => vnni_block::<1, 4>(job, t, m0, out),
                3 => vnni_block::<1, 3>(job, t, m0, out),
                2 => vnni_block::<1, 2>(job, t, m0, out),
                _ => vnni_block::<1, 1>(job, t, m0, out),
            }
            m0 += mc;
        }
    }
}

/// Tiles t .. t + T against activation rows m0 .. m0 + MC.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn vnni_block<const T: usize, const MC: usize>(
    job: &Job<'_>,
    t: usize,
    m0: usize,
    out: OutPtr,
) {
    let (k, g) = (job.w.k, job.w.group);
    let (groups, vpg) = (k / g, g / 4);
    let w = job.w.w.as_ptr().add(t * TILE * k);
    let xq = job.xq.xq.as_ptr().add(m0 * k);
    let mut accf = [[_mm512_setzero_ps(); MC]; T];
    for gi in 0..groups {
        let mut acci: [[__m512i; MC]; T] = [std::array::from_fn(|mi| {
            _mm512_set1_epi32(*job.xq.corr.get_unchecked((m0 + mi) * groups + gi))
        }); T];
        for v in gi * vpg..(gi + 1) * vpg {
            let wv: [__m512i; T] = std::array::from_fn(|tt| {
                let p = w.add(tt * TILE * k + v * 64);
                crate::simd::prefetch_l2(p.wrapping_add(PREFETCH_BYTES) as *const i8);
                _mm512_loadu_si512(p as *const __m512i)
            });
            for mi in 0..MC {
                let x4 = std::ptr::read_unaligned(xq.add(mi * k + v * 4) as *const i32);
                let xb = _mm512_set1_epi32(x4);
                for tt in 0..T {
                    acci[tt][mi] = _mm512_dpbusd_epi32(acci[tt][mi], wv[tt], xb);
                }
            }
        }
        for tt in 0..T {
            let sw = _mm512_loadu_ps(
                job.w
                    .scales
                    .as_ptr()
                    .add((t + tt) * groups * TILE + gi * TILE),
            );
            for mi in 0..MC {
                let sx = _mm512_set1_ps(*job.xq.sx.get_unchecked((m0 + mi) * groups + gi));
                let s = _mm512_mul_ps(sw, sx);
                accf[tt][mi] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acci[tt][mi]), s, accf[tt][mi]);
            }
        }
    }
    for tt in 0..T {
        for mi in 0..MC {
            let mut lanes = [0.0f32; TILE];
            _mm512_storeu_ps(lanes.as_mut_ptr(), accf[tt][mi]);
            store_row(job, out, m0 + mi, (t + tt) * TILE, &lanes);
        }
    }
}

/// AVX2 (no VNNI): each tile as two halves of 8 rows, 4 activation rows per pass. The int8
/// products go through `vpmaddubsw` on |x| and q signed by x (|q|, |x| <= 127: no saturation).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn item_avx2(job: &Job<'_>, t0: usize, out: OutPtr) {
    let t1 = (t0 + ITEM_TILES).min(tiles(job.w.n));
    for t in t0..t1 {
        for h in 0..2 {
            let mut m0 = 0;
            while m0 < job.m {
                let mc = (job.m - m0).min(4);
                match mc {
                    4 => avx2_block::<4>(job, t, h, m0, out),
                    3 => avx2_block::<3>(job, t, h, m0, out),
                    2 => avx2_block::<2>(job, t, h, m0, out),
                    _ => avx2_block::<1>(job, t, h, m0, out),
                }
                m0 += mc;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn avx2_block<const MC: usize>(job: &Job<'_>, t: usize, h: usize, m0: usize, out: OutPtr) {
    let (k, g) = (job.w.k, job.w.group);
    let (groups, vpg) = (k / g, g / 4);
    let w = job.w.w.as_ptr().add(t * TILE * k + h * 32);
    let xq = job.xq.xq.as_ptr().add(m0 * k);
    let flip = _mm256_set1_epi8(-128);
    let ones = _mm256_set1_epi16(1);
    let mut accf = [_mm256_setzero_ps(); MC];
    for gi in 0..groups {
        let mut acci = [_mm256_setzero_si256(); MC];
        for v in gi * vpg..(gi + 1) * vpg {
            let p = w.add(v * 64);
            crate::simd::prefetch_l2(p.wrapping_add(PREFETCH_BYTES) as *const i8);
            // bytes q + 128 back to signed q
            let q = _mm256_xor_si256(_mm256_loadu_si256(p as *const __m256i), flip);
            for (mi, a) in acci.iter_mut().enumerate() {
                let x4 = std::ptr::read_unaligned(xq.add(mi * k + v * 4) as *const i32);
                let xb = _mm256_set1_epi32(x4);
                let pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(xb, xb), _mm256_sign_epi8(q, xb));
                *a = _mm256_add_epi32(*a, _mm256_madd_epi16(pairs, ones));
            }
        }
        // exact integer dot of the group; add the offset correction's counterpart (none here:
        // this path multiplies q itself, the VNNI path q + 128 then corrects)
        let sw = _mm256_loadu_ps(
            job.w
                .scales
                .as_ptr()
                .add(t * groups * TILE + gi * TILE + h * 8),
        );
        for (mi, a) in accf.iter_mut().enumerate() {
            let sx = _mm256_set1_ps(*job.xq.sx.get_unchecked((m0 + mi) * groups + gi));
            *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acci[mi]), _mm256_mul_ps(sw, sx), *a);
        }
    }
    for (mi, a) in accf.iter().enumerate() {
        let mut lanes = [0.0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), *a);
        store_row(job, out, m0 + mi, t * TILE + h * 8, &lanes);
    }
}

#[cfg(test)]
#[path = "w8a8_linear_tests.rs"]
mod tests;
