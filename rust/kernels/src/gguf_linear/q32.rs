//! The 32-value formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) times activations in blocks of 32
//! ([`super::acts::Q8Rows`]): per block an exact int32 dot, then one f32 multiply-add.
//!
//! - Q4_0 / Q5_0 / Q8_0: `d_w * d_x * sum(q_w * q_x)` (q_w with its offset removed: -8, -16).
//! - Q4_1 / Q5_1: `d_w * d_x * sum(q_w * q_x) + m_w * s_x` (q_w unsigned, s_x = d_x * sum(q_x)).
//!
//! Both paths unpack a weight block once and apply it to each of the `mc` activation rows, each
//! row with its own accumulators and the same operations in the same order whatever `mc`, `m0`
//! and the other rows (batch invariance).
//!
//! - Portable: per row one f32 accumulator, per block `acc = fma(dot, d_w * d_x, acc)` then
//!   (Q4_1, Q5_1) `acc = fma(m_w, s_x, acc)`, blocks in order.
//! - AVX2: the block's 32 weights as bytes (nibbles spread over 32 bytes, the fifth bits of
//!   Q5 expanded from `qh` by a byte shuffle and a compare), `vpmaddubsw` of the unsigned
//!   weight bytes (Q4_1, Q5_1: 0..31) or of |q_w| against q_x given q_w's sign (Q4_0, Q5_0,
//!   Q8_0; |q_w| <= 128, |q_x| <= 127: a pair sums to at most 32512, no saturation), `vpmaddwd`
//!   with ones to eight i32 (exact), one convert and one FMA by `d_w * d_x` into a float
//!   accumulator. Even and odd blocks go to two accumulators (the FMA latency would otherwise
//!   bound the decode loop), added and summed horizontally once at the end; the minimum's
//!   `m_w * s_x` goes to two scalar accumulators the same way and is added last.

use super::{Acts, DotFn, Path, ROWS};
use crate::dequant::GgmlType;
use half::f16;

/// Format ids of the const generic parameter (the order of [`BYTES`]).
const Q4_0: u8 = 0;
const Q4_1: u8 = 1;
const Q5_0: u8 = 2;
const Q5_1: u8 = 3;
const Q8_0: u8 = 4;

/// Bytes per block of each format id.
const BYTES: [usize; 5] = [18, 20, 22, 24, 34];

/// Whether format `F` has a minimum (`x = d * q + m`).
const fn affine(f: u8) -> bool {
    f == Q4_1 || f == Q5_1
}

pub(super) fn select(ty: GgmlType, path: Path) -> Option<DotFn> {
    match path {
        Path::Scalar => Some(match ty {
            GgmlType::Q4_0 => scalar::<Q4_0>,
            GgmlType::Q4_1 => scalar::<Q4_1>,
            GgmlType::Q5_0 => scalar::<Q5_0>,
            GgmlType::Q5_1 => scalar::<Q5_1>,
            GgmlType::Q8_0 => scalar::<Q8_0>,
            _ => return None,
        }),
        #[cfg(target_arch = "x86_64")]
        Path::Avx2 => {
            // every AVX2 CPU has F16C, but Path::Avx2 only checked AVX2 and FMA
            if !std::arch::is_x86_feature_detected!("f16c") {
                return select(ty, Path::Scalar);
            }
            Some(match ty {
                GgmlType::Q4_0 => avx2::<Q4_0>,
                GgmlType::Q4_1 => avx2::<Q4_1>,
                GgmlType::Q5_0 => avx2::<Q5_0>,
                GgmlType::Q5_1 => avx2::<Q5_1>,
                GgmlType::Q8_0 => avx2::<Q8_0>,
                _ => return None,
            })
        }
    }
}

#[inline(always)]
unsafe fn h(p: *const u8) -> f32 {
    f16::from_bits(std::ptr::read_unaligned(p as *const u16)).to_f32()
}

