//! The K formats (Q4_K, Q5_K, Q6_K) times activations in blocks of 256
//! ([`super::acts::Q8KRows`]: `qs`, one scale `d_x` per 256, `bsums` per 16). Per super-block
//! of 256 values and activation row, exact int32 sums, then f32 multiply-adds:
//!
//! - Q4_K / Q5_K (value `(d * sc_s) * q - dmin * m_s`, sub-block `s` of 32, `q` unsigned):
//!   `acc += d_x * d * sum_s sc_s * sum_{i in s} q * q_x  -  d_x * dmin * sum_s m_s * bsum32_s`,
//!   `bsum32_s = bsums[2 s] + bsums[2 s + 1]` (the minimums' term needs no weight values).
//! - Q6_K (value `(d * sc_g) * (q - 32)`, group `g` of 16, `q` unsigned 6-bit):
//!   `acc += d_x * d * (sum_g sc_g * sum_{i in g} q * q_x  -  32 * sum_g sc_g * bsums[g])`.
//!
//! Batch invariance: each weight super-block is unpacked once (nibbles, high bits, 6-bit
//! scales) and applied to each of the `mc` activation rows; a row's integer sums are exact and
//! its float operations (the same few per super-block, then one horizontal sum in
//! a fixed order) are the same whatever `mc`, `m0` or the other rows. The AVX2 path keeps
//! eight f32 lanes per row (each lane a fixed share of the super-block's products) and adds
//! them once at the end; the scalar path one f32 per row. The two paths agree to f32
//! rounding, not bit for bit.
//!
//! AVX2 (the technique of llama.cpp's `ggml_vec_dot_q*_K_q8_K`, one weight row against up to
//! [`ROWS`] activation rows): the integer products go through `vpmaddubsw` (unsigned weight
//! values <= 63 times signed activations |q_x| <= 127: pairs <= 16002, no saturation), then
//! `vpmaddwd` with the sub-block's scale broadcast over the vector (Q4_K / Q5_K: one scale per
//! 32 values; Q6_K: one per 128-bit half), summed in i32 per row; the minimums' (Q4_K, Q5_K)
//! or offsets' (Q6_K) term is one `vpmaddwd` of the activation's sums of 16 per super-block.
//! The per-row code is const-generic over the row count (`MC`) so every row lives in
//! registers. Cost, measured on one Zen 3 core (2.4 GHz, L2-resident weights): ~7.5 / 9.5 /
//! 9 ns per super-block for one row (Q4_K / Q5_K / Q6_K: 19 / 18 / 23 GB/s of weights, about
//! one core's DRAM read rate, so a decode streams at memory speed), ~4.5 / 5 / 5 ns per
//! super-block and row at 4 rows; the scalar path 34 / 37 / 39 ns.

use super::{Acts, DotFn, Path, ROWS};
use crate::dequant::GgmlType;
use half::f16;

pub(super) fn select_rows(ty: GgmlType, path: Path) -> Option<super::RowsFn> {
    use super::rows_fn;
    Some(match (ty, path) {
        (GgmlType::Q4K, Path::Scalar) => rows_fn!(q45k_scalar::<false>),
        (GgmlType::Q5K, Path::Scalar) => rows_fn!(q45k_scalar::<true>),
        (GgmlType::Q6K, Path::Scalar) => rows_fn!(q6k_scalar),
        (GgmlType::Q4KR, Path::Scalar) => super::kquants_x8::scalar_rows(ty)?,
        #[cfg(target_arch = "x86_64")]
        (GgmlType::Q4KR, Path::Avx2) => super::kquants_x8::avx2,
        #[cfg(target_arch = "x86_64")]
        (GgmlType::Q4K, Path::Avx2) => rows_fn!(q4k_avx2, "avx2,fma,f16c"),
        #[cfg(target_arch = "x86_64")]
        (GgmlType::Q5K, Path::Avx2) => rows_fn!(q5k_avx2, "avx2,fma,f16c"),
        #[cfg(target_arch = "x86_64")]
        (GgmlType::Q6K, Path::Avx2) => rows_fn!(q6k_avx2, "avx2,fma,f16c"),
        _ => return None,
    })
}