/// Block `blk` of format `F` as its 32 integer weights (offset removed for the symmetric
/// formats) -> (d, m) (m = 0 for the symmetric formats).
#[inline(always)]
unsafe fn decode<const F: u8>(blk: *const u8, q: &mut [i8; 32]) -> (f32, f32) {
    let b = |i: usize| *blk.add(i);
    match F {
        Q4_0 | Q4_1 => {
            let (at, off) = if F == Q4_0 { (2, 8) } else { (4, 0) };
            for j in 0..16 {
                q[j] = (b(at + j) & 0x0F) as i8 - off;
                q[j + 16] = (b(at + j) >> 4) as i8 - off;
            }
        }
        Q5_0 | Q5_1 => {
            let (at, off) = if F == Q5_0 { (2, 16) } else { (4, 0) };
            let qh = std::ptr::read_unaligned(blk.add(at) as *const u32).to_le();
            for j in 0..16 {
                let lo = (b(at + 4 + j) & 0x0F) | ((((qh >> j) & 1) as u8) << 4);
                let hi = (b(at + 4 + j) >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
                q[j] = lo as i8 - off;
                q[j + 16] = hi as i8 - off;
            }
        }
        _ => {
            for (j, v) in q.iter_mut().enumerate() {
                *v = b(2 + j) as i8;
            }
        }
    }
    let m = if affine(F) { h(blk.add(2)) } else { 0.0 };
    (h(blk), m)
}

/// The portable path of format `F`.
unsafe fn scalar<const F: u8>(
    w: *const u8,
    acts: &Acts<'_>,
    m0: usize,
    mc: usize,
    out: &mut [f32; ROWS],
) {
    let q8 = acts.q8.as_ref().unwrap_unchecked();
    let (k, nb) = (acts.k, acts.k / 32);
    let mut acc = [0.0f32; ROWS];
    let mut q = [0i8; 32];
    for b in 0..nb {
        let (dw, mw) = decode::<F>(w.add(BYTES[F as usize] * b), &mut q);
        for (i, a) in acc.iter_mut().enumerate().take(mc) {
            let mi = m0 + i;
            let xq = &q8.qs[mi * k + 32 * b..mi * k + 32 * b + 32];
            let mut dot = 0i32;
            for (&wv, &xv) in q.iter().zip(xq) {
                dot += wv as i32 * xv as i32;
            }
            *a = (dot as f32).mul_add(dw * q8.d[mi * nb + b], *a);
            if affine(F) {
                *a = mw.mul_add(q8.s[mi * nb + b], *a);
            }
        }
    }
    out[..mc].copy_from_slice(&acc[..mc]);
}

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Bytes ahead of the read position that the weight row is prefetched.
#[cfg(target_arch = "x86_64")]
const PREFETCH_BYTES: usize = 1024;

/// The AVX2 path of format `F`: one instantiation per row count.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2<const F: u8>(
    w: *const u8,
    acts: &Acts<'_>,
    m0: usize,
    mc: usize,
    out: &mut [f32; ROWS],
) {
    match mc {
        4 => avx2_rows::<F, 4>(w, acts, m0, out),
        3 => avx2_rows::<F, 3>(w, acts, m0, out),
        2 => avx2_rows::<F, 2>(w, acts, m0, out),
        _ => avx2_rows::<F, 1>(w, acts, m0, out),
    }
}

/// A weight block unpacked for `vpmaddubsw`: `u` the unsigned operand (the weights, or their
/// magnitudes), `s` the weights whose signs go to the activations (symmetric formats), `d` the
/// scale in every lane, `m` the minimum (affine formats).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Unpacked {
    u: __m256i,
    s: __m256i,
    d: __m256,
    m: f32,
}

/// Constants of the unpacking, made once per call.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Consts {
    low4: __m256i,
    /// Byte j: byte j / 8 of the broadcast `qh` (in each 128-bit lane: bytes 0, 1 | 2, 3).
    spread: __m256i,
    /// Byte j: bit j % 8.
    bit: __m256i,
    /// Q4_0: 8; Q5_0: 0xF0 (or-ing it to a nibble subtracts 16); Q5_1: 0x10.
    off: __m256i,
    ones: __m256i,
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn consts<const F: u8>() -> Consts {
    Consts {
        low4: _mm256_set1_epi8(0x0F),
        spread: _mm256_setr_epi64x(
            0,
            0x0101_0101_0101_0101,
            0x0202_0202_0202_0202,
            0x0303_0303_0303_0303,
        ),
        bit: _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64),
        off: _mm256_set1_epi8(match F {
            Q4_0 => 8,
            Q5_0 => 0xF0u8 as i8,
            _ => 0x10,
        }),
        ones: _mm256_set1_epi16(1),
    }
}

/// 16 bytes of nibbles at `p` -> 32 bytes: the low nibbles, then the high ones.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn nibbles(p: *const u8, c: &Consts) -> __m256i {
    let q = _mm_loadu_si128(p as *const __m128i);
    _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(q), q), c.low4)
}

/// The 32 bits at `p` -> 32 bytes, byte j 0xFF where bit j is set, else 0.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn bit_bytes(p: *const u8, c: &Consts) -> __m256i {
    let qh = std::ptr::read_unaligned(p as *const i32);
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(qh), c.spread);
    _mm256_cmpeq_epi8(_mm256_and_si256(bytes, c.bit), c.bit)
}