pub(super) fn select(ty: GgmlType, path: Path) -> Option<DotFn> {
    Some(match (ty, path) {
        (GgmlType::Q4K, Path::Scalar) => q45k_scalar::<false>,
        (GgmlType::Q5K, Path::Scalar) => q45k_scalar::<true>,
        (GgmlType::Q6K, Path::Scalar) => q6k_scalar,
        #[cfg(target_arch = "x86_64")]
        (GgmlType::Q4K, Path::Avx2) => q4k_avx2,
        #[cfg(target_arch = "x86_64")]
        (GgmlType::Q5K, Path::Avx2) => q5k_avx2,
        #[cfg(target_arch = "x86_64")]
        (GgmlType::Q6K, Path::Avx2) => q6k_avx2,
        _ => return None,
    })
}

/// Bytes per super-block.
const Q4K_BYTES: usize = 144;
const Q5K_BYTES: usize = 176;
const Q6K_BYTES: usize = 210;

/// Bytes ahead of the read position that the weight stream is prefetched.
#[cfg(target_arch = "x86_64")]
const PREFETCH_BYTES: usize = 4096;

#[inline(always)]
unsafe fn h(p: *const u8) -> f32 {
    f16::from_le_bytes(std::ptr::read_unaligned(p as *const [u8; 2])).to_f32()
}

/// The 12 packed scale bytes of Q4_K / Q5_K unpacked: bytes 0..8 the eight 6-bit scales,
/// bytes 8..16 the eight 6-bit mins (`dequant::scale_min_k4`, four bytes at a time).
#[inline(always)]
unsafe fn scales_mins(p: *const u8) -> [u8; 16] {
    const LOW6: u32 = 0x3F3F_3F3F;
    const LOW4: u32 = 0x0F0F_0F0F;
    const LOW2: u32 = 0x0303_0303;
    let word =
        |at: usize| u32::from_le_bytes(std::ptr::read_unaligned(p.add(at) as *const [u8; 4]));
    // a: scales 0..4 (low 6 bits), top bits of scales 4..8; b: the same for the mins;
    // c: low 4 bits of scales 4..8 (low nibbles) and of mins 4..8 (high nibbles)
    let (a, b, c) = (word(0), word(4), word(8));
    let words = [
        a & LOW6,
        (c & LOW4) | (((a >> 6) & LOW2) << 4),
        b & LOW6,
        ((c >> 4) & LOW4) | (((b >> 6) & LOW2) << 4),
    ];
    let mut out = [0u8; 16];
    for (o, w) in out.chunks_exact_mut(4).zip(words) {
        o.copy_from_slice(&w.to_le_bytes());
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Portable path

/// Q4_K's portable dot (also the repacked groups' fallback, [`super::kquants_x8`]).
pub(super) unsafe fn q4k_scalar(
    w: *const u8,
    acts: &Acts<'_>,
    m0: usize,
    mc: usize,
    out: &mut [f32; ROWS],
) {
    q45k_scalar::<false>(w, acts, m0, mc, out)
}

/// Q4_K (144-byte blocks: d, dmin, scales[12], qs[128]) or Q5_K (`FIVE`; 176: d, dmin,
/// scales[12], qh[32], qs[128]).
unsafe fn q45k_scalar<const FIVE: bool>(
    w: *const u8,
    acts: &Acts<'_>,
    m0: usize,
    mc: usize,
    out: &mut [f32; ROWS],
) {
    let q8 = acts.q8k.as_ref().unwrap_unchecked();
    let (k, nb) = (acts.k, acts.k / 256);
    let bytes = if FIVE { Q5K_BYTES } else { Q4K_BYTES };
    let mut acc = [0.0f32; ROWS];
    let mut q = [0u8; 256];
    for b in 0..nb {
        let blk = w.add(b * bytes);
        let (d, dmin) = (h(blk), h(blk.add(2)));
        let sm = scales_mins(blk.add(4));
        let qs = std::slice::from_raw_parts(blk.add(if FIVE { 48 } else { 16 }), 128);
        let qh = std::slice::from_raw_parts(blk.add(16), if FIVE { 32 } else { 0 });
        // sub-blocks 2 j and 2 j + 1: the low and high nibbles of qs[32 j ..][..32]
        for j in 0..4 {
            for i in 0..32 {
                let (mut lo, mut hi) = (qs[32 * j + i] & 0x0F, qs[32 * j + i] >> 4);
                if FIVE {
                    lo |= ((qh[i] >> (2 * j)) & 1) << 4;
                    hi |= ((qh[i] >> (2 * j + 1)) & 1) << 4;
                }
                q[64 * j + i] = lo;
                q[64 * j + 32 + i] = hi;
            }
        }
        for (r, a) in acc.iter_mut().enumerate().take(mc) {
            let mi = m0 + r;
            let x = &q8.qs[mi * k + 256 * b..mi * k + 256 * b + 256];
            let bs = &q8.bsums[mi * (k / 16) + 16 * b..mi * (k / 16) + 16 * b + 16];
            let (mut sumi, mut summ) = (0i32, 0i32);
            for s in 0..8 {
                let dot: i32 = q[32 * s..32 * s + 32]
                    .iter()
                    .zip(&x[32 * s..32 * s + 32])
                    .map(|(&qv, &xv)| qv as i32 * xv as i32)
                    .sum();
                sumi += sm[s] as i32 * dot;
                summ += sm[8 + s] as i32 * (bs[2 * s] as i32 + bs[2 * s + 1] as i32);
            }
            let dx = q8.d[mi * nb + b];
            *a = (sumi as f32).mul_add(d * dx, *a);
            *a = (summ as f32).mul_add(-(dmin * dx), *a);
        }
    }
    out[..mc].copy_from_slice(&acc[..mc]);
}

/// Q6_K (210-byte blocks: ql[128], qh[64], scales (i8)[16], d).
unsafe fn q6k_scalar(w: *const u8, acts: &Acts<'_>, m0: usize, mc: usize, out: &mut [f32; ROWS]) {
    let q8 = acts.q8k.as_ref().unwrap_unchecked();
    let (k, nb) = (acts.k, acts.k / 256);
    let mut acc = [0.0f32; ROWS];
    let mut q = [0u8; 256];
    for b in 0..nb {
        let blk = std::slice::from_raw_parts(w.add(b * Q6K_BYTES), Q6K_BYTES);
        let (ql, qh, sc) = (&blk[0..128], &blk[128..192], &blk[192..208]);
        let d = h(blk.as_ptr().add(208));
        // value 128 c + 32 t + i: low 4 bits of ql[64 c + 32 (t % 2) + i] >> 4 (t / 2), high 2
        // of qh[32 c + i] >> 2 t
        for c in 0..2 {
            let (ql, qh, q) = (
                &ql[64 * c..64 * c + 64],
                &qh[32 * c..32 * c + 32],
                &mut q[128 * c..128 * c + 128],
            );
            for i in 0..32 {
                let h = qh[i];
                q[i] = (ql[i] & 0x0F) | ((h & 3) << 4);
                q[32 + i] = (ql[32 + i] & 0x0F) | (((h >> 2) & 3) << 4);
                q[64 + i] = (ql[i] >> 4) | (((h >> 4) & 3) << 4);
                q[96 + i] = (ql[32 + i] >> 4) | ((h >> 6) << 4);
            }
        }
        for (r, a) in acc.iter_mut().enumerate().take(mc) {
            let mi = m0 + r;
            let x = &q8.qs[mi * k + 256 * b..mi * k + 256 * b + 256];
            let bs = &q8.bsums[mi * (k / 16) + 16 * b..mi * (k / 16) + 16 * b + 16];
            let mut sumi = 0i32;
            for g in 0..16 {
                let dot: i32 = q[16 * g..16 * g + 16]
                    .iter()
                    .zip(&x[16 * g..16 * g + 16])
                    .map(|(&qv, &xv)| qv as i32 * xv as i32)
                    .sum();
                sumi += (sc[g] as i8) as i32 * (dot - 32 * bs[g] as i32);
            }
            *a = (sumi as f32).mul_add(d * q8.d[mi * nb + b], *a);
        }
    }
    out[..mc].copy_from_slice(&acc[..mc]);
}

// ---------------------------------------------------------------------------------------------
// AVX2 path

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

#[cfg(target_arch = "x86_64")]
use super::hsum;

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q4k_avx2(
    w: *const u8,
    acts: &Acts<'_>,
    m0: usize,
    mc: usize,
    out: &mut [f32; ROWS],
) {
    match mc {
        4 => q45k_avx2_rows::<4, false>(w, acts, m0, out),
        3 => q45k_avx2_rows::<3, false>(w, acts, m0, out),
        2 => q45k_avx2_rows::<2, false>(w, acts, m0, out),
        _ => q45k_avx2_rows::<1, false>(w, acts, m0, out),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5k_avx2(w: *const u8, acts: &Acts<'_>, m0: usize, mc: usize, out: &mut [f32; ROWS]) {
    match mc {
        4 => q45k_avx2_rows::<4, true>(w, acts, m0, out),
        3 => q45k_avx2_rows::<3, true>(w, acts, m0, out),
        2 => q45k_avx2_rows::<2, true>(w, acts, m0, out),
        _ => q45k_avx2_rows::<1, true>(w, acts, m0, out),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6k_avx2(w: *const u8, acts: &Acts<'_>, m0: usize, mc: usize, out: &mut [f32; ROWS]) {
    match mc {
        4 => q6k_avx2_rows::<4>(w, acts, m0, out),
        3 => q6k_avx2_rows::<3>(w, acts, m0, out),
        2 => q6k_avx2_rows::<2>(w, acts, m0, out),
        _ => q6k_avx2_rows::<1>(w, acts, m0, out),
    }
}

/// `vpshufb` masks: 0 .. 8 broadcast i16 lane `s` of each 128-bit half (Q4_K / Q5_K scale
/// of sub-block `s`); 8: bytes 8 .. 16 each twice (`[8, 8, 9, 9, .., 15, 15]`: the mins as
/// pairs); 9 + t (t < 4): i16 lane `2 t` over the low 128 bits, `2 t + 1` over the high (Q6_K
/// scales of groups `2 t`, `2 t + 1` of a 128-value half).
#[cfg(target_arch = "x86_64")]
static PICK_I16: [[u8; 32]; 13] = {
    let mut m = [[0u8; 32]; 13];
    let mut s = 0;
    while s < 8 {
        let mut i = 0;
        while i < 16 {
            m[s][2 * i] = 2 * s as u8;
            m[s][2 * i + 1] = 2 * s as u8 + 1;
            i += 1;
        }
        s += 1;
    }
    let mut i = 0;
    while i < 32 {
        m[8][i] = 8 + (i % 16) as u8 / 2;
        i += 1;
    }
    let mut t = 0;
    while t < 4 {
        let mut i = 0;
        while i < 8 {
            m[9 + t][2 * i] = 4 * t as u8;
            m[9 + t][2 * i + 1] = 4 * t as u8 + 1;
            m[9 + t][16 + 2 * i] = 4 * t as u8 + 2;
            m[9 + t][16 + 2 * i + 1] = 4 * t as u8 + 3;
            i += 1;
        }
        t += 1;
    }
    m
};

/// `p`, hidden from the optimizer (so loads through it are not constant-folded).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::pointers_in_nomem_asm_block)] // the block reads nothing: it only hides `p`
pub(super) fn opaque<T>(mut p: *const T) -> *const T {
    // SAFETY: an empty asm statement that only "modifies" a register.
    unsafe {
        std::arch::asm!("/* {0} */", inout(reg) p, options(pure, nomem, nostack, preserves_flags))
    };
    p
}

/// [`scales_mins`] in SSE registers: bytes 0 .. 8 the scales, 8 .. 16 the mins (reads 16
/// bytes from `p`, the block's bytes 4 .. 20).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn scales_mins_sse(p: *const u8) -> __m128i {
    let v = _mm_loadu_si128(p as *const __m128i); // words a, b, c (and one more)
    let acbc = _mm_shuffle_epi32::<0b10_01_10_00>(v);
    let aabb = _mm_shuffle_epi32::<0b01_01_00_00>(v);
    let low6 = _mm_and_si128(acbc, _mm_set1_epi8(0x3F)); // words 0, 2: a & 0x3F.., b & 0x3F..
    let high = _mm_or_si128(
        _mm_and_si128(
            _mm_srlv_epi32(acbc, _mm_set_epi32(4, 0, 0, 0)),
            _mm_set1_epi8(0x0F),
        ),
        _mm_and_si128(_mm_srli_epi32::<2>(aabb), _mm_set1_epi8(0x30)),
    ); // words 1, 3: c's nibbles with a's, b's top two bits
    _mm_blend_epi32::<0b1010>(low6, high)
}

/// `v`, passed through an empty `asm!` block that the compiler may not move past the others:
/// without it, it reassociates the exact integer sums across sub-blocks and rows (all the
/// products first, spilled, then all the sums); with it the code runs in source order, one
/// 64-value step at a time, its rows in turn (measured: ~25 % faster at 4 rows).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn keep(mut v: __m256i) -> __m256i {
    std::arch::asm!("/* {0} */", inout(ymm_reg) v, options(nomem, nostack, preserves_flags));
    v
}

/// Prefetch the super-block `bytes` ahead of `blk` into L2.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn prefetch_block(blk: *const u8, bytes: usize) {
    let p = blk.wrapping_add(PREFETCH_BYTES);
    let mut off = 0;
    while off < bytes {
        crate::simd::prefetch_l2(p.wrapping_add(off) as *const i8);
        off += 64;
    }
}

/// Q4_K / Q5_K (`FIVE`) weight row against activation rows m0 .. m0 + MC.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn q45k_avx2_rows<const MC: usize, const FIVE: bool>(
    w: *const u8,
    acts: &Acts<'_>,
    m0: usize,
    out: &mut [f32; ROWS],
) {
    let q8 = acts.q8k.as_ref().unwrap_unchecked();
    let (k, nb) = (acts.k, acts.k / 256);
    let bytes = if FIVE { Q5K_BYTES } else { Q4K_BYTES };
    let xq = q8.qs.as_ptr().add(m0 * k);
    let xd = q8.d.as_ptr().add(m0 * nb);
    let xs = q8.bsums.as_ptr().add(m0 * (k / 16));
    let low4 = _mm256_set1_epi8(0x0F);
    let bit4 = _mm256_set1_epi8(0x10);
    // (opaque to the compiler, so each pick stays one vpshufb)
    let pick = opaque(PICK_I16.as_ptr());
    let mut acc = [_mm256_setzero_ps(); MC];
    for b in 0..nb {
        let blk = w.add(b * bytes);
        prefetch_block(blk, bytes);
        // d, dmin
        let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(
            blk as *const i32,
        )));
        let (d_v, dmin_v) = (
            _mm256_broadcastss_ps(dm),
            _mm256_broadcastss_ps(_mm_movehdup_ps(dm)),
        );
        let sm = scales_mins_sse(blk.add(4));
        // scales as i16 in both 128-bit halves (for the per-sub-block broadcasts)
        let sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
        // mins as i16 pairs [m0, m0, m1, m1, .., m7, m7], for madd with the sums of 16
        let mins = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(
            sm,
            _mm_loadu_si128(pick.add(8) as *const __m128i),
        ));
        let qs = blk.add(if FIVE { 48 } else { 16 });
        let mut hb = if FIVE {
            _mm256_loadu_si256(blk.add(16) as *const __m256i)
        } else {
            _mm256_setzero_si256()
        };
        let mut sumi = [_mm256_setzero_si256(); MC];
        for j in 0..4 {
            // sub-blocks 2j (low nibbles) and 2j + 1 (high nibbles) of qs[32 j ..][..32]
            let bits = _mm256_loadu_si256(qs.add(32 * j) as *const __m256i);
            let mut lo = _mm256_and_si256(bits, low4);
            let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(bits), low4);
            if FIVE {
                // hb holds sub-block 2j's fifth bits at bit 0 of each byte, 2j + 1's at bit 1
                // (the bits a 16-bit shift carries across bytes never land on bit 4)
                lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16::<4>(hb), bit4));
                hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16::<3>(hb), bit4));
                hb = _mm256_srli_epi16::<2>(hb);
            }
            let s_lo =
                _mm256_shuffle_epi8(sc16, _mm256_loadu_si256(pick.add(2 * j) as *const __m256i));
            let s_hi = _mm256_shuffle_epi8(
                sc16,
                _mm256_loadu_si256(pick.add(2 * j + 1) as *const __m256i),
            );
            for (r, si) in sumi.iter_mut().enumerate() {
                let x = xq.add(r * k + 256 * b + 64 * j);
                let x_lo = _mm256_loadu_si256(x as *const __m256i);
                let x_hi = _mm256_loadu_si256(x.add(32) as *const __m256i);
                let p_lo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x_lo), s_lo);
                let p_hi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x_hi), s_hi);
                *si = keep(_mm256_add_epi32(*si, _mm256_add_epi32(p_lo, p_hi)));
            }
        }
        for (r, a) in acc.iter_mut().enumerate() {
            let dx = *xd.add(r * nb + b);
            let bs = _mm256_loadu_si256(xs.add(r * (k / 16) + 16 * b) as *const __m256i);
            let summ = _mm256_madd_epi16(bs, mins);
            // (d * sumi - dmin * summ) * d_x
            let f = _mm256_fnmadd_ps(
                _mm256_cvtepi32_ps(summ),
                dmin_v,
                _mm256_mul_ps(_mm256_cvtepi32_ps(sumi[r]), d_v),
            );
            *a = _mm256_fmadd_ps(f, _mm256_set1_ps(dx), *a);
        }
    }
    for (o, a) in out.iter_mut().zip(&acc) {
        *o = hsum(*a);
    }
}