/// (d, m) of the f16 pair at `p` (m only meaningful for the affine formats).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn scales(p: *const u8) -> (__m256, f32) {
    // 4 bytes: d and m, or d and the first two data bytes (every block is longer)
    let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(p as *const i32)));
    (
        _mm256_broadcastss_ps(dm),
        _mm_cvtss_f32(_mm_movehdup_ps(dm)),
    )
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn unpack<const F: u8>(blk: *const u8, c: &Consts) -> Unpacked {
    let (d, m) = scales(blk);
    let (u, s) = match F {
        Q4_0 => {
            let s = _mm256_sub_epi8(nibbles(blk.add(2), c), c.off);
            (_mm256_sign_epi8(s, s), s)
        }
        Q4_1 => {
            let u = nibbles(blk.add(4), c);
            (u, u)
        }
        Q5_0 => {
            // nibble | 0xF0 (as i8: nibble - 16) where the fifth bit is clear
            let hi = _mm256_andnot_si256(bit_bytes(blk.add(2), c), c.off);
            let s = _mm256_or_si256(nibbles(blk.add(6), c), hi);
            (_mm256_sign_epi8(s, s), s)
        }
        Q5_1 => {
            let hi = _mm256_and_si256(bit_bytes(blk.add(4), c), c.off);
            let u = _mm256_or_si256(nibbles(blk.add(8), c), hi);
            (u, u)
        }
        _ => {
            let s = _mm256_loadu_si256(blk.add(2) as *const __m256i);
            // |-128| = 0x80 read as unsigned 128: still exact
            (_mm256_sign_epi8(s, s), s)
        }
    };
    Unpacked { u, s, d, m }
}

/// Block `b` (unpacked in `wb`) against activation rows `m0 ..` into `acc` / `sm`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn rows_block<const F: u8, const MC: usize>(
    wb: &Unpacked,
    xq: *const i8,
    xd: *const f32,
    xs: *const f32,
    k: usize,
    nb: usize,
    b: usize,
    c: &Consts,
    acc: &mut [__m256; MC],
    sm: &mut [f32; MC],
) {
    for i in 0..MC {
        let x = _mm256_loadu_si256(xq.add(i * k + 32 * b) as *const __m256i);
        let pairs = if affine(F) {
            _mm256_maddubs_epi16(wb.u, x)
        } else {
            _mm256_maddubs_epi16(wb.u, _mm256_sign_epi8(x, wb.s))
        };
        let dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, c.ones));
        let scale = _mm256_mul_ps(wb.d, _mm256_broadcast_ss(&*xd.add(i * nb + b)));
        acc[i] = _mm256_fmadd_ps(dot, scale, acc[i]);
        if affine(F) {
            sm[i] = wb.m.mul_add(*xs.add(i * nb + b), sm[i]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    let v4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
    _mm_cvtss_f32(_mm_add_ss(v2, _mm_movehdup_ps(v2)))
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn avx2_rows<const F: u8, const MC: usize>(
    w: *const u8,
    acts: &Acts<'_>,
    m0: usize,
    out: &mut [f32; ROWS],
) {
    let q8 = acts.q8.as_ref().unwrap_unchecked();
    let (k, nb) = (acts.k, acts.k / 32);
    let bytes = BYTES[F as usize];
    let xq = q8.qs.as_ptr().add(m0 * k);
    let xd = q8.d.as_ptr().add(m0 * nb);
    let xs = q8.s.as_ptr().add(m0 * nb);
    let c = consts::<F>();
    let mut acc0 = [_mm256_setzero_ps(); MC];
    let mut acc1 = [_mm256_setzero_ps(); MC];
    let mut sm0 = [0.0f32; MC];
    let mut sm1 = [0.0f32; MC];
    let mut b = 0;
    while b + 2 <= nb {
        let blk = w.add(bytes * b);
        crate::simd::prefetch_l2(blk.wrapping_add(PREFETCH_BYTES) as *const i8);
        let w0 = unpack::<F>(blk, &c);
        let w1 = unpack::<F>(blk.add(bytes), &c);
        rows_block::<F, MC>(&w0, xq, xd, xs, k, nb, b, &c, &mut acc0, &mut sm0);
        rows_block::<F, MC>(&w1, xq, xd, xs, k, nb, b + 1, &c, &mut acc1, &mut sm1);
        b += 2;
    }
    if b < nb {
        let w0 = unpack::<F>(w.add(bytes * b), &c);
        rows_block::<F, MC>(&w0, xq, xd, xs, k, nb, b, &c, &mut acc0, &mut sm0);
    }
    for i in 0..MC {
        let s = hsum(_mm256_add_ps(acc0[i], acc1[i]));
        out[i] = if affine(F) { s + (sm0[i] + sm1[i]) } else { s };
    }
}

#[cfg(test)]
#[path = "q32_tests.rs"]
mod tests;