/// Q6_K weight row against activation rows m0 .. m0 + MC.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn q6k_avx2_rows<const MC: usize>(
    w: *const u8,
    acts: &Acts<'_>,
    m0: usize,
    out: &mut [f32; ROWS],
) {
    let q8 = acts.q8k.as_ref().unwrap_unchecked();
    let (k, nb) = (acts.k, acts.k / 256);
    let xq = q8.qs.as_ptr().add(m0 * k);
    let xd = q8.d.as_ptr().add(m0 * nb);
    let xs = q8.bsums.as_ptr().add(m0 * (k / 16));
    let low4 = _mm256_set1_epi8(0x0F);
    let bits45 = _mm256_set1_epi8(0x30);
    // (opaque to the compiler, so each pick stays one vpshufb)
    let pick = opaque(PICK_I16.as_ptr());
    let mut acc = [_mm256_setzero_ps(); MC];
    for b in 0..nb {
        let blk = w.add(b * Q6K_BYTES);
        prefetch_block(blk, Q6K_BYTES);
        let d_v = _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(
            blk.add(208) as *const u16,
        ) as i32)));
        let sc8 = _mm_loadu_si128(blk.add(192) as *const __m128i);
        let mut sumi = [_mm256_setzero_si256(); MC];
        for c in 0..2 {
            // the half's eight scales as i16, in both 128-bit halves
            let sc_c = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(if c == 0 {
                sc8
            } else {
                _mm_srli_si128::<8>(sc8)
            }));
            let ql0 = _mm256_loadu_si256(blk.add(64 * c) as *const __m256i);
            let ql1 = _mm256_loadu_si256(blk.add(64 * c + 32) as *const __m256i);
            let qh = _mm256_loadu_si256(blk.add(128 + 32 * c) as *const __m256i);
            // values 128 c + 32 t + i: low 4 bits from ql, bits 4..6 from qh bits 2t, 2t + 1
            // (a 16-bit shift's bits carried across bytes never land on bits 4, 5)
            let q = [
                _mm256_or_si256(
                    _mm256_and_si256(ql0, low4),
                    _mm256_and_si256(_mm256_slli_epi16::<4>(qh), bits45),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(ql1, low4),
                    _mm256_and_si256(_mm256_slli_epi16::<2>(qh), bits45),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), low4),
                    _mm256_and_si256(qh, bits45),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), low4),
                    _mm256_and_si256(_mm256_srli_epi16::<2>(qh), bits45),
                ),
            ];
            for (t, &qt) in q.iter().enumerate() {
                // groups 8 c + 2 t (low 128 bits) and 8 c + 2 t + 1 (high 128 bits)
                let s = _mm256_shuffle_epi8(
                    sc_c,
                    _mm256_loadu_si256(pick.add(9 + t) as *const __m256i),
                );
                for (r, si) in sumi.iter_mut().enumerate() {
                    let x = _mm256_loadu_si256(
                        xq.add(r * k + 256 * b + 128 * c + 32 * t) as *const __m256i
                    );
                    *si = keep(_mm256_add_epi32(
                        *si,
                        _mm256_madd_epi16(_mm256_maddubs_epi16(qt, x), s),
                    ));
                }
            }
        }
        // the offset: 32 * sum_g sc_g * bsums[g]
        let sc16 = _mm256_cvtepi8_epi16(sc8);
        for (r, a) in acc.iter_mut().enumerate() {
            let dx = *xd.add(r * nb + b);
            let bs = _mm256_loadu_si256(xs.add(r * (k / 16) + 16 * b) as *const __m256i);
            let off = _mm256_slli_epi32::<5>(_mm256_madd_epi16(bs, sc16));
            let si = _mm256_sub_epi32(sumi[r], off);
            *a = _mm256_fmadd_ps(
                _mm256_mul_ps(_mm256_cvtepi32_ps(si), d_v),
                _mm256_set1_ps(dx),
                *a,
            );
        }
    }
    for (o, a) in out.iter_mut().zip(&acc) {
        *o = hsum(*a);
    }
}

#[cfg(test)]
#[path = "kquants_tests.rs"]
mod tests;
